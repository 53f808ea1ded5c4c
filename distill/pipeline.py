"""The whole path in one command: generate -> distill -> evaluate -> publish (a dry run by default).

    python -m distill.pipeline model=tiny experiment=smoke        # seconds: random tiny models (tests)
    python -m distill.pipeline experiment=smoke                   # minutes on 2 CPU cores: SmolLM2, CI-sized
    python -m distill.pipeline experiment=default                 # the main job (its run time: docs/measurements.md)
    python -m distill.pipeline -m experiment=smoke loss=fkl,rkl,jsd gamma=3,5   # a sweep

Runs the stages in cfg.stages (in the order above) in this process, each through its own run(cfg):
every stage is resumable, so a rerun skips what is complete and an interrupted run continues where it
stopped. Ends with a results table (the target alone, the undistilled draft, the distilled draft and
transformers assisted generation: α, τ, tokens/s, speedup at greedy, batch 1), printed and written to
runs/<run>/results.md. With logger=wandb (offline unless wandb_mode=online) the table and headline
numbers go to a W&B run in the group <run_name> (the distill stage logs its curves itself).

Multirun (-m): each job gets its own run dir, named from its overrides (hydra's override_dirname,
without runs_root; an explicit run_name=... becomes the prefix), so jobs never share outputs and a
rerun of the same sweep resumes them. Each job adds its row to <sweep dir>/comparison.md (one row per
run, under a file lock), and the table is printed once when the last job ends (distill/sweep.py).

Multi-process distillation: the pipeline runs stages in one process. For the distill stage on several
processes, run it alone first, then let the pipeline continue (it finds the distill stage complete):

    accelerate launch --config_file launch/cpu-2proc.yaml -m distill.distill experiment=smoke
    python -m distill.pipeline experiment=smoke
"""
from __future__ import annotations

import copy
import importlib
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from distill import report as report_mod
from distill.config import DRAFT_KINDS, STAGES, ConfigError, run_dir, stage_path, validate
from distill import tables
from distill.card import pick
from distill.sweep import add_comparison_row, hydra_config, is_multirun, job_run_name
from distill.cli import cli, stage_main
from distill.utils import atomic_write_text, read_json, wandb_finish, wandb_start

log = logging.getLogger(__name__)

# stage name -> the module whose run(cfg) does it
MODULES = {"generate": "distill.generate", "distill": "distill.distill", "evaluate": "distill.evaluate",
           "publish": "distill.publish"}
HEADERS = ["eval set", "decoding", "γ", "prompts (timed)", "α [95% CI]", "τ", "tokens/s", "speedup [95% CI]",
           "modeled [95% CI]"]


# ---------------------------------------------------------------- the results table


def command_line(hc) -> str:
    """The command that reproduces this run (for results.md)."""
    args = list(hc.overrides.task) if hc is not None else []
    return " ".join(["python -m distill.pipeline", *(shlex.quote(a) for a in args)])


def headline_rows(report: dict) -> tuple[list[dict], dict]:
    """Rows of the results table: per eval set, the target alone, the undistilled draft, every trained
    draft (the best first), HF assisted generation, prompt lookup and the hybrid, at greedy, batch 1 (or
    the closest evaluated setting), each at its own fastest γ (mean headline speedup over sets)."""
    rows = [r for r in report.get("rows", []) if not r.get("error") and r.get("eval_set")]
    temps = {r.get("temperature") or 0.0 for r in rows}
    sizes = {r.get("batch_size") or 1 for r in rows}
    temp = 0.0 if 0.0 in temps or not temps else min(temps)
    bs = 1 if 1 in sizes or not sizes else min(sizes)
    best = report.get("best") or {}
    draft = best.get("name") if best.get("name") not in (None, "init") else "best"
    rows = [r for r in rows if (r.get("temperature") or 0.0) == temp and (r.get("batch_size") or 1) == bs]
    trained = [n for n in dict.fromkeys(r["name"] for r in rows if r["kind"] in DRAFT_KINDS) if n not in ("init", draft)]
    order = {n: i for i, n in enumerate(["target", "init", draft, *trained, "hf_assisted", "prompt_lookup", "hybrid", "hybrid_head"])}
    gamma_of = {}
    for name in order:
        mine = [r for r in rows if r["name"] == name and r["kind"] not in ("target", "hf_assisted")]
        by_gamma: dict[int, list[float]] = {}
        for r in mine:
            v = report_mod.headline_speedup(r)
            by_gamma.setdefault(r.get("gamma"), []).append(v if isinstance(v, (int, float)) else 0.0)
        if by_gamma:
            gamma_of[name] = (best.get("gamma") if name == draft and best.get("gamma") in by_gamma else
                              max(by_gamma, key=lambda g: sum(by_gamma[g]) / len(by_gamma[g])))
    picked = [r for r in rows if r["name"] in order and (r["name"] not in gamma_of or r.get("gamma") == gamma_of[r["name"]])]
    picked.sort(key=lambda r: (str(r["eval_set"]), order[r["name"]], r.get("gamma") or 0))
    return picked, {"temperature": temp, "batch_size": bs, "gamma": best.get("gamma"), "draft": draft}


def table_cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        label = tables.label(r["name"], r.get("assistant"))
        out.append([str(r["eval_set"]), label, "–" if r["kind"] == "target" else str(r.get("gamma")),
                    f"{r.get('prompts', '–')} ({r.get('timed_prompts', 0)})",
                    tables.ci_cell(r.get("acceptance_rate"), r.get("acceptance_rate_ci"), 3),
                    tables.num(r.get("tokens_per_target_call"), 2), tables.num(r.get("tokens_per_s"), 1),
                    tables.shown(r, "speedup"), tables.shown(r, "modeled_speedup")])
    return out


