"""What both distill trainers share (the standalone draft's, distill/distill.py, and the feature head's,
distill/heads_train.py): opening the stage, the records check, the learning-rate schedule, the order of
the records, mixed precision, the W&B logger.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator
from omegaconf import DictConfig, OmegaConf

from distill import checkpoint as ck
from distill.cli import start_stage
from distill.config import ConfigError, stage_path
from distill.models import load_tokenizer, resolve_device, tokenizer_fingerprint
from distill.records import check_records_owner, data_key, load_generated
from distill.utils import read_json, wandb_finish, wandb_start

log = logging.getLogger(__name__)


class TrainingDiverged(ConfigError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


@dataclass
class TrainState:
    """What a trainer has done so far: written into every checkpoint's trainer_state.json, restored on resume."""
    step: int = 0
    history: list = field(default_factory=list)  # one entry per optimizer step (and step 0's α_TF)
    train_tokens: int = 0
    train_s: float = 0.0  # seconds in optimizer steps
    elapsed_s: float = 0.0  # wall time, evaluations and saves included
    records_seen: int = 0
    init_teacher_forced_acceptance: Optional[float] = None

    def book(self, acc: Any, t: Any, batch: int, dt: float, tokens: float, elapsed_s: float,
             budget_s: float) -> tuple[bool, bool]:
        """Record a finished optimizer step -> (over the time budget on any process, the run's last step)."""
        self.step += 1
        self.records_seen = self.step * batch
        self.train_s += dt
        self.elapsed_s = elapsed_s
        self.train_tokens += int(tokens)
        over = float(acc.reduce(torch.tensor(float(elapsed_s >= budget_s), device=acc.device), "max")) > 0
        return over, self.step >= t.max_steps or over

    def trainer_state(self, max_steps: int, global_batch: int, world: int, best: dict, out) -> dict:
        """trainer_state.json: the keys the transformers Trainer writes (global_step, log_history, ...), then
        this state whole under "distill" (what a resume reads back)."""
        return {"global_step": self.step, "max_steps": max_steps, "train_batch_size": global_batch,
                "num_input_tokens_seen": self.train_tokens, "best_metric": best.get("teacher_forced_acceptance"),
                "best_model_checkpoint": str(out / "best") if best else None, "log_history": log_history(self.history),
                "world_size": world, "distill": dataclasses.asdict(self)}

    @classmethod
    def from_trainer_state(cls, saved: dict) -> "TrainState":
        return cls(**saved["distill"])


def log_history(history: list[dict]) -> list[dict]:
    """The Trainer's log_history: a training entry per step (loss, learning_rate), an eval entry per α_TF."""
    logs = []
    for h in history:
        if h.get("loss") is not None:
            logs.append({"step": h["step"], "loss": h["loss"], "learning_rate": h.get("lr"),
                         "tokens_per_s": h.get("tokens_per_s")})
        if h.get("teacher_forced_acceptance") is not None:
            logs.append({"step": h["step"], "eval_teacher_forced_acceptance": h["teacher_forced_acceptance"]})
    return logs


# train.* keys that change how a run goes, not the draft it makes (lr: a rerun after a divergence may lower it)
OPERATIONAL = ("max_steps", "time_budget_min", "batch_size", "grad_accum", "eval_every", "save_every",
               "keep_checkpoints", "resume", "gradient_checkpointing", "prompt_grad", "mixed_precision", "lr")


def recipe(settings: dict, resuming: bool) -> dict:
    """The settings that make a draft what it is, flattened to dotted keys, from a summary's "settings" (or
    the same built from a config). A finished draft of another recipe is not "done" for this config; when
    resuming unfinished checkpoints the learning rates may differ."""
    flat: dict = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            flat[prefix] = v

    keep = {k: v for k, v in settings.items() if k in ("loss", "student", "train", "head", "draft", "draft_layers",
                                                      "draft_init", "global_batch")}
    walk("", keep)
    drop = {f"train.{k}" for k in OPERATIONAL if k != "lr" or resuming} | {"head.also", "head.time_budget_min"}
    if resuming:
        drop.add("head.lr")
    return {k: v for k, v in flat.items() if k not in drop}


