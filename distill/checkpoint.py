"""Checkpoints, the best draft and the summary of the distill stage (runs/<run>/distill/).

    checkpoint-<step>/   plain HF model dir (config.json, safetensors, tokenizer), plus
                         trainer_state.json   step, history (log_history as the transformers Trainer
                                              writes it), tokens, time, world size, global batch
                         accelerate/          accelerator.save_state: model, optimizer, scheduler and
                                              every process's RNG (sharded or engine-owned under FSDP
                                              and DeepSpeed, as accelerate saves them there)
                         A LoRA student keeps its adapter in adapter/ (its base is distill/init/) and,
                         with student.merge, the merged plain model at the top level.
    best/                plain HF model dir of the step with the highest α_TF (+ best.json)
    init/                the undistilled draft (LoRA only: the adapter's base model)
    summary.json         history (step, loss, α_TF, tokens/s), init and best α_TF, settings, done
    diverged-checkpoint-<step>/, diverged-best/
                         set aside when the loss became non-finite: made by the weights that diverged
    broken-checkpoint-<step>/
                         set aside when a resume found it unloadable (truncated, corrupt) or non-finite

A checkpoint is good when its weights are finite and they never produced a non-finite loss (its step
is before the step whose loss diverged); resume takes the latest good one.

Every directory is written under a temporary dot-name and renamed into place, so a kill -9 at any
moment leaves either the previous complete directory or the new complete one, never half of one.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from distill.utils import atomic_write_json, read_json, writing
from specdec.files import replace_dir

log = logging.getLogger(__name__)

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
ACC_STATE = "accelerate"
TRAINING_FILES = (STATE, ACC_STATE)  # what a checkpoint holds beside its model: never part of a published draft


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under out, oldest first: [(step, dir)]."""
    found = []
    for p in out.glob("checkpoint-*"):
        m = CKPT_RE.match(p.name)
        if m and (p / STATE).is_file() and (p / ACC_STATE).is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def all_finite(model: torch.nn.Module) -> bool:
    """True when every parameter of `model` is finite (no NaN or inf)."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def set_aside(path: Path, prefix: str) -> Path:
    """Rename a checkpoint dir to <prefix>-<name> beside it (replacing an earlier one): kept for a look,
    never resumed from, removed by clear()."""
    dest = path.parent / f"{prefix}-{path.name}"
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(path, dest)
    return dest


def set_aside_diverged(out: Path, bad_step: int) -> list[Path]:
    """Set aside every checkpoint (and best/) made at or after `bad_step`, the step whose weights gave a
    non-finite loss: resuming from them would diverge again. Returns the new paths."""
    moved = [set_aside(p, "diverged") for step, p in checkpoints(out) if step >= bad_step]
    info = best_info(out)
    if info is not None and info.get("step", 0) >= bad_step:
        moved.append(set_aside(out / "best", "diverged"))
    return moved


def recover(out: Path) -> None:
    """Undo what a kill during a save can leave: temp dirs and files, and a best/ parked as .best.old."""
    for p in out.glob(".*.tmp"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:  # e.g. .summary.json.<random>.tmp from an atomic JSON write
            p.unlink(missing_ok=True)
    for p in out.glob(".*.old"):
        final = out / p.name[1:-4]
        if not final.exists():
            os.rename(p, final)
        else:
            shutil.rmtree(p, ignore_errors=True)


def save_model_dir(model: torch.nn.Module, tok: Any, path: Path, merge: bool = True) -> None:
    """A plain HF model dir at path (must not exist). LoRA: adapter/ and, if merge, the merged model."""
    path.mkdir(parents=True)
    if is_peft(model):
        model.save_pretrained(path / "adapter")
        if merge:
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(path)
    else:
        model.save_pretrained(path)
    tok.save_pretrained(path)


def save_checkpoint(out: Path, step: int, acc: Any, model: torch.nn.Module, tok: Any, state: dict,
                    merge: bool = True, keep: int = 3) -> Path:
    """Write checkpoint-<step> atomically (called by every process: each saves its own RNG, and under FSDP
    or DeepSpeed its shard), then keep the last `keep`. `state`: trainer_state.json's contents."""
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.tmp"
    drop = lambda: shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731 (a failed write leaves no half checkpoint)
    if acc.is_main_process:
        drop()
        with writing(final, drop):
            save_model_dir(model, tok, tmp, merge)
    acc.wait_for_everyone()
    with writing(final, drop):
        acc.save_state(str(tmp / ACC_STATE))
    acc.wait_for_everyone()
    if acc.is_main_process:
        with writing(final, drop):
            atomic_write_json(tmp / STATE, state)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for _, old in checkpoints(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def check_model_dir(ckpt: Path) -> None:
    """Raise when a checkpoint's HF model files (what evaluate and publish read) are truncated or corrupt:
    safetensors checks each file's header against its size on opening."""
    for f in [*ckpt.glob("*.safetensors"), *ckpt.glob("adapter/*.safetensors")]:
        with safe_open(str(f), "pt"):
            pass


def load_checkpoint(acc: Any, ckpt: Path) -> dict:
    """Restore model, optimizer, scheduler and this process's RNG from a checkpoint (accelerator.load_state);
    returns its trainer_state.json. Raises whatever a damaged file raises."""
    state = read_json(ckpt / STATE)
    acc.load_state(str(ckpt / ACC_STATE))
    return state


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Copy the weights of a checkpoint into `model` (full: the HF dir; LoRA: the adapter)."""
    if is_peft(model):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(ckpt / "adapter" / "adapter_model.safetensors")))
        return
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=next(model.parameters()).dtype)
    model.load_state_dict(loaded.state_dict())


def save_best(out: Path, model: torch.nn.Module, tok: Any, info: dict, merge: bool = True) -> None:
    """Replace best/ with the current model (atomically: written aside, then swapped in)."""
    tmp = out / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(out / "best", lambda: shutil.rmtree(tmp, ignore_errors=True)):
        save_model_dir(model, tok, tmp, merge)
        atomic_write_json(tmp / "best.json", info)
    replace_dir(tmp, out / "best")


def best_info(out: Path) -> Optional[dict]:
    p = out / "best" / "best.json"
    return read_json(p) if p.exists() else None


def save_init(out: Path, model: torch.nn.Module, tok: Any) -> Path:
    """distill/init/: the undistilled draft as a plain HF dir (the base a LoRA adapter applies to)."""
    final = out / "init"
    if not (final / "config.json").exists():
        tmp = out / ".init.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(final, lambda: shutil.rmtree(tmp, ignore_errors=True)):
            save_model_dir(model, tok, tmp)
        replace_dir(tmp, final)
    return final


def clear(out: Path) -> None:
    """Remove every checkpoint, best/, init/ and summary.json (train.resume=never)."""
    every = [*out.glob("checkpoint-*"), *out.glob("diverged-*"), *out.glob("broken-*")]
    for p in every + [out / "best", out / "init"] + list(out.glob(".*")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    (out / "summary.json").unlink(missing_ok=True)


def write_summary(out: Path, summary: dict) -> None:
    atomic_write_json(out / "summary.json", summary)


def read_summary(out: Path) -> Optional[dict]:
    p = out / "summary.json"
    return read_json(p) if p.exists() else None
