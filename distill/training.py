"""What both distill trainers share (the standalone draft's, distill/distill.py, and the feature head's,
distill/heads_train.py): opening the stage, the records check, the learning-rate schedule, the order of
the records, mixed precision, the W&B logger.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf

from distill import checkpoint as ck
from distill.config import ConfigError, run_dir, stage_path
from distill.models import load_tokenizer, resolve_device, tokenizer_fingerprint
from distill.records import check_records_owner, data_key, load_generated
from distill.utils import read_json, start_stage

log = logging.getLogger(__name__)


class TrainingDiverged(ConfigError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


def check_generated(cfg: DictConfig, tok: Any) -> Any:
    """The generated records (a datasets.Dataset), after the checks that name the fix."""
    records = load_generated(run_dir(cfg))
    if len(records) == 0:
        raise ConfigError(f"{run_dir(cfg)}/generate holds no records; run `python -m distill.generate "
                          f"run_name={cfg.run_name}` first")
    man_path = stage_path(cfg, "generate") / "manifest.json"
    if os.path.exists(man_path):
        fp = read_json(man_path).get("tokenizer_fingerprint")
        if fp and fp != tokenizer_fingerprint(tok):
            raise ConfigError(f"{run_dir(cfg)}/generate was made with another tokenizer than {cfg.model.target}'s; "
                              "regenerate with this target (generate.overwrite=true) or choose its run_name")
    if cfg.train.teacher == "topk" and "topk_ids" not in records.column_names:
        raise ConfigError("train.teacher=topk but the generated records hold no top-k logits; "
                          "regenerate with generate.store_topk=64 or use train.teacher=online")
    return records


def schedule(optimizer, t: Any, elapsed_s: Callable[[], float]) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over train.warmup_steps, then cosine or linear decay to 0 (or constant).

    The decay runs over train.max_steps, or over train.time_budget_min when that ends the run first:
    progress is the larger of the share of steps done and the share of the budget spent, so a run
    stopped by its budget still ends with its learning rate annealed.
    """
    budget = t.time_budget_min * 60 if t.time_budget_min else math.inf

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return step / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        done = max((step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps), elapsed_s() / budget)
        done = min(1.0, done)
        return 0.5 * (1.0 + math.cos(math.pi * done)) if t.schedule == "cosine" else 1.0 - done

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def already_done(summary: Optional[dict], cfg: DictConfig, out) -> bool:
    return bool(summary and summary.get("done") and summary.get("max_steps") == cfg.train.max_steps
                and summary.get("time_budget_min") == cfg.train.time_budget_min and (out / "best" / "config.json").exists())


def open_stage(cfg: DictConfig, stage: str = "distill"):
    """The distill stage's start, shared by both kinds of student: validate, form the accelerate group, recover
    from a kill, check the records. Returns (out dir, accelerator, records key, summary) — the summary of a
    finished run (nothing left to do), else None."""
    out = start_stage(cfg, stage)
    t = cfg.train
    if t.holdout < 1:
        raise ConfigError("train.holdout must be >= 1: α_TF on held-out records picks the best checkpoint")
    # cpu=True lets a CPU-only `accelerate launch --multi_gpu` (torchrun) group form over gloo
    acc = Accelerator(cpu=resolve_device(cfg.model.device).type == "cpu", mixed_precision=mixed_precision(t.mixed_precision, cfg))
    if acc.num_processes != int(os.environ.get("WORLD_SIZE", acc.num_processes)):
        raise ConfigError("accelerate formed a group of 1 while WORLD_SIZE is "
                          f"{os.environ['WORLD_SIZE']}; on CPU launch with `accelerate launch --multi_gpu --num_processes N`")
    if acc.is_main_process:
        ck.recover(out)
    acc.wait_for_everyone()
    summary = ck.read_summary(out)
    # whose records these are, and whose draft: checked before anything else (an "already done" included)
    check_records_owner(cfg, load_tokenizer(cfg.model.target, cfg.model.revision, cfg.model.cache_dir,
                                            trust_remote_code=cfg.model.trust_remote_code))
    records_key = data_key(run_dir(cfg))
    other = summary.get("target", cfg.model.target) != cfg.model.target if summary else False
    if other and (ck.checkpoints(out) or already_done(summary, cfg, out)) and t.resume == "auto":
        raise ConfigError(f"{out} holds a draft distilled for model.target={summary['target']!r}, not "
                          f"{cfg.model.target!r}; set train.resume=never to train anew for this target (it replaces "
                          "that draft), or use another run_name")
    if t.resume == "auto" and ck.checkpoints(out) and summary and summary.get("data") != records_key:
        raise ConfigError(f"{out} holds a draft trained on other records than {run_dir(cfg)}/generate holds now; "
                          "set train.resume=never to train anew on these (it replaces that draft), or use another run_name")
    if t.resume == "auto" and already_done(summary, cfg, out):
        log.info("distill: already done (step %s, best α_TF %.4f at step %s) -> %s", summary["step"],
                 summary["best_teacher_forced_acceptance"], summary["best_step"], out)
        return out, acc, records_key, summary
    if acc.is_main_process and (t.resume == "never" or not ck.checkpoints(out)):
        if t.resume == "auto" and list(out.glob("diverged-*")):
            log.warning("distill: the last attempt diverged before any good checkpoint: training from scratch")
        ck.clear(out)  # a fresh start: no best/ or summary of an earlier attempt may survive
    acc.wait_for_everyone()
    return out, acc, records_key, None


