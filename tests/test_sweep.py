"""Hydra sweeps of one stage (distill/sweep.py): every job its own <stage>@<tag> dir in the shared run dir,
later sweeps read the earlier ones' tagged dirs, and one comparison table printed when the sweep ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf

from distill import sweep
from distill.config import HEAD_STAGE, ConfigError, stage_path
from distill.cli import start_stage
from distill.utils import config_path, save_config

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "experiment=smoke", "run_name=sweep", "generate.max_new_tokens=8", "train.max_steps=2"]


def _cfg(tmp_path, tag=None):
    return OmegaConf.create({"runs_root": str(tmp_path), "run_name": "r", "stage_tag": tag})


def _hc(name: str, task: list[str], mode=RunMode.MULTIRUN):
    return OmegaConf.create({"mode": mode, "job": {"name": name, "config": {"override_dirname": {"exclude_keys": []}}},
                             "overrides": {"task": task}, "sweep": {"dir": "unused"}})


def test_stage_path_reads_a_tagged_upstream_only_where_it_exists(tmp_path):
    run = tmp_path / "r"
    cfg = _cfg(tmp_path, "loss=fkl,model=tiny")
    assert stage_path(cfg, "distill", own=True) == run / "distill@loss=fkl,model=tiny"  # where this job writes
    assert stage_path(cfg, "generate") == run / "generate"  # not swept: the shared, untagged dir
    assert stage_path(cfg, "distill") == run / "distill"
    (run / "distill@loss=fkl,model=tiny").mkdir(parents=True)
    (run / "distill@loss=tvd,model=tiny").mkdir()
    (run / f"{HEAD_STAGE}@loss=tvd,model=tiny").mkdir()
    assert stage_path(cfg, "distill") == run / "distill@loss=fkl,model=tiny"
    assert stage_path(cfg, HEAD_STAGE) == run / HEAD_STAGE  # another tag's head is not this job's
    assert stage_path(_cfg(tmp_path), "distill") == run / "distill"  # no tag: never a tagged dir

    # an evaluate sweep with the distill sweep's overrides plus its own reads that sweep's draft
    ev = _cfg(tmp_path, "evaluate.prompts_per_set=2,loss=tvd,model=tiny")
    assert stage_path(ev, "distill") == run / "distill@loss=tvd,model=tiny"
    assert stage_path(ev, HEAD_STAGE) == run / f"{HEAD_STAGE}@loss=tvd,model=tiny"
    assert sweep.upstream_warnings(ev, "evaluate") == []
    # overrides no tagged dir was made from: the untagged dir, with a warning that other tags exist
    other = _cfg(tmp_path, "loss=jsd,model=tiny")
    assert stage_path(other, "distill") == run / "distill"
    assert any("no distill@<tag>" in w for w in sweep.upstream_warnings(other, "evaluate"))
    # two tags fit equally: the first is read, and the job is warned
    (run / "distill@model=tiny").mkdir()
    (run / "distill@seed=1").mkdir()
    tie = _cfg(tmp_path, "model=tiny,seed=1")
    assert stage_path(tie, "distill") == run / "distill@model=tiny"
    assert any("fit this job's overrides equally" in w for w in sweep.upstream_warnings(tie, "evaluate"))


def test_the_tag_comes_from_a_stage_sweep_jobs_overrides_never_the_pipelines(tmp_path):
    task = ["loss=fkl", "model=tiny", "run_name=sweep", f"runs_root={tmp_path}", "data.path=/a/b c.jsonl"]
    cfg = _cfg(tmp_path)
    assert sweep.stage_tag(cfg, _hc("distill", task)) == "data.path=_a_b_c.jsonl,loss=fkl,model=tiny"
    assert sweep.stage_tag(cfg, _hc("pipeline", task)) is None  # its jobs have run dirs of their own
    assert sweep.stage_tag(cfg, _hc("distill", task, RunMode.RUN)) is None
    assert sweep.stage_tag(_cfg(tmp_path, "mine"), _hc("distill", task)) == "mine"
    assert len(sweep.stage_tag(cfg, _hc("distill", [f"data.path={'x' * 300}"]))) <= 200


def test_config_yaml_is_kept_per_tag_and_a_bad_tag_is_refused(tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("distill", overrides=["model=tiny", f"runs_root={tmp_path}", "run_name=r", "loss=tvd"])
    cfg.stage_tag = "loss=tvd"
    save_config(cfg)
    assert OmegaConf.load(tmp_path / "r" / "config@loss=tvd.yaml").loss.name == "tvd"
    assert not (tmp_path / "r" / "config.yaml").exists()
    (tmp_path / "r" / "distill@loss=tvd").mkdir()
    cfg.stage_tag = "gamma=3,loss=tvd"  # an evaluate job after that distill job: the config its draft was made with
    assert config_path(cfg, "distill") == tmp_path / "r" / "config@loss=tvd.yaml"
    assert config_path(cfg, "generate") == tmp_path / "r" / "config.yaml"
    cfg.stage_tag = "a/b"
    with pytest.raises(ConfigError, match="stage_tag=a_b"):
        start_stage(cfg, "distill")


def test_one_table_per_kind_of_sweep_printed_once_at_the_end(tmp_path, capsys):
    best = {"name": "best", "gamma": 3, "acceptance_rate": 0.61234, "speedup": 1.5, "speedup_ci": [1.2, 1.8],
            "flagged": {"modeled_speedup": "interval includes 1"}}
    for job, a in (("r@loss=fkl", 0.5), ("r@loss=tvd", 0.6)):
        summary = {"student": None, "settings": {"student": {"kind": "lora"}, "loss": {"name": job[-3:]}}, "step": 7,
                   "init_teacher_forced_acceptance": 0.25, "best_teacher_forced_acceptance": a, "stopped": "max_steps"}
        sweep.add_row(tmp_path, "distill", job, sweep.stage_cells("distill", job, summary), "runs")
    sweep.add_row(tmp_path, "evaluate", "r@loss=fkl", sweep.stage_cells("evaluate", "r@loss=fkl", {"best": best}), "runs")
    text = (tmp_path / "comparison.md").read_text()
    assert "distill (2 jobs)" in text and "evaluate (1 job)" in text
    assert "| r@loss=tvd | lora    | tvd  | 7     | 0.250 → 0.600" in text
    assert "| 0.612 |" in text and "1.50× [1.20–1.80]" in text and "n.s." in text  # a flagged number stays hidden

    end = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "job": {"name": "distill"}}})
    sweep.PrintComparison().on_multirun_end(end)
    out = capsys.readouterr().out
    assert out.count("# Sweep comparison: distill (2 jobs)") == 1 and "evaluate" not in out


def _cli(stage: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", f"distill.{stage}", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_a_distill_sweep_trains_each_job_and_publish_follows_it(tmp_path):
    runs, sw = tmp_path / "runs", tmp_path / "sw"
    _cli("generate", *TINY, f"runs_root={runs}")
    out = _cli("distill", "-m", "loss=fkl,tvd", *TINY, f"runs_root={runs}", f"hydra.sweep.dir={sw}").stdout
    run = runs / "sweep"
    dirs = sorted(run.glob("distill@*"))
    assert [d.name.split("loss=")[1][:3] for d in dirs] == ["fkl", "tvd"]
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        loss = d.name.split("loss=")[1][:3]
        assert summary["settings"]["loss"]["name"] == loss and summary["done"] and summary["step"] == 2
        assert (d / "best" / "config.json").is_file()
        assert OmegaConf.load(run / f"config{d.name[len('distill'):]}.yaml").loss.name == loss
    assert not (run / "distill").exists()
    assert out.count("# Sweep comparison: distill (2 jobs)") == 1
    rows = [line for line in out.splitlines() if line.startswith("| sweep@")]
    assert len(rows) == 2 and " fkl " in rows[0] and " tvd " in rows[1] and all(" 2 " in r for r in rows)

    # no evaluation report: publish.force; that override is not in the distill tags, which still fit
    out = _cli("publish", "-m", "loss=fkl,tvd", *TINY, "publish.force=true", f"runs_root={runs}",
               f"hydra.sweep.dir={sw}").stdout
    staged = sorted(p for p in run.glob("publish@*") if p.is_dir())
    assert len(staged) == 2 and all((run / f"{d.name}.json").is_file() for d in staged)  # a record per job
    for d, loss in zip(staged, ("FKL", "TVD")):
        assert f"**loss**: {loss}" in (d / "README.md").read_text()
        assert (d / "model.safetensors").is_file()
    assert out.count("# Sweep comparison: publish (2 jobs)") == 1 and "Sweep comparison: distill" not in out
    assert len([line for line in out.splitlines() if line.startswith("| sweep@")]) == 2
    table = (sw / "comparison.md").read_text()  # one sweep dir, both sweeps' tables
    assert "distill (2 jobs)" in table and "publish (2 jobs)" in table
