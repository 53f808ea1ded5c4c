"""Bad input and faults (docs/faults.md): each gives one message naming the fix, a non-zero exit, and
leaves what was there intact; a resume never walks into a bad state. Tiny model, offline, CPU."""
from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from huggingface_hub import constants
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distill import checkpoint as ck
from distill import evaluate, generate, publish, records
import distill.distill
from distill.config import ConfigError, DataConfig, ModelConfig, unknown_keys
from distill.data import load_prompts
from distill.models import TokenizerMismatch, load_target, resolve_model_path
from specdec.tiny import tiny_model, tiny_tokenizer
from distill.distill import TrainingDiverged
from distill.cli import cli
from specdec import hub
from specdec.__main__ import main as specdec_main
from test_evaluate import make_cfg as eval_cfg
from test_evaluate import read_report, rows_of
from test_evaluate import run_root as eval_root  # noqa: F401 (a fixture: drafts in runs/r/distill)
from test_publish import _cfg as publish_cfg
from test_publish import run  # noqa: F401 (a fixture: a run dir as distill and evaluate leave it)
from test_distill import PROMPTS, ROOT, assert_same_weights, gen, losses, make_cfg, setup_run  # noqa: F401 (gen: a fixture)

NAN = ("train.max_steps=4", "train.save_every=1", "train.eval_every=4")


def biggest(path) -> float:
    return max(float(v.abs().max()) for v in load_file(str(path / "model.safetensors")).values())


# ---------------------------------------------------------------- 1. a non-finite loss


def test_nan_loss_names_the_last_good_checkpoint_and_a_lower_lr_resumes_from_it(gen, tmp_path, caplog):
    # warm-up: step 1 runs at lr 0 (checkpoint-1 = the initial weights), step 2 at 5e29 blows the weights up
    # (finite, ~1e29: checkpoint-2), step 3's loss from them is NaN
    cfg = setup_run(gen, tmp_path, "nan", *NAN, "train.lr=1e30", "train.warmup_steps=2")
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3 .*checkpoint-2 came from the weights that "
                                               r"diverged.*last good checkpoint is \S*/checkpoint-1;.*train.lr"):
        distill.distill.run(cfg)
    out = tmp_path / "nan" / "distill"
    assert [s for s, _ in ck.checkpoints(out)] == [1]
    assert biggest(out / "diverged-checkpoint-2") > 1e20 and biggest(out / "checkpoint-1") < 10
    # the advice: a lower lr, rerun. It resumes from checkpoint-1 with the new rate and equals a run made
    # with that rate from the start (step 1 ran at lr 0 in both)
    caplog.set_level(logging.INFO, logger="distill.distill")
    fixed = distill.distill.run(make_cfg(tmp_path, "nan", gen["prompts"], *NAN, "train.lr=1e-2", "train.warmup_steps=2"))
    assert "resuming from" in caplog.text and "checkpoint-1" in caplog.text and "train.lr=0.01" in caplog.text
    ref = distill.distill.run(setup_run(gen, tmp_path, "ref", *NAN, "train.lr=1e-2", "train.warmup_steps=2"))
    assert fixed["done"] and all(torch.isfinite(torch.tensor(losses(fixed))))
    assert losses(fixed) == losses(ref)
    assert_same_weights(out / "checkpoint-4", tmp_path / "ref" / "distill" / "checkpoint-4")


def test_nan_loss_with_no_good_checkpoint_says_the_rerun_starts_from_scratch(gen, tmp_path, caplog):
    cfg = setup_run(gen, tmp_path, "nan0", *NAN, "train.lr=1e30")
    with pytest.raises(TrainingDiverged, match=r"step 2 .*checkpoint-1 came from .*No good checkpoint.*from scratch"):
        distill.distill.run(cfg)
    out = tmp_path / "nan0" / "distill"
    assert ck.checkpoints(out) == [] and (out / "diverged-checkpoint-1").is_dir()
    caplog.set_level(logging.INFO, logger="distill.distill")
    fixed = distill.distill.run(make_cfg(tmp_path, "nan0", gen["prompts"], *NAN, "train.lr=1e-2"))
    assert "training from scratch" in caplog.text and fixed["done"] and not list(out.glob("diverged-*"))
    ref = distill.distill.run(setup_run(gen, tmp_path, "ref0", *NAN, "train.lr=1e-2"))
    assert losses(fixed) == losses(ref)


