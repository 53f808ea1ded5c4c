"""`python -m specdec` on tiny models saved to a temporary directory (no download).

    pytest tests/test_specdec_cli.py -q
"""
from __future__ import annotations

import json

import pytest

from specdec.tiny import tiny_draft, tiny_model, tiny_tokenizer
from specdec.__main__ import main


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("specdec_cli")
    tok, target = tiny_tokenizer(), tiny_model(seed=0)
    for name, model in (("target", target), ("draft", tiny_draft(target, noise=0.04))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("drafter", [["--draft", "draft"], ["--prompt-lookup"]])
def test_cli_prints_text_and_metrics(model_dirs, drafter, capsys):
    if drafter[0] == "--draft":
        drafter = ["--draft", str(model_dirs / "draft")]
    rc = main(["--target", str(model_dirs / "target"), *drafter, "--prompt", "hello there",
               "--max-new-tokens", "12", "--gamma", "3", "--baseline", "--device", "cpu", "--json"])
    assert rc == 0
    text, metrics = capsys.readouterr().out.split("--- metrics\n")
    report = json.loads(metrics)
    assert report["greedy_identical"] is True
    assert report["gamma"] == 3 and report["emitted"] >= 1
    assert "acceptance_rate" in report and "speedup" in report


def test_cli_summary_reads_as_the_json_does(model_dirs, capsys):
    """Without --json: a few labelled lines, no JSON; their α, τ and token count are the JSON's."""
    args = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--prompt", "hello there",
            "--max-new-tokens", "12", "--gamma", "3", "--baseline", "--device", "cpu"]
    assert main(args) == 0
    summary = capsys.readouterr().out.split("--- metrics\n")[1]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.split("--- metrics\n")[1])
    lines = dict(line.split(maxsplit=1) for line in summary.strip().splitlines() if not line.startswith("every"))
    assert set(lines) == {"target", "draft", "decoding", "tokens", "α", "τ", "speedup", "identical"}
    assert len(summary.splitlines()) < 12 and "{" not in summary
    assert lines["target"] == str(model_dirs / "target") and lines["draft"] == str(model_dirs / "draft")
    assert lines["decoding"].startswith("greedy; γ = 3")
    assert lines["α"].startswith(f"{report['acceptance_rate']:.3f} ")
    assert lines["τ"].startswith(f"{report['tokens_per_target_call']:.2f} ")
    assert lines["tokens"].startswith(f"{report['emitted']} new")
    assert lines["speedup"].endswith(" tokens/s)") and "×" in lines["speedup"]
    assert lines["identical"].startswith("yes")


def test_cli_summary_without_baseline_says_what_is_missing(model_dirs, capsys):
    assert main(["--target", str(model_dirs / "target"), "--prompt-lookup", "--prompt", "hello there",
                 "--max-new-tokens", "8", "--temperature", "0.7", "--device", "cpu"]) == 0
    summary = capsys.readouterr().out.split("--- metrics\n")[1]
    assert "speedup    not measured (--baseline" in summary
    assert "identical" not in summary  # compared only when greedy and with --baseline
    assert "decoding   sampled at temperature 0.7" in summary and "prompt lookup" in summary


def test_cli_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--json" in out and "examples:" in out and "python -m specdec --target DIR --draft DIR" in out
    for argv, words in ((["--prompt", "x", "--prompt-lookup"], "--target"),
                        (["--target", "t", "--prompt-lookup", "--prompt", "x", "--gamma", "three"], "--gamma")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
        assert "usage" not in err


def test_cli_rejects_bad_gamma(model_dirs, capsys):
    rc = main(["--target", str(model_dirs / "target"), "--prompt-lookup", "--prompt", "x", "--gamma", "0",
               "--device", "cpu"])
    assert rc == 2
    assert "gamma must be" in capsys.readouterr().err


def test_cli_uses_the_drafts_vocabulary_file(model_dirs, tmp_path, capsys):
    from specdec.drafters import DRAFT_VOCAB_FILE, save_draft_vocab

    draft = tmp_path / "draft"
    draft.mkdir()
    for f in (model_dirs / "draft").iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    save_draft_vocab(draft, range(3, 200), source="test")
    base = ["--target", str(model_dirs / "target"), "--draft", str(draft), "--prompt", "hello there",
            "--max-new-tokens", "12", "--gamma", "3", "--baseline", "--device", "cpu"]
    for choice, size in (("auto", 197), ("none", None), (str(draft / DRAFT_VOCAB_FILE), 197)):
        assert main([*base, "--draft-vocab", choice, "--json"]) == 0
        report = json.loads(capsys.readouterr().out.split("--- metrics\n")[1])
        assert report["draft_vocab"] == size and report["greedy_identical"] is True
    assert main([*base, "--draft-vocab", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
