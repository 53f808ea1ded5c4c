"""The evaluate stage on tiny models: report fields carry the decoder's counters, draft == target gives
α = 1 and τ = γ + 1, greedy mismatches fail loudly, drafts resolve from names and globs, bad input
gives one clear message (exit 2), a broken checkpoint among many becomes an error row."""
import json
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from distill import evaluate, measure
from distill import report as rpt
from distill.config import ConfigError
from distill.models import load_target
from distill.evalsets import Prompt
from specdec.tiny import tiny_draft, tiny_model, tiny_tokenizer
from specdec.decoder import SpeculativeDecoder
from specdec.metrics import SpecMetrics

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models are latency-bound; extra threads only fight other processes for the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def save_draft(path: Path, noise: float, tok=None) -> Path:
    tiny_draft(tiny_model(seed=0), noise).save_pretrained(path)
    (tok or tiny_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture
def run_root(tmp_path):
    d = tmp_path / "runs" / "r" / "distill"
    save_draft(d / "checkpoint-2", 0.05)
    save_draft(d / "checkpoint-10", 0.0)
    save_draft(d / "best", 0.0)
    return tmp_path


def make_cfg(root: Path, *overrides):
    base = [
        "model=tiny", "experiment=smoke", f"runs_root={root / 'runs'}", "run_name=r",
        f"model.cache_dir={root / 'cache'}", "~eval_data.humaneval", "evaluate.prompts_per_set=2",
        "evaluate.max_new_tokens=12", "evaluate.gammas=[3]", "evaluate.temperatures=[0.0]", "evaluate.repeats=1",
        "evaluate.warmup=0", "evaluate.references=[target]", "evaluate.drafts=[best]",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="evaluate", overrides=base + list(overrides))


def read_report(root: Path) -> dict:
    return json.loads((root / "runs" / "r" / "evaluate" / "report.json").read_text())


def rows_of(report, name):
    return [r for r in report["rows"] if r["name"] == name]


def test_draft_equal_to_target_accepts_everything(run_root):
    summary = evaluate.run(make_cfg(run_root))
    report = read_report(run_root)
    (row,) = rows_of(report, "best")
    assert summary["greedy_identical"] and row["greedy_identical"] is True
    assert row["acceptance_rate"] == 1.0 and row["draft_acceptance_ratio"] == 1.0
    assert row["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert row["teacher_forced_acceptance"] == pytest.approx(1.0, abs=1e-6)
    c = row["counters"]
    assert c["rejections"] == 0
    if c["emitted"] == row["prompts"] * 12:  # no early stop token: every round emits γ + 1
        assert row["tokens_per_target_call"] == 4.0
    assert row["tokens_per_target_call"] == c["emitted"] / c["row_rounds"]
    (target,) = rows_of(report, "target")
    assert target["speedup"] == 1.0 and target["kind"] == "target"
    assert report["best"]["name"] == "best" and report["best"]["gamma"] == 3


SCRIPT = [(3, 3, False, 4), (3, 1, True, 2), (3, 0, True, 1), (3, 2, True, 3)]  # γ, accepted, rejected, emitted


def test_report_carries_the_decoders_counters(run_root, monkeypatch):
    real = SpeculativeDecoder.generate

    def scripted(self, *a, **kw):
        out = real(self, *a, **kw)
        if not kw.get("temperature"):  # the greedy run (timed for the costs) stays real: replay checks it
            return out
        m = SpecMetrics(batch_size=out.metrics.batch_size, gamma=3, temperature=kw.get("temperature", 0.0))
        for rec in SCRIPT:
            m.record(*rec)
        m.target_calls, m.draft_calls = len(SCRIPT), 9
        m.draft_time_s, m.target_time_s, m.wall_time_s = 0.09, 0.4, 0.5
        out.metrics = m
        return out

    monkeypatch.setattr(SpeculativeDecoder, "generate", scripted)
    # sampled rows are measured by decoding the timed prompts (greedy ones by replay, below)
    evaluate.run(make_cfg(run_root, f"evaluate.drafts=[{run_root}/runs/r/distill/checkpoint-2]",
                          "evaluate.temperatures=[1.0]", "evaluate.timed_prompts=2"))
    report = read_report(run_root)
    (row,) = [r for r in rows_of(report, "checkpoint-2") if r["temperature"] == 1.0]
    assert row["scored_by"] == "decoding"
    assert row["timed_prompts"] == 0  # decoded once, not timed: its speedup is modeled from greedy costs
    batches = row["decoded_prompts"]  # batch size 1: one scripted metrics object per prompt
    accepted, tried, proposed = 6, 6 + 3, 12
    assert row["acceptance_rate"] == pytest.approx(accepted / tried)
    assert row["draft_acceptance_ratio"] == pytest.approx(accepted / proposed)
    assert row["tokens_per_target_call"] == pytest.approx(10 / 4)
    # k=1 tried in 4 rounds, accepted in 3; k=2 tried 3, accepted 2; k=3 tried 2, accepted 1
    assert row["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert row["accepted_length_histogram"] == [batches * n for n in (1, 1, 1, 1)]
    assert row["counters"]["accepted"] == batches * accepted and row["counters"]["rejections"] == batches * 3
    assert all(v["acceptance_rate"] == pytest.approx(accepted / tried) for v in row["by_category"].values())
    (greedy,) = [r for r in rows_of(report, "checkpoint-2") if r["temperature"] == 0.0 and r["gamma"] == 3]
    assert row["cost_ratio"] == pytest.approx(greedy["cost_ratio"]) and greedy["replay_check"]["equal"]
    a, g, c = row["acceptance_rate"], 3, row["cost_ratio"]
    assert row["predicted_speedup"] == pytest.approx((1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)))
    # every number carries its settings, and every metric name has a definition
    for key in ("eval_set", "temperature", "top_p", "gamma", "batch_size", "draft_sampled"):
        assert key in row
    for key in ("acceptance_rate", "draft_acceptance_ratio", "tokens_per_target_call", "per_position_acceptance",
                "teacher_forced_acceptance", "cost_ratio", "tokens_per_s", "speedup", "speedup_spread",
                "predicted_speedup", "greedy_identical", "by_category", "accepted_length_histogram"):
        assert key in row and key in report["definitions"], key
    assert set(report) >= {"target", "settings", "definitions", "rows", "greedy_identical", "best", "doctor"}


def test_replay_check_catches_counts_that_decoding_did_not_produce(run_root, monkeypatch, capsys):
    real = SpeculativeDecoder.generate

    def off_by_one(self, *a, **kw):  # a decoder that miscounts one acceptance
        out = real(self, *a, **kw)
        out.metrics.accepted += 1
        return out

    monkeypatch.setattr(SpeculativeDecoder, "generate", off_by_one)
    with pytest.raises(SystemExit) as exc:
        evaluate.main_cli(make_cfg(run_root, f"evaluate.drafts=[{run_root}/runs/r/distill/checkpoint-2]"))
    assert exc.value.code == evaluate.EXIT_GREEDY_MISMATCH
    report = read_report(run_root)
    (row,) = rows_of(report, "checkpoint-2")
    assert row["replay_check"]["equal"] is False and not report["greedy_identical"]
    assert any(d["rule"] == "replay_mismatch" for d in report["doctor"])


def test_replayed_counts_equal_decoded_counts_on_the_timed_prompts(run_root):
    evaluate.run(make_cfg(run_root, f"evaluate.drafts=[{run_root}/runs/r/distill/checkpoint-2]",
                          "evaluate.timed_prompts=2", "evaluate.timed_max_new_tokens=null", "evaluate.gammas=[1,3]",
                          "evaluate.timed_gammas=[1,3]"))
    report = read_report(run_root)
    rows = [r for r in report["rows"] if r.get("replay_check")]
    assert {r["name"] for r in rows} == {"checkpoint-2"} and len(rows) == 2
    for r in rows:
        assert r["replay_check"]["equal"] and r["replay_check"]["prompts"] == 2, r["replay_check"]
        assert r["scored_by"] == "replay" and r["prompts"] == 2 and r["timed_prompts"] == 2
        # at full length on every prompt the replayed counters are the decoded ones, so they are the row's
        lo, hi = r["acceptance_rate_ci"]
        assert lo <= r["acceptance_rate"] <= hi


def test_all_references_sampling_and_plots(run_root):
    cfg = make_cfg(run_root, "evaluate.drafts=[checkpoints]", "evaluate.temperatures=[0.0,1.0]",
                   "evaluate.gammas=[1,2]", "evaluate.timed_gammas=[2]",
                   "evaluate.references=[target,init,prompt_lookup,hybrid,hf_assisted]",
                   "evaluate.max_new_tokens=8")
    evaluate.run(cfg)
    report = read_report(run_root)
    names = list(dict.fromkeys(r["name"] for r in report["rows"]))
    assert names == ["target", "checkpoint-2", "checkpoint-10", "init", "prompt_lookup", "hybrid", "hf_assisted"]
    (hybrid,) = [r for r in rows_of(report, "hybrid") if r["gamma"] == 1 and r["temperature"] == 0]
    assert hybrid["draft"].endswith("checkpoint-2") and hybrid["scored_by"] == "replay"
    hf = rows_of(report, "hf_assisted")
    # one transformers reference per set, at the γ where the first draft's modeled speedup is highest
    assert len(hf) == 1 and all(r["batch_size"] == 1 and r["temperature"] == 0 for r in hf)
    first = [r for r in rows_of(report, "checkpoint-2") if r["scored_by"] == "replay"]
    assert hf[0]["gamma"] == max(first, key=lambda r: rpt.headline_speedup(r) or 0.0)["gamma"]
    assert all(r["tokens_per_s"] > 0 and r["speedup"] > 0 for r in hf)
    sampled = [r for r in report["rows"] if r["temperature"] == 1.0 and r["kind"] == "model"]
    assert sampled and all(r["greedy_identical"] is None and r["draft_sampled"] for r in sampled)
    assert all(r["teacher_forced_acceptance"] is not None for r in sampled)
    greedy = [r for r in report["rows"] if r["kind"] in ("model", "prompt_lookup", "hybrid") and r["temperature"] == 0]
    assert all(r["greedy_identical"] for r in greedy if r["timed_prompts"])
    # a candidate that accepted nothing on any prompt is replayed but not timed: no speedup to show
    untimed = [r for r in greedy if r.get("not_timed")]
    assert {r["name"] for r in untimed} == {"prompt_lookup"}  # no n-gram of these prompts recurs
    assert all(r["speedup"] is None and r["modeled_speedup"] is None and r["counters"]["accepted"] == 0 for r in untimed)
    # the others are timed at γ = 2; the costs of that run model γ = 1 too (no measured speedup there), a
    # number the doctor flags and the ranking leaves out
    for r in greedy:
        if r not in untimed and r["gamma"] == 1:
            assert r["costs_from_gamma"] == 2 and "modeled_speedup" in r["flagged"]
            assert rpt.headline_speedup(r) is None
        if r not in untimed:
            own = r.get("costs_of") is None  # init borrows a distilled draft's costs when both have one shape
            assert r["modeled_speedup"] > 0
            assert (r["speedup"] is not None) == (r["gamma"] == 2 and own) == bool(r["timed_prompts"])
    assert report["best"]["name"] in ("checkpoint-2", "checkpoint-10")
    out = run_root / "runs" / "r" / "evaluate"
    for p in ("per_position_acceptance", "speedup_vs_gamma", "acceptance_by_category", "accepted_length_histogram"):
        png = (out / "plots" / f"{p}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, p
    md = (out / "report.md").read_text()
    assert "Best draft" in md and "α per category" in md and "checkpoint-10" in md


def test_greedy_mismatch_fails_loudly(run_root, monkeypatch, capsys):
    real = SpeculativeDecoder.generate

    def buggy(self, *a, **kw):
        out = real(self, *a, **kw)
        j = min(3, len(out.tokens[0]) - 1)
        out.tokens[0][j] = (out.tokens[0][j] + 1) % 259  # a decoder bug: one wrong token
        return out

    monkeypatch.setattr(SpeculativeDecoder, "generate", buggy)
    with pytest.raises(SystemExit) as exc:
        evaluate.main_cli(make_cfg(run_root))
    assert exc.value.code == evaluate.EXIT_GREEDY_MISMATCH != 0
    err = capsys.readouterr()
    assert "FAILED" in err.err and "GREEDY MISMATCH" in err.out
    report = read_report(run_root)  # written before exiting
    assert report["greedy_identical"] is False
    (row,) = rows_of(report, "best")
    assert row["greedy_identical"] is False and row["greedy_mismatches"][0]["gap"] >= evaluate.FLOAT_TIE_GAP
    assert any(d["rule"] == "greedy_mismatch" and d["severity"] == "error" for d in report["doctor"])


def test_resolve_drafts_names_globs_and_dedup(run_root):
    d = run_root / "runs" / "r" / "distill"
    cfg = make_cfg(run_root, f"evaluate.drafts=[checkpoints,best,'{d}/checkpoint-*']")
    got = evaluate.resolve_drafts(cfg)
    assert [n for n, _ in got] == ["checkpoint-2", "checkpoint-10", "best"]  # by step, each once
    assert got[0][1] == str(d / "checkpoint-2")


def test_resolve_drafts_gives_same_named_dirs_distinct_names(run_root, tmp_path):
    """Other runs' distill/best dirs beside this run's best: every row keeps its own name."""
    other = [tmp_path / run / "distill" / "best" for run in ("S6", "S8")]
    for p in other:
        p.mkdir(parents=True)
    cfg = make_cfg(run_root, f"evaluate.drafts=[best,{other[0]},{other[1]}]")
    got = evaluate.resolve_drafts(cfg)
    assert [n for n, _ in got] == ["best", "S6/distill/best", "S8/distill/best"]
    assert [p for _, p in got][1:] == [str(p) for p in other]


@pytest.mark.parametrize("override,needle", [
    ("evaluate.drafts=['{root}/nothing-*']", "matches no directory"),
    ("evaluate.drafts=[{root}/no/such/dir]", "does not exist"),
    ("model.target={root}/missing-target", "does not exist"),
    ("model.target=no-such-model-anywhere", "is not a local dir"),
    ("run_name=fresh", "'best' but"),
])
def test_bad_input_is_one_message_and_exit_2(run_root, capsys, override, needle):
    cfg = make_cfg(run_root, override.format(root=run_root))
    with pytest.raises(ConfigError, match=needle):
        evaluate.run(cfg)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        evaluate.main_cli(cfg)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0]


def test_checkpoint_with_another_tokenizer_is_rejected(run_root, capsys):
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|other|>"]})
    bad = save_draft(run_root / "other", 0.1, tok)
    cfg = make_cfg(run_root, f"evaluate.drafts=[best,{bad}]")
    with pytest.raises(SystemExit) as exc:
        evaluate.main_cli(cfg)
    assert exc.value.code == 2
    assert "do not share a tokenizer" in capsys.readouterr().err


def test_broken_checkpoint_among_many_is_reported(run_root):
    broken = run_root / "runs" / "r" / "distill" / "checkpoint-5"
    save_draft(broken, 0.1)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=r"1 requested draft\(s\) could not be loaded: checkpoint-5"):
        evaluate.run(make_cfg(run_root, "evaluate.drafts=[checkpoints]"))  # exit 2, after the report
    report = read_report(run_root)
    (err,) = rows_of(report, "checkpoint-5")
    assert err["error"] and err["draft"] == str(broken)
    assert rows_of(report, "checkpoint-2") and rows_of(report, "checkpoint-10")
    assert report["greedy_identical"] and any(d["rule"] == "broken_draft" for d in report["doctor"])
    assert "Not evaluated" in (run_root / "runs" / "r" / "evaluate" / "report.md").read_text()


class FixedLogits(torch.nn.Module):
    """A fake target whose next-token logits are the same everywhere: token 5 leads token 6 by `gap`."""

    def __init__(self, gap: float):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.gap = gap

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, 10)
        logits[..., 5], logits[..., 6] = 1.0 + self.gap, 1.0
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("gap,tie", [(5e-5, True), (0.5, False)])
def test_greedy_divergence_is_a_float_tie_only_below_the_gap(gap, tie):
    es = evaluate.EvalSet("s", [Prompt("p0", "c", [1, 2]), Prompt("p1", "c", [3])], 0)
    reference, got = [[5, 5, 5], [5, 5]], [[5, 6, 6], [5, 5]]
    bad, ties = evaluate.greedy_check(FixedLogits(gap), [p.ids for p in es.prompts], [p.id for p in es.prompts],
                                      reference, got, vocab=10)
    found = ties if tie else bad
    assert (bad if tie else ties) == [] and len(found) == 1
    assert found[0]["prompt_id"] == "p0" and found[0]["position"] == 1
    assert found[0]["gap"] == pytest.approx(gap, rel=1e-2)
    assert found[0]["expected"] == 5 and found[0]["got"] == 6