def settings_of(cfg: DictConfig, world: int) -> dict:
    """What a trainer's summary records under "settings" for `cfg`, as far as `recipe` reads it."""
    t = cfg.train
    s = {"loss": OmegaConf.to_container(cfg.loss), "student": OmegaConf.to_container(cfg.student),
         "train": OmegaConf.to_container(t), "global_batch": t.batch_size * world * t.grad_accum}
    if cfg.student.kind == "head":
        s["head"] = {k: v for k, v in OmegaConf.to_container(cfg.head).items() if k != "layers" or v is not None}
    else:
        s["draft"], s["draft_layers"], s["draft_init"] = cfg.model.draft, list(cfg.model.draft_layers), cfg.model.draft_init
    return s


def other_recipe(summary: dict, cfg: DictConfig, world: int, resuming: bool) -> list[str]:
    """'key: saved -> now' for every setting where the draft in `summary` and `cfg` differ (keys both have)."""
    was, now = recipe(summary.get("settings") or {}, resuming), recipe(settings_of(cfg, world), resuming)
    return [f"{k}: {was[k]!r} -> {now[k]!r}" for k in sorted(was.keys() & now.keys()) if was[k] != now[k]]


def check_generated(cfg: DictConfig, tok: Any) -> Any:
    """The generated records (a datasets.Dataset), after the checks that name the fix."""
    gen = stage_path(cfg, "generate")
    records = load_generated(gen)
    if len(records) == 0:
        raise ConfigError(f"{gen} holds no records; run `python -m distill.generate "
                          f"run_name={cfg.run_name}` first")
    man_path = gen / "manifest.json"
    if os.path.exists(man_path):
        fp = read_json(man_path).get("tokenizer_fingerprint")
        if fp and fp != tokenizer_fingerprint(tok):
            raise ConfigError(f"{gen} was made with another tokenizer than {cfg.model.target}'s; "
                              "regenerate with this target (generate.overwrite=true) or choose its run_name")
    if cfg.train.teacher == "topk" and "topk_ids" not in records.column_names:
        raise ConfigError("train.teacher=topk but the generated records hold no top-k logits; "
                          "regenerate with generate.store_topk=64 or use train.teacher=online")
    return records


def schedule(optimizer, t: Any, elapsed_s: Callable[[], float]) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over train.warmup_steps, then cosine or linear decay to 0 (or constant).

    The decay runs over train.max_steps, or over train.time_budget_min when that ends the run first:
    progress is the larger of the share of steps done and the share of the budget spent, so a run
    stopped by its budget still ends with its learning rate annealed. (transformers.get_scheduler has the
    same shapes, but as functions of the step alone: it cannot follow a time budget.)
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
    records_key = data_key(stage_path(cfg, "generate"))
    other = summary.get("target", cfg.model.target) != cfg.model.target if summary else False
    if other and (ck.checkpoints(out) or already_done(summary, cfg, out)) and t.resume == "auto":
        raise ConfigError(f"{out} holds a draft distilled for model.target={summary['target']!r}, not "
                          f"{cfg.model.target!r}; set train.resume=never to train anew for this target (it replaces "
                          "that draft), or use another run_name")
    if t.resume == "auto" and ck.checkpoints(out) and summary and summary.get("data") != records_key:
        raise ConfigError(f"{out} holds a draft trained on other records than {stage_path(cfg, 'generate')} holds now; "
                          "set train.resume=never to train anew on these (it replaces that draft), or use another run_name")
    if t.resume == "auto" and summary and (ck.checkpoints(out) or already_done(summary, cfg, out)):
        diff = other_recipe(summary, cfg, acc.num_processes, resuming=not already_done(summary, cfg, out))
        if diff:
            raise ConfigError(f"{out} holds a draft trained with other settings ({'; '.join(diff)}); set "
                              "train.resume=never to train anew with these (it replaces that draft), or use another "
                              "run_name (a Hydra sweep, -m, gives each job its own directory)")
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


