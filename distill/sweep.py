"""Hydra multirun (`-m`): where each job of a sweep writes, and one comparison table for the sweep.

    python -m distill.pipeline -m experiment=smoke loss=fkl,rkl    # a run dir per job: runs/loss=fkl,.../
    python -m distill.distill -m loss=fkl,tvd run_name=r           # one run dir, a stage dir per job:
                                                                   #   runs/r/distill@loss=fkl/, runs/r/distill@loss=tvd/

A pipeline job gets a run dir of its own, named from its overrides (`job_run_name`). A job of one
stage's own sweep keeps the shared run dir and gets a stage tag from the same overrides (`stage_tag`):
it writes runs/<run>/<stage>@<tag> and config@<tag>.yaml, and reads an earlier stage's <stage>@<tag>
made from the most of its overrides, else its untagged dir (distill.config.stage_path). So
`python -m distill.evaluate -m` with the distill sweep's overrides (plus any evaluate.* ones) evaluates each
of its drafts.

Each job adds its row to <sweep dir>/comparison.md (rows kept as comparison/<kind>/<job>.json, the table
rebuilt under a file lock: a launcher may run jobs in parallel), and `PrintComparison`, a Hydra callback
(conf/base.yaml `hydra.callbacks`), prints the finished table once when the multirun ends.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from distill import tables
from distill.config import HEAD_STAGE, STAGES, read_tags, run_dir
from distill.utils import atomic_write_json, atomic_write_text, process_rank, read_json

COMPARE_HEADERS = ["run", "draft", "γ", "α", "α_TF", "τ", "tokens/s", "speedup", "modeled", "init speedup"]
# the columns of a stage's sweep table (the first names the job: run@tag, or the run alone)
STAGE_HEADERS = {
    "generate": ["run@tag", "records", "prompt tokens", "response tokens", "tokens/s"],
    "distill": ["run@tag", "student", "loss", "steps", "α_TF init → best", "tokens/s", "stopped by"],
    "evaluate": ["run@tag", *COMPARE_HEADERS[1:]],
    "publish": ["run@tag", "draft", "kind", "folder", "uploaded to"],
}
STAGE_NOTES = {
    "generate": "Each job's records (generate/manifest.json `summary`)",
    "distill": "Each job's draft (distill/summary.json): held-out α_TF before training → at the best step",
    "evaluate": "Each job's best draft, mean over eval sets at greedy, batch 1 (report.json `best`)",
    "publish": "Each job's staged upload folder and its draft, relative to the run dir (a dry run unless "
               "publish.dry_run=false)",
}
KINDS = ("pipeline", *STAGES)  # the order of the sections when one sweep dir holds several kinds of rows


# ---------------------------------------------------------------- which job is this


def hydra_config():
    """Hydra's runtime config (None outside a Hydra app, e.g. a stage's run(cfg) called from a test)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def is_multirun(hc) -> bool:
    from hydra.types import RunMode

    return hc is not None and hc.mode == RunMode.MULTIRUN


