"""pipeline: the whole path end to end (real stages), resumable; the results table; sweeps; W&B."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from distill import pipeline
from distill.config import ConfigError
from distill.records import load_generated

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
LABELS = ("target alone", "undistilled draft (init)", "distilled draft (best)", "HF assisted generation")


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="pipeline",
                       overrides=["model=tiny", "experiment=smoke", f"runs_root={tmp_path / 'runs'}", *overrides])


def _cli(*args, timeout=1200):
    """`python -m distill.pipeline ...` as a user runs it (offline, W&B off: see conftest.py)."""
    proc = subprocess.run([sys.executable, "-m", "distill.pipeline", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _snapshot(rd: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every output file (not hydra's per-launch logs or the rewritten config.yaml)."""
    out = {}
    for f in sorted(rd.rglob("*")):
        rel = f.relative_to(rd)
        if f.is_file() and rel.parts[0] != "logs" and rel.name != "config.yaml":
            out[str(rel)] = (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
    return out


# ---------------------------------------------------------------- end to end, real stages


def test_pipeline_tiny_end_to_end_and_resumable(tmp_path):
    runs = tmp_path / "runs"
    first = _cli("model=tiny", "experiment=smoke", f"runs_root={runs}")
    rd = runs / "smoke"
    for path in ("generate/manifest.json", "distill/best/config.json", "distill/summary.json",
                 "evaluate/report.json", "evaluate/report.md", "publish/README.md", "publish/config.json",
                 "results.md"):
        assert (rd / path).is_file(), path
    results = (rd / "results.md").read_text()
    for label in LABELS:
        assert label in results and label in first.stdout, label
    assert "python -m distill.pipeline model=tiny experiment=smoke" in results

    before = _snapshot(rd)
    _cli("model=tiny", "experiment=smoke", f"runs_root={runs}")  # every stage complete: nothing is redone
    after = _snapshot(rd)
    assert after.keys() == before.keys()
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"a rerun rewrote {changed}"


def test_multirun_sweep_gives_each_job_a_run_and_a_comparison_row(tmp_path):
    runs = tmp_path / "runs"
    _cli("-m", "model=tiny", "experiment=smoke", "loss=fkl,rkl", "gamma=1,3", f"runs_root={runs}",
         "stages=[generate,distill,evaluate]", "data.limit=8", "generate.max_new_tokens=8", "train.max_steps=2",
         "evaluate.references=[target]", "evaluate.prompts_per_set=1", "evaluate.max_new_tokens=8")
    names = sorted(p.name for p in runs.iterdir() if p.name != "multirun")
    assert len(names) == 4 and all(n.startswith("data.limit=8,") and ",model=tiny," in n for n in names)
    for n in names:
        assert (runs / n / "results.md").is_file()
        assert OmegaConf.load(runs / n / "config.yaml").loss.name == n.split("loss=")[1].split(",")[0]
        gamma = int(n.split("gamma=")[1].split(",")[0])
        report = json.loads((runs / n / "evaluate" / "report.json").read_text())
        assert {r["gamma"] for r in report["rows"] if r["kind"] != "target"} == {gamma}
    (comparison,) = runs.glob("multirun/*/comparison.md")
    text = comparison.read_text()
    assert "4 runs" in text and all(f"| {n}" in text for n in names)


@pytest.mark.slow
def test_pipeline_embedded_default_smoke(tmp_path):
    """The CI smoke run on the embedded SmolLM2 target (the README's path at smoke size)."""
    runs = tmp_path / "runs"
    # the cheapest draft (2 of 30 layers): this test checks the path, not the draft
    proc = _cli("experiment=smoke", "model.draft_layers=[0,29]", "data.self_instruct=4", "model.draft_vocab=2048",
                f"runs_root={runs}", timeout=1800)
    rd = runs / "smoke"
    report = json.loads((rd / "evaluate" / "report.json").read_text())
    assert report["greedy_identical"] is True and report["target"] == "smollm2-135m-instruct"
    assert report["settings"]["draft_vocab"] == 2048
    card = (rd / "publish" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert len(json.loads((rd / "publish" / "draft_vocab.json").read_text())["ids"]) == 2048
    sources = {r["source"] for r in load_generated(rd).to_list()}
    assert sources == {"stdlib", "self_instruct"}, "SmolLM2 ends most of its own user turns: some are kept"
    for label in LABELS:
        assert label in proc.stdout


# ---------------------------------------------------------------- pieces, on a fabricated report


def _row(name, kind, eval_set="mt_bench", **kw):
    row = {"name": name, "kind": kind, "draft": None, "eval_set": eval_set, "temperature": 0.0, "top_p": 1.0,
           "gamma": 4, "batch_size": 1, "acceptance_rate": 0.6, "tokens_per_target_call": 2.5,
           "tokens_per_s": 100.0, "speedup": 1.5, "greedy_identical": True}
    row.update(kw)
    return row


REPORT = {
    "target": "tiny", "settings": {"max_new_tokens": 24, "device": "cpu"},
    "rows": [_row("target", "target", gamma=0, acceptance_rate=None, tokens_per_target_call=1.0, speedup=1.0),
             _row("init", "model", acceptance_rate=0.3, speedup=0.8),
             _row("init", "model", gamma=2, acceptance_rate=0.35),
             _row("best", "model", acceptance_rate=0.7, speedup=1.8),
             _row("best", "model", temperature=1.0, speedup=1.2),
             _row("best", "model", batch_size=4, speedup=1.1),
             _row("hf_assisted", "hf_assisted", assistant="best", acceptance_rate=None, speedup=1.3),
             _row("prompt_lookup", "prompt_lookup", speedup=1.1),
             {"name": "checkpoint-3", "kind": "model", "error": "OSError", "eval_set": None}],
    "greedy_identical": True, "best": {"name": "best", "gamma": 4, "speedup": 1.8, "acceptance_rate": 0.7,
                                       "teacher_forced_acceptance": 0.66, "init_speedup": 0.8},
}


def test_results_table_has_the_four_kinds_at_greedy_batch_1(tmp_path):
    cfg = _cfg(tmp_path)
    summary = {"init_teacher_forced_acceptance": 0.4, "best_teacher_forced_acceptance": 0.66}
    text, cells = pipeline.results_markdown(cfg, REPORT, summary, None)
    assert [c[1] for c in cells] == [*LABELS[:3], "HF assisted generation (best)", "prompt lookup (no draft)"]
    assert cells[2][4:] == ["0.700", "2.50", "100.0", "1.80×", "–"]  # greedy, batch 1, γ=4 only
    assert cells[0][2] == "–" and cells[0][4] == "–"
    # a number the evaluation flagged never reaches the table
    flagged = {**REPORT, "rows": [{**r, "flagged": {"speedup": "its 95% interval includes 1"}} if r["name"] == "best"
                                  else r for r in REPORT["rows"]]}
    cells = pipeline.results_markdown(cfg, flagged, summary, None)[1]
    assert cells[2][7] == "n.s." and "1.80" not in " ".join(cells[2])
    assert "0.400 (init) → 0.660 (distilled)" in text and "| eval set" in text


def test_job_run_name_from_overrides():
    hc = OmegaConf.create({"job": {"config": {"override_dirname": {"exclude_keys": []}}},
                           "overrides": {"task": ["model=tiny", "loss=rkl", "evaluate.gammas=[3]", "runs_root=/x/y"]}})
    cfg = OmegaConf.create({"run_name": "smoke"})
    assert pipeline.job_run_name(cfg, hc) == "evaluate.gammas=3,loss=rkl,model=tiny"
    hc.overrides.task.append("run_name=sweep")
    cfg.run_name = "sweep"
    assert pipeline.job_run_name(cfg, hc) == "sweep-evaluate.gammas=3,loss=rkl,model=tiny"
    hc.overrides.task = [f"data.path=/very/long/{'x' * 200}.jsonl"]
    name = pipeline.job_run_name(cfg, hc)
    assert "/" not in name and len(name) <= 220


def test_comparison_rows_accumulate(tmp_path):
    for name, speedup in (("a", 1.2), ("b", 1.9)):
        report = {**REPORT, "best": {**REPORT["best"], "speedup": speedup}}
        out = pipeline.add_comparison_row(tmp_path, OmegaConf.create({"run_name": name, "runs_root": "runs"}), report)
    text = out.read_text()
    assert "2 runs" in text and "| a " in text and "1.90×" in text


def test_wandb_gets_the_results_table_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "logger=wandb", "wandb_mode=offline", "run_name=wb")
    _, cells = pipeline.results_markdown(cfg, REPORT, None, None)
    pipeline.log_wandb(cfg, cells, REPORT)
    runs = list((tmp_path / "runs" / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_refuses_to_run_every_stage_in_every_accelerate_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="accelerate launch -m distill.distill"):
        pipeline.run(_cfg(tmp_path))


def test_pipeline_trains_a_head_beside_the_draft_and_ships_the_faster(tmp_path):
    runs = tmp_path / "runs"
    _cli("model=tiny", "experiment=smoke", f"runs_root={runs}", "head.also=true", "head.time_budget_min=5",
         "evaluate.drafts=[best,head]", "evaluate.temperatures=[0,1]",
         "evaluate.references=[target,init,prompt_lookup,hybrid,hf_assisted]")
    rd = runs / "smoke"
    assert (rd / "distill" / "best" / "model.safetensors").is_file()
    head_summary = json.loads((rd / "distill-head" / "summary.json").read_text())
    assert head_summary["done"] and head_summary["student"] == "head" and head_summary["stage"] == "distill-head"
    assert head_summary["time_budget_min"] == 5
    report = json.loads((rd / "evaluate" / "report.json").read_text())
    heads = [r for r in report["rows"] if r["name"] == "head"]
    # scored by replay on every set (a tiny random target's head rarely agrees on new prompts: the timed
    # path of a head that does is tests/test_evaluate.py's)
    assert {r["eval_set"] for r in heads} == set(report["settings"]["eval_sets"])
    assert all(r["kind"] == "head" and not r.get("error") and r["teacher_forced_acceptance"] is not None for r in heads)
    # prompt lookup + the head: scored like the other hybrid, lossless where decoded
    hybrid_head = [r for r in report["rows"] if r["name"] == "hybrid_head"]
    assert {r["eval_set"] for r in hybrid_head} == set(report["settings"]["eval_sets"])
    assert all(r["kind"] == "hybrid" and not r.get("error") and r["draft"] == heads[0]["draft"] for r in hybrid_head)
    assert all(r.get("greedy_identical") is not False and not (r.get("replay_check") or {}).get("mismatches")
               for r in hybrid_head) and any(r.get("scored_by") == "replay" for r in hybrid_head)
    # the results table shows both kinds and both hybrids; publish stages the draft the report ranks first
    results = (rd / "results.md").read_text()
    assert "feature head (EAGLE-3)" in results and "hybrid (prompt lookup + head)" in results
    best = report["best"]
    published = json.loads((rd / "publish.json").read_text())
    assert best["name"] in ("best", "head") and published["kind"] == ("head" if best["name"] == "head" else "model")