def resume_point(out, acc: Any, model: torch.nn.Module) -> tuple[Any, TrainState]:
    """Load the latest checkpoint that loads whole and has finite weights (model, optimizer, scheduler, RNG)
    -> (its dir, its TrainState). Later ones that do not (truncated, corrupt, non-finite) are set aside as
    broken-checkpoint-<step>, named with the one resumed from; ConfigError when none loads."""
    broken, found = [], None
    for _, path in reversed(ck.checkpoints(out)):
        try:
            ck.check_model_dir(path)
            saved = ck.load_checkpoint(acc, path)
            if not ck.all_finite(model):
                raise ValueError("its weights are not finite")
            found = (path, TrainState.from_trainer_state(saved))
        except Exception as e:  # whatever a damaged file raises (SafetensorError, EOFError, UnpicklingError, ...)
            text = str(e).strip()
            broken.append((path, f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"))
            continue
        break
    acc.wait_for_everyone()  # every process has tried them before any is renamed
    if acc.is_main_process:
        for path, _ in broken:
            ck.set_aside(path, "broken")
    acc.wait_for_everyone()
    what = "; ".join(f"{p.name} ({why})" for p, why in broken)
    if found is None:
        raise ConfigError(f"no checkpoint in {out} can be resumed from: {what}; they are set aside as broken-*, so a "
                          "rerun trains from scratch (or set train.resume=never now)")
    for path, why in broken:
        log.warning("distill: %s cannot be resumed from (%s); set aside as broken-%s. Resuming from the previous "
                    "good checkpoint %s instead", path, why, path.name, found[0].name)
    return found


def apply_step(acc: Any, model: torch.nn.Module, optimizer: Any, scheduler: Any, max_grad_norm: Optional[float]) -> None:
    """The optimizer step after a global batch's backward passes: clip, step, schedule, clear."""
    if max_grad_norm and max_grad_norm > 0:
        acc.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def close_step(state: TrainState, entry: dict, t: Any, acc: Any, out, logger: "Logger", save: Callable[[int], None],
               summarize: Callable[[bool], dict], elapsed: Callable[[], float], last_step: bool, over: bool) -> bool:
    """A step's entry into the history and the logger, the periodic checkpoint, the summary after an
    evaluation; True when the time budget ends the run here."""
    state.history.append(entry)
    logger.log(entry)
    if state.step % t.save_every == 0 or last_step:
        save(state.step)
    state.elapsed_s = elapsed()
    if acc.is_main_process and ("teacher_forced_acceptance" in entry or last_step):
        ck.write_summary(out, summarize(False))
    if over and state.step < t.max_steps:
        log.info("distill: time budget of %.1f min reached at step %d", t.time_budget_min, state.step)
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
    """W&B (cfg.logger=wandb, mode cfg.wandb_mode, files under the stage dir) or nothing. The run is named
    <run_name>-<stage> in group <run_name> (beside the pipeline's <run_name>-results), so a draft and the head
    trained after it (distill, distill-head) are two runs of one group."""

    def __init__(self, cfg: DictConfig, out, main: bool):
        self.run, self.cfg = None, cfg
        if main and cfg.logger == "wandb" and cfg.wandb_mode != "disabled":
            stage = os.path.basename(os.path.normpath(str(out)))
            self.run = wandb_start(cfg, f"{cfg.run_name}-{stage}", stage, out)

    def log(self, entry: dict) -> None:
        if self.run:
            self.run.log({f"distill/{k}": v for k, v in entry.items() if v is not None and k != "step"}, step=entry["step"])

    def finish(self, summary: dict) -> None:
        if self.run:
            self.run.summary.update({k: v for k, v in summary.items() if k not in ("history", "settings")})
            wandb_finish(self.run, self.cfg, "distill")