def slug(text: str, limit: int = 200) -> str:
    """A file name from override text: no '/', nothing a shell or file system dislikes, bounded length."""
    s = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", re.sub(r"[\[\]'\"]", "", text)).strip("_.")
    if len(s) > limit:
        s = s[: limit - 9] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return s


def job_overrides(hc) -> list[str]:
    """This job's command-line overrides, less run_name, runs_root and hydra's override_dirname.exclude_keys."""
    exclude = {"run_name", "runs_root", *hc.job.config.override_dirname.exclude_keys}
    return sorted(o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") not in exclude)


def job_run_name(cfg: DictConfig, hc) -> str:
    """The run dir name of one pipeline multirun job: its overrides, so each job writes to its own run dir."""
    explicit = any(o.split("=", 1)[0].lstrip("+") == "run_name" for o in hc.overrides.task)
    dirname = slug(",".join(job_overrides(hc)))
    if explicit:
        return f"{cfg.run_name}-{dirname}" if dirname else str(cfg.run_name)
    return dirname or str(cfg.run_name)


def stage_app(hc) -> Optional[str]:
    """The stage whose own Hydra app this is (`python -m distill.<stage>`), or None (the pipeline, a test)."""
    name = hc.job.name if hc is not None else None
    return name if name in STAGES else None


def stage_tag(cfg: DictConfig, hc=None) -> Optional[str]:
    """The stage tag of this job: cfg.stage_tag when set; in a job of a stage's own multirun, its overrides
    (the slug job_run_name uses); else None. The pipeline's jobs have run dirs of their own: never a tag."""
    if cfg.get("stage_tag") is not None:
        return str(cfg.stage_tag)
    hc = hydra_config() if hc is None else hc
    if not (is_multirun(hc) and stage_app(hc)):
        return None
    return slug(",".join(job_overrides(hc))) or None


# ---------------------------------------------------------------- the comparison table


def best_cells(first: str, best: dict) -> list[str]:
    """A row of COMPARE_HEADERS from a report's `best` (the headline draft)."""
    b = best or {}
    return [first, str(b.get("name", "–")), str(b.get("gamma", "–")), tables.num(b.get("acceptance_rate"), 3),
            tables.num(b.get("teacher_forced_acceptance"), 3), tables.num(b.get("tokens_per_target_call"), 2),
            tables.num(b.get("tokens_per_s"), 1), tables.shown(b, "speedup"), tables.shown(b, "modeled_speedup"),
            tables.num(b.get("init_speedup"), 2, "×")]


def stage_cells(stage: str, first: str, result: dict, rd: str = ".") -> list[str]:
    """A row of STAGE_HEADERS[stage] from what the stage's run(cfg) returned (its summary); paths relative
    to the run dir `rd`."""
    r = result or {}

    def rel(path: Optional[str]) -> str:
        return "–" if path is None else os.path.relpath(path, rd) if Path(path).is_relative_to(rd) else str(path)

    if stage == "generate":
        return [first, str(r.get("records", "–")), str(r.get("prompt_tokens", "–")), str(r.get("response_tokens", "–")),
                tables.num(r.get("tokens_per_s"), 1)]
    if stage == "distill":
        settings = r.get("settings") or {}
        kind = r.get("student") or (settings.get("student") or {}).get("kind", "–")
        alpha = (f"{tables.num(r.get('init_teacher_forced_acceptance'), 3)} → "
                 f"{tables.num(r.get('best_teacher_forced_acceptance'), 3)}")
        return [first, str(kind), str((settings.get("loss") or {}).get("name", "–")), str(r.get("step", "–")), alpha,
                tables.num(r.get("tokens_per_s"), 1), str(r.get("stopped") or "–")]
    if stage == "evaluate":
        return best_cells(first, r.get("best") or {})
    return [first, rel(r.get("draft")), str(r.get("kind", "–")), rel(r.get("folder")),
            "no (dry run)" if r.get("dry_run", True) else str((r.get("upload") or {}).get("repo_id") or "–")]


def section(sweep_dir: Path, kind: str) -> Optional[str]:
    """The markdown of one kind's table (pipeline or a stage) from the rows on disk; None without rows."""
    rows = [read_json(p) for p in sorted((Path(sweep_dir) / "comparison" / kind).glob("*.json"))]
    if not rows:
        return None
    root, n = rows[-1].get("runs_root", "runs"), len(rows)
    if kind == "pipeline":
        return (f"# Sweep comparison ({n} run{'s' * (n != 1)})\n\nEach run's best draft, mean over eval sets at greedy, "
                f"batch 1 (report.json `best`); runs in `{root}/<run>/`.\n\n"
                + tables.markdown(COMPARE_HEADERS, [r["cells"] for r in rows]) + "\n")
    return (f"# Sweep comparison: {kind} ({n} job{'s' * (n != 1)})\n\n{STAGE_NOTES[kind]}; a job's files are in "
            f"`{root}/<run>/{kind}@<tag>/` (`{kind}/` without a tag).\n\n"
            + tables.markdown(STAGE_HEADERS[kind], [r["cells"] for r in rows]) + "\n")


def add_row(sweep_dir: Path, kind: str, key: str, cells: list[str], runs_root: str) -> Path:
    """Record one job's row and rebuild <sweep dir>/comparison.md from every job's rows (all kinds)."""
    sweep_dir = Path(sweep_dir)
    atomic_write_json(sweep_dir / "comparison" / kind / f"{slug(key)}.json",
                      {"run": key, "runs_root": str(runs_root), "cells": cells})
    out = sweep_dir / "comparison.md"
    with open(sweep_dir / ".comparison.lock", "w") as lock:  # jobs may run in parallel (joblib launcher)
        fcntl.flock(lock, fcntl.LOCK_EX)
        atomic_write_text(out, "\n".join(s for s in (section(sweep_dir, k) for k in KINDS) if s))
    return out


def add_comparison_row(sweep_dir: Path, cfg: DictConfig, report: dict) -> Path:
    """A pipeline job's row: its run's headline (report["best"])."""
    return add_row(sweep_dir, "pipeline", str(cfg.run_name), best_cells(str(cfg.run_name), report.get("best") or {}),
                   cfg.runs_root)


def add_stage_row(cfg: DictConfig, result: Optional[dict]) -> Optional[Path]:
    """In a job of a stage's own multirun: its row of the sweep's table (from the stage's summary); else nothing."""
    hc = hydra_config()
    stage = stage_app(hc)
    if not (is_multirun(hc) and stage) or process_rank() != 0:
        return None
    tag = stage_tag(cfg, hc)
    job = f"{cfg.run_name}@{tag}" if tag else str(cfg.run_name)
    return add_row(Path(hc.sweep.dir), stage, job, stage_cells(stage, job, result or {}, run_dir(cfg)), cfg.runs_root)


def upstream_warnings(cfg: DictConfig, stage: str) -> list[str]:
    """For a tagged job: what is doubtful about the stages before `stage` it reads (distill.config.read_tags):
    several tags that fit its overrides equally, or none though tagged dirs exist (read untagged)."""
    order = ["generate", "distill", HEAD_STAGE, "evaluate", "publish"]
    tag = cfg.get("stage_tag")
    if not tag or stage not in order:
        return []
    base, out = Path(run_dir(cfg)), []
    for s in order[: order.index(stage)]:
        fits = read_tags(base, s, str(tag))
        if len(fits) > 1:
            out.append(f"{', '.join(f'{s}@{t}' for t in fits)} fit this job's overrides equally; it reads {s}@{fits[0]}")
        elif not fits and any(d.is_dir() for d in base.glob(f"{s}@*")):
            out.append(f"no {s}@<tag> was made from this job's overrides ({tag}); it reads {s}/ untagged")
    return out


class PrintComparison(Callback):
    """Prints the sweep's comparison table once, when the multirun ends (the rows its jobs added)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        kind = config.hydra.job.name
        text = section(sweep_dir, kind) if kind in KINDS else None
        if text is None and (sweep_dir / "comparison.md").is_file():
            text = (sweep_dir / "comparison.md").read_text()
        if text:
            print(f"\n{text}\n(written to {sweep_dir / 'comparison.md'})", flush=True)