def test_non_finite_weights_are_never_saved(gen, tmp_path, monkeypatch):
    real, calls = torch.optim.AdamW.step, {"n": 0}

    def poisoned(self, *a, **kw):  # the third update leaves a NaN in the weights (the loss was still finite)
        out = real(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(TrainingDiverged, match=r"weights are not finite after step 3.*last good checkpoint is \S*checkpoint-2"):
        distill.distill.run(setup_run(gen, tmp_path, "nanw", *NAN))
    out = tmp_path / "nanw" / "distill"
    assert [s for s, _ in ck.checkpoints(out)] == [1, 2] and not list(out.glob("*checkpoint-3"))
    for _, path in ck.checkpoints(out):
        assert all(bool(torch.isfinite(v).all()) for v in load_file(str(path / "model.safetensors")).values())


# ---------------------------------------------------------------- 2. model paths, hub ids, the network


def closed_port() -> str:
    """A local URL nothing listens on: connecting is refused at once, as with no network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def one_error(err: str) -> str:
    # (a progress bar that the error ended may leave its line open: the message can follow it on that line)
    lines = [line[line.index("error: "):] for line in re.split(r"[\r\n]", err) if "error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_model_path_is_one_message_and_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "dir")
    res = subprocess.run([sys.executable, "-m", "distill.generate", "model=tiny", f"model.target={missing}",
                          f"runs_root={tmp_path}", "logger=none"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and f"model.target={missing!r} does not exist" in one_error(res.stderr)
    assert not (tmp_path / "default" / "generate" / "manifest.json").exists()
    for args in (["--target", missing, "--prompt-lookup"], ["--target", "tiny-target-dir", "--draft", missing]):
        args = [a.replace("tiny-target-dir", str(resolve_model_path("tiny", str(tmp_path / "cache")))) for a in args]
        assert specdec_main([*args, "--prompt", "hi", "--device", "cpu"]) == 2
        assert f"={missing!r} does not exist" in one_error(capsys.readouterr().err)


def test_hub_id_offline_or_unreachable_is_one_message_without_trying_to_download(monkeypatch):
    def never(*a, **kw):
        raise AssertionError("from_pretrained ran: it retries for most of a minute without a network")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", never)
    with pytest.raises(ConfigError, match=r"model.target='someorg/nomodel' is not a local dir.*HF_HUB_OFFLINE=1"):
        load_target(ModelConfig(target="someorg/nomodel"))  # conftest sets HF_HUB_OFFLINE=1
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", closed_port())
    with pytest.raises(ConfigError, match=r"hub at http://127.0.0.1:\d+ cannot be reached.*local model dir"):
        load_target(ModelConfig(target="someorg/nomodel"))
    # cached: loads from the cache instead of retrying the network
    monkeypatch.setattr(hub, "_cached", lambda name, revision: True)
    seen = {}
    assert hub.pretrained(lambda name, **kw: seen.update(kw) or "model", "someorg/cached", "--target") == "model"
    assert seen == {"local_files_only": True}


def test_hub_id_that_fails_to_load_names_the_token_and_a_local_dir(monkeypatch):
    monkeypatch.setattr(hub, "unreachable", lambda url: None)  # the hub answers...
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def gated(name, **kw):  # ...and refuses the id, as for a gated repo without a token
        raise OSError(f"You are trying to access a gated repo.\nAccess to model {name} is restricted.")

    with pytest.raises(ValueError, match=r"--target='org/gated' could not be loaded from the hub .*OSError: You are "
                                         r"trying to access a gated repo.*HF_TOKEN"):
        hub.pretrained(gated, "org/gated", "--target")


def test_upload_without_network_is_one_message_and_keeps_the_staged_folder(tmp_path, run, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_test_token")
    monkeypatch.setenv("HF_ENDPOINT", closed_port())
    cfg = publish_cfg(tmp_path, "publish.dry_run=false", "publish.repo_id=me/tiny-draft")
    with pytest.raises(SystemExit) as exc:
        cli(publish.run, cfg)
    assert exc.value.code == 2
    assert re.search(r"upload of \S+ to me/tiny-draft at http://127.0.0.1:\d+ failed \(\w+.*HF_TOKEN.*staged folder is kept",
                     one_error(capsys.readouterr().err))
    # the staged folder is whole and is what publish.json records: a rerun uploads it without restaging
    files = json.loads((run / "publish.json").read_text())["files"]
    assert files and {n: publish._sha256(run / "publish" / n) for n in files} == {n: f["sha256"] for n, f in files.items()}
    assert sorted(p.name for p in (run / "publish").iterdir()) == sorted(files)


# ---------------------------------------------------------------- 3. a padded-vocabulary draft


def test_padded_vocabulary_draft_is_evaluated_and_its_hf_assisted_row_skipped_with_the_reason(eval_root):
    best = eval_root / "runs" / "r" / "distill" / "best"
    draft = AutoModelForCausalLM.from_pretrained(best)
    draft.resize_token_embeddings(320)  # more embedding rows than the tokenizer's 259 (as Qwen2.5 drafts have)
    draft.save_pretrained(best)
    summary = evaluate.run(eval_cfg(eval_root, "evaluate.references=[target,hf_assisted]", "evaluate.timed_prompts=1"))
    report = read_report(eval_root)
    (hf,) = rows_of(report, "hf_assisted")
    assert hf["error"].startswith("skipped:") and "has 320 rows and the target's 259" in hf["error"]
    (row,) = rows_of(report, "best")
    assert row["acceptance_rate"] == 1.0 and summary["greedy_identical"]  # the same weights as the target
    assert [d["rule"] for d in report["doctor"] if d["draft"] == "hf_assisted"] == ["reference_skipped"]
    assert "skipped:" in (eval_root / "runs" / "r" / "evaluate" / "report.md").read_text()


# ---------------------------------------------------------------- 4. whose records, whose draft


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """Two more targets: one sharing the tiny tokenizer (other weights), one with another tokenizer."""
    root = tmp_path_factory.mktemp("targets")
    other_tok = tiny_tokenizer()
    other_tok.add_special_tokens({"additional_special_tokens": ["<|other|>"]})
    dirs = {"same_tok": (tiny_model(seed=1), tiny_tokenizer()), "other_tok": (tiny_model(seed=0, vocab_size=260), other_tok)}
    for name, (model, tok) in dirs.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {name: str(root / name) for name in dirs}


def test_distill_refuses_records_another_target_made(gen, tmp_path, targets, capsys):
    cfg = setup_run(gen, tmp_path, "own", "train.max_steps=2", f"model.target={targets['same_tok']}")
    with pytest.raises(SystemExit) as exc:
        cli(distill.distill.run, cfg)
    msg = one_error(capsys.readouterr().err)
    assert exc.value.code == 2 and "holds records made by 'tiny'" in msg and f"model.target={targets['same_tok']!r}" in msg
    assert "model.target: 'tiny' here" in msg and "another run_name" in msg and "generate.overwrite=true" in msg
    assert not (tmp_path / "own" / "distill" / "summary.json").exists()


def test_a_finished_distill_is_not_already_done_for_another_target(gen, tmp_path, targets):
    cfg = setup_run(gen, tmp_path, "done", "train.max_steps=2")
    first = distill.distill.run(cfg)
    assert first["target"] == "tiny"
    with pytest.raises(ConfigError, match=r"holds records made by 'tiny'.*tokenizer_fingerprint"):
        distill.distill.run(make_cfg(tmp_path, "done", gen["prompts"], "train.max_steps=2", f"model.target={targets['other_tok']}"))
    # a draft whose summary names another target is not resumed nor "already done" either
    path = tmp_path / "done" / "distill" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "target": "someone-else"}))
    with pytest.raises(ConfigError, match=r"distilled for model.target='someone-else', not 'tiny'; set train.resume=never"):
        distill.distill.run(cfg)
    best = load_file(str(tmp_path / "done" / "distill" / "best" / "model.safetensors"))
    again = distill.distill.run(make_cfg(tmp_path, "done", gen["prompts"], "train.max_steps=2", "train.resume=never"))
    assert again["target"] == "tiny" and again["done"] and best.keys() == load_file(
        str(tmp_path / "done" / "distill" / "best" / "model.safetensors")).keys()


def test_evaluate_and_publish_refuse_records_another_target_made(gen, tmp_path, targets):
    shutil.copytree(gen["dir"], tmp_path / "runs" / "r" / "generate")
    with pytest.raises(ConfigError, match=r"holds records made by 'tiny'"):
        evaluate.run(eval_cfg(tmp_path, f"model.target={targets['same_tok']}", "evaluate.drafts=[]"))
    assert not (tmp_path / "runs" / "r" / "evaluate" / "report.json").exists()
    with pytest.raises(ConfigError, match=r"holds records made by 'tiny'"):
        publish.run(publish_cfg(tmp_path, "run_name=r", f"model.target={targets['same_tok']}"))


def test_pretrained_draft_with_another_tokenizer_stops_generate_before_any_work(tmp_path, targets, monkeypatch):
    def no_work(*a, **kw):
        raise AssertionError("generate did work before the tokenizer check")

    monkeypatch.setattr(generate, "load_target", no_work)
    monkeypatch.setattr(generate, "build_items", no_work)
    cfg = make_cfg(tmp_path, "pre", str(tmp_path / "unused.jsonl"), "model.draft_init=pretrained",
                   f"model.draft={targets['other_tok']}", stage="generate")
    with pytest.raises(TokenizerMismatch, match="do not share a tokenizer"):
        generate.run(cfg)
    assert not list((tmp_path / "pre" / "generate").glob("*"))


# ---------------------------------------------------------------- 5. a truncated or corrupt checkpoint


def test_resume_falls_back_past_damaged_checkpoints_naming_them(gen, tmp_path, caplog):
    const = ("train.schedule=constant", "train.save_every=1", "train.eval_every=2")  # lr independent of max_steps
    distill.distill.run(setup_run(gen, tmp_path, "dmg", *const, "train.max_steps=4"))
    out = tmp_path / "dmg" / "distill"
    weights_file = out / "checkpoint-4" / "model.safetensors"
    with open(weights_file, "r+b") as f:  # truncate -s: the file ends early
        f.truncate(weights_file.stat().st_size // 2)
    (out / "checkpoint-3" / "accelerate" / "optimizer.bin").write_bytes(b"\0" * 100)  # a corrupt optimizer state
    caplog.set_level(logging.INFO, logger="distill.distill")
    more = distill.distill.run(make_cfg(tmp_path, "dmg", gen["prompts"], *const, "train.max_steps=6"))
    log = caplog.text
    assert re.search(r"checkpoint-4 cannot be resumed from \(\w+.*set aside as broken-checkpoint-4.*previous good "
                     r"checkpoint checkpoint-2", log)
    assert re.search(r"checkpoint-3 cannot be resumed from .*checkpoint-2", log) and "resuming from" in log
    assert (out / "broken-checkpoint-4").is_dir() and (out / "broken-checkpoint-3").is_dir() and more["step"] == 6
    ref = distill.distill.run(setup_run(gen, tmp_path, "whole", *const, "train.max_steps=6"))
    assert losses(more) == losses(ref)  # resumed at step 2: the same as never interrupted
    assert_same_weights(out / "checkpoint-6", tmp_path / "whole" / "distill" / "checkpoint-6")
    for _, path in ck.checkpoints(out):
        (path / "trainer_state.json").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no checkpoint in \S+ can be resumed from: checkpoint-6 \(.*rerun trains from scratch"):
        distill.distill.run(make_cfg(tmp_path, "dmg", gen["prompts"], *const, "train.max_steps=8"))
    assert ck.checkpoints(out) == [] and (out / "broken-checkpoint-6").is_dir()


def test_evaluate_exits_2_after_the_report_when_a_requested_draft_cannot_be_loaded(eval_root, capsys):
    best = eval_root / "runs" / "r" / "distill" / "best" / "model.safetensors"
    best.write_bytes(best.read_bytes()[:1000])  # truncated
    cfg = eval_cfg(eval_root, "evaluate.drafts=[best,checkpoints]")
    with pytest.raises(SystemExit) as exc:
        evaluate.main_cli(cfg)
    msg = one_error(capsys.readouterr().err)
    assert exc.value.code == 2 and re.search(r"1 requested draft\(s\) could not be loaded: best \(\S+best\): \w+", msg)
    report = read_report(eval_root)
    assert rows_of(report, "best")[0]["error"] and rows_of(report, "checkpoint-10")[0]["acceptance_rate"] == 1.0
    with pytest.raises(SystemExit) as exc:  # the report is current now; a rerun still does not pass
        evaluate.main_cli(cfg)
    assert exc.value.code == 2


# ---------------------------------------------------------------- 6. the minor ones


@pytest.mark.parametrize("text, needle", [
    ("", "the file is empty"),
    ("\n  \n", "the file is empty"),
    ('{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n', "line 2 is not valid JSON"),
    ('{"prompt": "a"}\n["b"]\n', "line 2 is a JSON list, not an object"),
])
def test_unreadable_jsonl_says_why(tmp_path, text, needle):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"data.path='{re.escape(str(path))}'.*{needle}"):
        load_prompts(OmegaConf.structured(DataConfig(source="file", path=str(path))))


def test_every_prompt_too_long_is_exit_2_naming_the_settings(gen, tmp_path, capsys):
    cfg = make_cfg(tmp_path, "long", gen["prompts"], "generate.max_prompt_tokens=3", stage="generate")
    with pytest.raises(SystemExit) as exc:
        cli(generate.run, cfg)
    msg = one_error(capsys.readouterr().err)
    assert exc.value.code == 2 and f"all {len(PROMPTS)} prompts are longer than the prompt limit of 3 tokens" in msg
    assert "raise generate.max_prompt_tokens" in msg and "generate.overlong=truncate" in msg
    assert not list((tmp_path / "long" / "generate").glob("*"))  # no manifest, no shard


def test_specdec_refuses_a_prompt_and_answer_longer_than_the_context(tmp_path, capsys):
    target = resolve_model_path("tiny", str(tmp_path / "cache"))  # max_position_embeddings=512, byte-level tokens
    args = ["--target", target, "--prompt-lookup", "--raw", "--device", "cpu"]
    assert specdec_main([*args, "--prompt", "x" * 500, "--max-new-tokens", "20"]) == 2
    msg = one_error(capsys.readouterr().err)
    assert "the prompt has 500 tokens and --max-new-tokens is 20: 520 positions, more than the context of 512" in msg
    assert "lower --max-new-tokens to 12" in msg
    assert specdec_main([*args, "--prompt", "x" * 500, "--max-new-tokens", "12"]) == 0  # exactly fits


@pytest.mark.parametrize("override, message", [
    ("+train.lrr=1", "train.lrr is not a setting: `+` added it and no stage reads it; remove it (did you mean train.lr?)"),
    ("+eval_data.mt_bench.sourcee=x", "eval_data.mt_bench.sourcee is not a setting"),
])
def test_a_key_added_with_plus_is_refused(gen, tmp_path, capsys, override, message):
    cfg = make_cfg(tmp_path, "plus", gen["prompts"], override)
    with pytest.raises(SystemExit) as exc:
        cli(distill.distill.run, cfg)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "plus").exists()
    # a free-form dict takes any key
    assert unknown_keys(make_cfg(tmp_path, "plus", gen["prompts"], "+model.draft_config.num_hidden_layers=1")) == []


# ---------------------------------------------------------------- 7. an interrupted publish, a full disk


def folder(path) -> dict:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_interrupted_publish_keeps_the_previous_folder(tmp_path, run):
    publish.run(publish_cfg(tmp_path))
    before, record = folder(run / "publish"), (run / "publish.json").read_text()
    # a kill during staging leaves a partial temp folder beside the intact one...
    partial = run / ".publish.tmp-killed"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    # ...and a kill between swap_in's two renames leaves the previous folder moved aside, none in place
    (run / "publish").rename(run / ".publish.old-12345")
    again = publish.run(publish_cfg(tmp_path))
    assert folder(run / "publish") == before and (run / "publish.json").read_text() == record  # restored, not restaged
    assert again["fingerprint"] == json.loads(record)["fingerprint"] and not list(run.glob(".publish.*"))


def no_space(real, fail_on: int):
    """`real` that, on its fail_on-th call, writes a few bytes of its file and raises ENOSPC."""
    calls = {"n": 0}

    def write(obj, where, *a, **kw):
        calls["n"] += 1
        if calls["n"] == fail_on:
            with open(where, "wb") as f:
                f.write(b"PAR1 half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, where, *a, **kw)

    return write


def test_full_disk_while_generating_is_one_message_and_keeps_the_written_shards(gen, tmp_path, monkeypatch, capsys):
    cfg = make_cfg(tmp_path, "full", gen["prompts"], "generate.shard_size=8", stage="generate")
    out = tmp_path / "full" / "generate"
    monkeypatch.setattr(records.pq, "write_table", no_space(records.pq.write_table, fail_on=2))
    with pytest.raises(SystemExit) as exc:
        cli(generate.run, cfg)
    msg = one_error(capsys.readouterr().err)
    assert exc.value.code == 2 and re.search(r"no space left on the device while writing \S+shard-r0-00001.parquet", msg)
    assert [p.name for p in out.iterdir()] == ["shard-r0-00000.parquet"]  # no half shard, no temp file
    assert len(records.load_generated(out)) == 8
    monkeypatch.undo()  # space freed: the rerun keeps the 8 records and makes the rest, as one run would
    generate.run(cfg)
    done, ref = records.load_generated(out), records.load_generated(gen["dir"])
    assert done["id"] == ref["id"] and done["response_ids"] == ref["response_ids"]


def test_full_disk_while_saving_a_checkpoint_keeps_the_previous_one(gen, tmp_path, monkeypatch, capsys, caplog):
    cfg = setup_run(gen, tmp_path, "fullck", *NAN)
    out = tmp_path / "fullck" / "distill"
    # accelerator.save_state calls torch.save three times per checkpoint (optimizer, RNG, scheduler): the 4th
    # call is checkpoint-2's optimizer state
    monkeypatch.setattr(torch, "save", no_space(torch.save, fail_on=4))
    with pytest.raises(SystemExit) as exc:
        cli(distill.distill.run, cfg)
    msg = one_error(capsys.readouterr().err)
    assert exc.value.code == 2 and re.search(r"no space left on the device while writing \S+checkpoint-2 ", msg)
    assert [s for s, _ in ck.checkpoints(out)] == [1] and not list(out.glob(".checkpoint-*"))
    assert not (out / "checkpoint-2").exists()
    monkeypatch.undo()
    caplog.set_level(logging.INFO, logger="distill.distill")
    done = distill.distill.run(cfg)  # resumes from checkpoint-1 and finishes
    assert re.search(r"resuming from \S+checkpoint-1 ", caplog.text)
    assert done["done"] and [s for s, _ in ck.checkpoints(out)] == [1, 2, 3, 4]