def test_batches_never_mix_categories():
    ps = [Prompt(str(i), c, [i + 1]) for i, c in enumerate("aabab")]
    es = evaluate.EvalSet("s", ps, 0)
    assert es.batches(2) == [[0, 1], [3], [2, 4]]


def test_rerun_is_skipped_until_a_draft_or_setting_changes(run_root):
    evaluate.run(make_cfg(run_root))
    path = run_root / "runs" / "r" / "evaluate" / "report.json"
    first = path.stat().st_mtime_ns
    assert evaluate.run(make_cfg(run_root))["skipped"] is True
    assert path.stat().st_mtime_ns == first
    # another setting measures again
    assert "skipped" not in evaluate.run(make_cfg(run_root, "evaluate.gammas=[2]"))
    # a rewritten best checkpoint measures again
    save_draft(run_root / "runs" / "r" / "distill" / "best", 0.05)
    assert "skipped" not in evaluate.run(make_cfg(run_root, "evaluate.gammas=[2]"))


def test_draft_vocabulary_from_the_runs_answers(run_root):
    from conftest import write_generated

    target = tiny_model(seed=0)
    prompts = [[5, 17, 42], [9, 9, 30, 31]]
    answers = target.generate(torch.tensor([prompts[0]]), max_new_tokens=30, do_sample=False)[0, 3:].tolist()
    common = sorted(set(answers))[: len(set(answers)) // 2]  # half of the target's tokens: rejections follow
    write_generated(run_root / "runs" / "r", [common * 3, [3, 4]])
    cfg = make_cfg(run_root, f"model.draft_vocab={len(common) + 2}", "evaluate.temperatures=[0.0,1.0]")
    evaluate.run(cfg)
    report = read_report(run_root)
    assert report["settings"]["draft_vocab"] == len(common) + 2
    md = (run_root / "runs" / "r" / "evaluate" / "report.md").read_text()
    assert f"draft vocabulary of {len(common) + 2} tokens" in md
    for row in rows_of(report, "best"):  # best == target: only the vocabulary cut makes it miss
        assert row["acceptance_rate"] < 0.95 and row["teacher_forced_acceptance"] < 0.95
        assert abs(row["acceptance_rate"] - row["teacher_forced_acceptance"]) < 0.25
        if row["temperature"] == 0:
            assert row["greedy_identical"] is True
    full = make_cfg(run_root, "evaluate.temperatures=[0.0,1.0]")
    (run_root / "runs" / "r" / "evaluate" / "report.json").unlink()
    evaluate.run(full)
    assert all(r["acceptance_rate"] == 1.0 for r in rows_of(read_report(run_root), "best"))


def test_draft_vocabulary_needs_generated_answers(run_root):
    with pytest.raises(ConfigError, match="model.draft_vocab=0"):
        evaluate.run(make_cfg(run_root, "model.draft_vocab=50"))


def test_draft_vocabulary_with_a_draft_that_cannot_use_it_stops_before_timing(run_root, monkeypatch):
    from conftest import write_generated

    from specdec.kv import KVModel

    write_generated(run_root / "runs" / "r", [[5, 6, 7]])
    monkeypatch.setattr(KVModel, "_check_lazy_head", lambda self: False)  # e.g. soft-capped logits
    monkeypatch.setattr(evaluate, "time_decoders", lambda *a, **k: pytest.fail("timed a draft it had to refuse"))
    with pytest.raises(ConfigError, match="set model.draft_vocab=0"):
        evaluate.run(make_cfg(run_root, "model.draft_vocab=50"))


def test_trained_on_counts_evaluated_prompts_the_run_trained_on(tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = make_cfg(tmp_path)
    sets = [evaluate.EvalSet("a", [Prompt(i, "c", [1]) for i in ("a-1", "a-2", "a-3")], 0),
            evaluate.EvalSet("b", [Prompt("b-1", "c", [1])], 0)]
    assert evaluate.trained_on(cfg, sets) == {"a": 0, "b": 0}  # no generated records at all
    gen = tmp_path / "runs" / "r" / "generate"
    gen.mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a-2#0", "a-2#1", "a-3", "x-9"]}), gen / "shard-r0-00000.parquet")
    assert evaluate.trained_on(cfg, sets) == {"a": 2, "b": 0}  # samples "#k" count once, per prompt
    assert "trained on 2 of the 3 prompts" in caplog.text


def test_a_draft_that_accepts_nothing_headlines_no_speedup(run_root, capsys):
    # the target with its final norm negated: its argmax is the target's argmin, so α = 0 exactly
    bad = tiny_draft(tiny_model(seed=0), 0.0)
    with torch.no_grad():
        bad.model.norm.weight.neg_()
    path = run_root / "runs" / "r" / "distill" / "never"
    bad.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    evaluate.run(make_cfg(run_root, f"evaluate.drafts=[{path}]", "evaluate.repeats=3", "evaluate.warmup=1"))
    report = read_report(run_root)
    (row,) = rows_of(report, "never")
    assert row["acceptance_rate"] == 0.0 and row["tokens_per_target_call"] == 1.0
    assert row["speedup"] is None and row["modeled_speedup"] is None and "cannot beat" in row["not_timed"]
    text = rpt.headline(report)
    assert "no speedup over the target alone that the measurement can support" in text and "×" not in text
    ship = [d for d in report["doctor"] if d["rule"] == "recommendation"]
    assert not ship or "beats" not in ship[0]["message"].split(":")[0]


def test_smoke_times_with_warmup_and_three_repeats(run_root):
    e = make_cfg(run_root, "evaluate.repeats=3", "evaluate.warmup=1").evaluate  # the test defaults lower them
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        smoke = compose(config_name="evaluate", overrides=["experiment=smoke"]).evaluate
    assert smoke.repeats >= 3 and smoke.warmup >= 1 and e.repeats == 3


def test_feature_head_is_replayed_timed_and_checked(run_root):
    """A feature head among the drafts: replayed on every prompt, timed at both γ, and its replayed counts
    equal the decoded ones (the head is fit to these very prompts, so it accepts some of its proposals)."""
    from distill.evalsets import load_eval_sets
    from test_heads import fit_head

    head_dir = run_root / "head"
    cfg = make_cfg(run_root, f"evaluate.drafts=[{head_dir}]", "evaluate.gammas=[1,3]", "evaluate.timed_gammas=[1,3]",
                   "evaluate.timed_prompts=2", "evaluate.temperatures=[0.0,1.0]")
    target, tok = load_target(cfg.model)
    prompts = [p.ids for s in load_eval_sets(cfg, tok, target, None) for p in s.prompts]
    fit_head(target, prompts, steps=60, sampled=0).save_pretrained(head_dir)
    evaluate.run(cfg)
    report = read_report(run_root)
    rows = rows_of(report, "head")
    assert rows and all(r["kind"] == "head" for r in rows)
    greedy = [r for r in rows if r["temperature"] == 0]
    assert {r["gamma"] for r in greedy} == {1, 3} and all(r["scored_by"] == "replay" for r in greedy)
    assert all(r["counters"]["accepted"] > 0 and r["replay_check"]["equal"] and r["greedy_identical"] for r in greedy)
    assert all(r["teacher_forced_acceptance"] is not None for r in rows)
    # greedy α_TF of a head is the agreement of its first proposal, which replay's first round also tests
    (sampled,) = [r for r in rows if r["temperature"] == 1.0]
    assert sampled["scored_by"] == "decoding" and sampled["draft_sampled"] and sampled["modeled_speedup"] is not None
    assert report["best"]["name"] == "head" and report["greedy_identical"]


def test_timed_decoders_keep_the_results_of_their_median_repeat(monkeypatch):
    """Costs come from the repeat whose total wall time is the median, not from whichever ran last."""
    clock = iter([0.0, 5.0, 10.0, 13.0, 20.0, 21.0])  # start/stop per repeat: walls 5, 3, 1 -> median repeat 1
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(clock))
    calls = []

    def decode(batch, seed, n=None):
        calls.append(len(calls))
        return SimpleNamespace(tokens=[[len(calls) - 1]], metrics=None)

    (t,) = measure.time_decoders([decode], [[1, 2]], [[0]], warmup=0, repeats=3, seed=0)
    assert t.totals() == [5.0, 3.0, 1.0]
    assert t.results[0].tokens == [[1]]  # the second repeat's (3.0 s, the median), not the last one's