def results_markdown(cfg: DictConfig, report: dict, summary: Optional[dict], hc) -> tuple[str, list[list[str]]]:
    rows, setting = headline_rows(report)
    cells = table_cells(rows)
    rd = run_dir(cfg)
    st = report.get("settings", {})
    samp = "greedy" if not setting["temperature"] else f"T={setting['temperature']:g}"
    device = f", on {st['device']}" if st.get("device") not in (None, "auto") else ""
    lines = [
        f"# Results: {cfg.run_name}", "",
        f"Target `{report.get('target')}`, {samp}, batch {setting['batch_size']}, γ = {setting['gamma']} (the best "
        f"draft's), max_new_tokens {st.get('max_new_tokens')}{device}. From `{rd}/evaluate/report.json` "
        f"(every setting and definition is there; `report.md` beside it has the full table).", "",
        tables.markdown(HEADERS, cells), "",
        "α: accepted ÷ tried draft tokens; τ: tokens per target call (both by exact replay over every prompt); "
        "speedup: target-alone wall time ÷ this row's on the timed prompts (HF assisted generation: ÷ transformers "
        "generate() without an assistant); modeled: replayed counts of every prompt × measured costs; [95% bootstrap "
        "intervals over prompts]; n.s.: a number the measurement cannot support (see report.md's doctor).",
    ]
    if summary:
        i, b = (pick(summary, f"{k}_teacher_forced_acceptance", f"{k}.teacher_forced_acceptance") for k in ("init", "best"))
        if i is not None or b is not None:
            lines.append(f"Teacher-forced acceptance α_TF on held-out answers: {tables.num(i, 3)} (init) → "
                         f"{tables.num(b, 3)} (distilled).")
    if (Path(rd) / "publish" / "README.md").is_file():
        lines.append(f"Upload folder with model card: `{rd}/publish/`.")
    lines += ["", "Command:", "", "```bash", command_line(hc), "```", ""]
    return "\n".join(lines), cells


def write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)


# ---------------------------------------------------------------- W&B


def log_wandb(cfg: DictConfig, cells: list[list[str]], report: dict) -> None:
    """The results table and headline numbers as a W&B run in group <run_name> (offline by default)."""
    if cfg.wandb_mode == "disabled":
        return
    import wandb

    run = wandb_start(cfg, f"{cfg.run_name}-results", "pipeline", run_dir(cfg))
    try:
        run.log({"results": wandb.Table(columns=HEADERS, data=cells)})
        best = report.get("best") or {}
        run.summary.update({f"best/{k}": v for k, v in best.items() if isinstance(v, (int, float, str, bool))
                            and k not in (best.get("flagged") or {})})
        for r in headline_rows(report)[0]:
            for k in ("acceptance_rate", "tokens_per_target_call", "tokens_per_s", "speedup", "modeled_speedup"):
                if isinstance(r.get(k), (int, float)) and k not in (r.get("flagged") or {}):
                    run.summary[f"{r['eval_set']}/{r['name']}/{k}"] = r[k]
    finally:
        wandb_finish(run, cfg, "pipeline")


# ---------------------------------------------------------------- the pipeline


def run(cfg: DictConfig) -> dict:
    hc = hydra_config()
    if is_multirun(hc):  # a run dir per job; its stages take no stage tag (distill.sweep.stage_tag)
        cfg = copy.deepcopy(cfg)
        cfg.run_name = job_run_name(cfg, hc)
    validate(cfg)  # fail before the first stage, not in the third
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("the pipeline runs its stages in one process; for multi-process distillation run "
                          "`accelerate launch -m distill.distill <overrides>` first, then `python -m distill.pipeline "
                          "<same overrides>` (it finds the distill stage complete)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"run_dir": run_dir(cfg), "stages": {}}
    for stage in (s for s in STAGES if s in cfg.stages):
        log.info("pipeline: %s", stage)
        results["stages"][stage] = importlib.import_module(MODULES[stage]).run(cfg)

    rd = Path(run_dir(cfg))
    report_path = stage_path(cfg, "evaluate") / "report.json"
    if not report_path.is_file():
        log.warning("no %s yet: run the evaluate stage for the results table", report_path)
        return results
    report = read_json(report_path)
    summary_path = stage_path(cfg, "distill") / "summary.json"
    text, cells = results_markdown(cfg, report, read_json(summary_path) if summary_path.is_file() else None, hc)
    write_if_changed(rd / "results.md", text)
    print("\n" + tables.markdown(HEADERS, cells) + f"\n\n(written to {rd / 'results.md'})", flush=True)
    results["results"] = str(rd / "results.md")
    if is_multirun(hc):
        results["comparison"] = str(add_comparison_row(Path(hc.sweep.dir), cfg, report))
        log.info("sweep comparison: %s", results["comparison"])
    if cfg.logger == "wandb":
        log_wandb(cfg, cells, report)
    return results


def main_cli(cfg: DictConfig) -> dict:
    """cli() plus the evaluate stage's exit 1 when speculative greedy output differs from the target's."""
    try:
        return cli(run, cfg)
    except Exception as err:
        if type(err).__name__ != "GreedyMismatch":
            raise
        print(f"FAILED: {err}", file=sys.stderr)
        sys.exit(1)


@stage_main("pipeline")
def main(cfg: DictConfig) -> None:
    main_cli(cfg)


if __name__ == "__main__":
    main()