def apply_step(acc: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, max_grad_norm: Optional[float]) -> None:
    """The optimizer step after a global batch's backward passes: clip, step, schedule, clear."""
    if max_grad_norm and max_grad_norm > 0:
        acc.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def book_step(state: dict, acc: Any, t: Any, step: int, batch: int, dt: float, tokens: float, elapsed_s: float,
              budget_s: float) -> tuple[bool, bool]:
    """Record a finished optimizer step in a trainer's state -> (over the time budget on any process,
    the run's last step). elapsed_s: wall time so far, evaluations and saves included."""
    state["step"] = step + 1
    state["records_seen"] = (step + 1) * batch
    state["train_s"] += dt
    state["elapsed_s"] = elapsed_s
    state["train_tokens"] += int(tokens)
    over = float(acc.reduce(torch.tensor(float(elapsed_s >= budget_s), device=acc.device), "max")) > 0
    return over, state["step"] >= t.max_steps or over


def close_step(state: dict, entry: dict, t: Any, acc: Any, out, logger: "Logger", save: Callable[[int], None],
               summarize: Callable[[bool], dict], elapsed: Callable[[], float], last_step: bool, over: bool) -> bool:
    """A step's entry into the history and the logger, the periodic checkpoint, the summary after an
    evaluation; True when the time budget ends the run here."""
    state["history"].append(entry)
    logger.log(entry)
    if state["step"] % t.save_every == 0 or last_step:
        save(state["step"])
    state["elapsed_s"] = elapsed()
    if acc.is_main_process and ("teacher_forced_acceptance" in entry or last_step):
        ck.write_summary(out, summarize(False))
    if over and state["step"] < t.max_steps:
        log.info("distill: time budget of %.1f min reached at step %d", t.time_budget_min, state["step"])
        return True
    return False


def global_batch(n: int, step: int, size: int, seed: int) -> list[int]:
    """Indices of the records of optimizer step `step`: a stream of seeded per-epoch permutations."""
    ids: list[int] = []
    pos = step * size
    while len(ids) < size:
        epoch, off = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
        take = perm[off: off + size - len(ids)]
        ids += take
        pos += len(take)
    return ids


def mixed_precision(setting: str, cfg: DictConfig) -> str:
    if setting not in ("auto", "no", "bf16"):
        raise ConfigError(f"train.mixed_precision={setting!r}: use auto (bf16 on GPU, no on CPU), bf16 or no")
    if setting != "auto":
        return setting
    return "bf16" if torch.cuda.is_available() and cfg.model.device != "cpu" else "no"


class Logger:
    """W&B (cfg.logger=wandb, mode cfg.wandb_mode, files under the stage dir) or nothing."""

    def __init__(self, cfg: DictConfig, out, main: bool):
        self.run = None
        if main and cfg.logger == "wandb" and cfg.wandb_mode != "disabled":
            import wandb

            self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name, mode=cfg.wandb_mode, dir=str(out),
                                  config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous")

    def log(self, entry: dict) -> None:
        if self.run:
            self.run.log({f"distill/{k}": v for k, v in entry.items() if v is not None and k != "step"}, step=entry["step"])

    def finish(self, summary: dict) -> None:
        if self.run:
            self.run.summary.update({k: v for k, v in summary.items() if k not in ("history", "settings")})
            self.run.finish()
