"""The distill stage: train a same-tokenizer draft on the target's answers; keep the one the target accepts most.

    python -m distill.distill model=tiny experiment=smoke run_name=try          # after distill.generate; CPU, seconds
    python -m distill.distill experiment=smoke                                  # embedded SmolLM2, CPU, minutes
    python -m distill.distill student=lora loss=tvd train.teacher=topk train.lr=1e-3
    accelerate launch --config_file launch/cpu-2proc.yaml -m distill.distill experiment=smoke

Reads runs/<run>/generate (the target's answers), writes runs/<run>/distill/ (see distill/checkpoint.py).
One optimizer step sees a global batch of train.batch_size × processes × train.grad_accum records,
taken in order from a seeded shuffle of the training records, and normalises the loss by the number
of response tokens in the whole global batch: the result does not depend on how many processes share
the batch. The target's next-token distribution at every response position is the teacher, either
computed online (train.teacher=online) or read from the top-k logits the generate stage stored
(train.teacher=topk, generate.store_topk=k). With train.on_policy_fraction=λ, a share λ of the steps
trains on continuations the draft samples itself, scored online by the target.

α_TF (teacher_forced_acceptance, 1 − TV between target and draft, averaged over the response tokens
of train.holdout held-out records) is measured before training and every train.eval_every steps;
best/ is the draft with the highest α_TF (training loss is a poor guide to acceptance). The target's
reference distributions on the holdout are computed once: its top-1024 probabilities (exact, not
renormalised), so α_TF is exact up to the target's tail mass beyond them (reported, ~0). With
train.calibrate (full student), best/'s logits are then scaled by the one factor that maximises α_TF on
that holdout (written into its final norm; best.json records the fit).

Reads top to bottom: run() and the loop (_run_standalone), then the parts it calls in order: setup()
builds a Run, resume() continues from the latest good checkpoint (accelerator.load_state), train_step()
is one optimizer step, evaluate_and_save() measures α_TF, keeps best/ and checkpoints, summary() and
finish() write the result. Why one module of this size: the standalone draft's loss, loop, resume and
calibration; what it shares with the feature head's trainer (TrainState, checkpoints, the schedule, the
logger) is in distill/training.py and distill/checkpoint.py.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from distill import checkpoint as ck
from distill.batches import LogitScale, collate, decoder_and_head, holdout_reference, measure_alpha, sample_on_policy, split_holdout, to_examples
from distill.config import HEAD_STAGE, ConfigError, stage_path
from distill.losses import HiddenTeacher, TopKTeacher, VocabSubset, chunked_distill_loss, gather_teacher
from distill.models import load_draft, load_target, shared_vocab_size
from distill.plots import training_curves
from distill.heads_train import run as run_head
from distill.records import run_draft_vocab
from distill.training import (
    Logger, TrainingDiverged, TrainState, apply_step, check_generated, close_step, global_batch, open_stage, resume_point,
    schedule, settings_of,
)
from distill.cli import cli, stage_main

log = logging.getLogger(__name__)


class DraftLoss(torch.nn.Module):
    """The draft plus its loss, so that DDP/FSDP see one forward: batch -> (loss sum, positions).

    prompt_grad=False runs the prefix that no batch row trains on (up to the first trained position)
    without autograd and feeds it as a KV cache: the loss is the same, only the gradient paths through
    the prompt tokens' own activations are dropped, which saves most of the backward pass when prompts
    are longer than answers.
    """

    def __init__(self, draft: torch.nn.Module, loss_cfg: Any, vocab: int, prompt_grad: bool = True,
                 subset: Optional[VocabSubset] = None):
        super().__init__()
        self.draft, self.lc, self.vocab, self.prompt_grad, self.subset = draft, loss_cfg, vocab, prompt_grad, subset

    def forward(self, input_ids, attention_mask, positions, labels, teacher):
        decoder, head = decoder_and_head(self.draft)
        start = int(positions.float().argmax(dim=1).min()) if not self.prompt_grad else 0  # first trained column
        if start > 0:
            # transformers >= 5 names the KV cache `cache`, earlier versions `past_key_values`
            key = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
            with torch.no_grad():
                out = decoder(input_ids=input_ids[:, :start], attention_mask=attention_mask[:, :start], use_cache=True)
            hidden = decoder(input_ids=input_ids[:, start:], attention_mask=attention_mask, use_cache=True,
                             **{key: out[key]}).last_hidden_state  # [B, T - start, H]
            positions, labels = positions[:, start:], labels[:, start:]
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        lc, vocab = self.lc, self.vocab
        lm_weight = lc.get("prompt_ce_weight", 0.0)
        if lm_weight:  # prompt position j predicts prompt token j + 1, up to the first response position
            cols = torch.arange(input_ids.shape[1], device=input_ids.device)
            first = positions.float().argmax(dim=1, keepdim=True)  # [B, 1]: the last prompt position
            prompt_next = (cols < first) & attention_mask.bool()  # [B, T]
            prompt_labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)
        if self.subset is not None:  # train q as it is decoded: a softmax over the draft vocabulary
            teacher, keep = self.subset.restrict(teacher)
            if keep is not None and not bool(keep.all()):  # rows whose teacher lies wholly outside it count 0
                positions = positions.clone()
                positions[positions.clone()] = keep
                teacher = gather_teacher(teacher, keep)
            head, labels, vocab = self.subset.project(head), self.subset.labels(labels), self.subset.size + 1
        total, n = chunked_distill_loss(
            hidden, head, positions, teacher, lc.name, lc.beta, lc.temperature,
            labels, lc.ce_weight, lc.chunk_size, vocab,
        )
        if lm_weight and bool(prompt_next.any()):
            if self.subset is not None:
                prompt_labels = self.subset.labels(prompt_labels)
            lm, _ = chunked_distill_loss(hidden, head, prompt_next, None, labels=prompt_labels, ce_weight=lm_weight,
                                         chunk_size=lc.chunk_size, vocab_size=vocab)
            total = total + lm
        return total, n


def make_student(cfg: DictConfig, draft: torch.nn.Module, out) -> torch.nn.Module:
    """student=full (optionally freezing embeddings + LM head and the first layers) or student=lora
    (peft adapter; none on the frozen first layers)."""
    s = cfg.student
    n_layers = len(draft.get_decoder().layers)
    if s.freeze_layers and not 0 < s.freeze_layers < n_layers:
        raise ConfigError(f"student.freeze_layers={s.freeze_layers} must leave at least one of the draft's "
                          f"{n_layers} layers to train; choose 0..{n_layers - 1}")
    if s.kind == "lora":
        from peft import LoraConfig, get_peft_model

        present = sorted({n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)})
        missing = [m for m in s.lora_target_modules if m not in present]
        if missing:
            raise ConfigError(f"student.lora_target_modules {missing} do not exist in {type(draft).__name__}; "
                              f"its linear modules are {present}")
        # freeze_layers: no adapter on the first N layers, so they stay the target's and nothing runs backward there
        only = dict(layers_to_transform=list(range(s.freeze_layers, n_layers)), layers_pattern="layers") \
            if s.freeze_layers else {}
        draft = get_peft_model(draft, LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                                                 target_modules=list(s.lora_target_modules), **only))
        draft.peft_config["default"].base_model_name_or_path = str((out / "init").resolve())
    else:
        if s.freeze_embeddings:
            for emb in (draft.get_input_embeddings(), draft.get_output_embeddings()):
                emb.weight.requires_grad_(False)
        for layer in draft.get_decoder().layers[:s.freeze_layers]:
            layer.requires_grad_(False)
    if cfg.train.gradient_checkpointing:
        base = draft.get_base_model() if ck.is_peft(draft) else draft
        kw = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return draft.train()


def run(cfg: DictConfig) -> dict:
    """Train (or finish training) the draft of runs/<run>; returns the summary (also distill/summary.json).
    With head.also, then a feature head beside it (runs/<run>/distill-head; its summary under "head")."""
    if cfg.student.kind == "head":  # a feature head: its own recipe (distill/heads_train.py)
        return run_head(cfg)
    result = _run_standalone(cfg)
    if cfg.head.also:
        result = {**result, "head": run_head(beside_head(cfg), HEAD_STAGE)}
    return result


def beside_head(cfg: DictConfig) -> DictConfig:
    """The config of the head trained beside the standalone draft (head.also): student=head, with the
    head's own time budget (head.time_budget_min; null: train.time_budget_min)."""
    hc = OmegaConf.create(OmegaConf.to_container(cfg))
    hc.student.kind = "head"
    if cfg.head.time_budget_min is not None:
        hc.train.time_budget_min = cfg.head.time_budget_min
    return hc


def _run_standalone(cfg: DictConfig) -> dict:
    out, acc, records_key, finished = open_stage(cfg)
    if finished:
        return finished
    r = setup(cfg, out, acc, records_key)
    resume(r)
    t = cfg.train
    logger = Logger(cfg, out, acc.is_main_process)
    if r.state.step == 0:
        logger.log(r.state.history[0])  # the undistilled draft's α_TF
    timed = math.isfinite(r.budget_s)  # the bar counts seconds of the budget, else steps
    bar = tqdm(total=int(r.budget_s) if timed else t.max_steps, initial=int(r.state.elapsed_s) if timed else r.state.step,
               unit="s" if timed else "step", desc=f"distill ({t.time_budget_min:g} min budget)" if timed else "distill",
               disable=not acc.is_main_process)
    alpha_now = next((h["teacher_forced_acceptance"] for h in reversed(r.state.history)
                      if h.get("teacher_forced_acceptance") is not None), None)  # the latest, resumed runs included
    r.start_clock()
    while r.state.step < t.max_steps:
        entry, over, last_step = train_step(r)
        stop = evaluate_and_save(r, entry, logger, last_step, over)
        alpha_now = entry.get("teacher_forced_acceptance", alpha_now)
        bar.update(min(int(r.state.elapsed_s), bar.total) - bar.n if timed else 1)
        bar.set_postfix(step=r.state.step, loss=f"{entry['loss']:.4f}", tok_s=f"{entry['tokens_per_s']:.0f}",
                        alpha_tf=f"{alpha_now:.3f}" if alpha_now is not None else "-")
        if stop:
            r.stopped = "time_budget"
            break
    bar.close()
    return finish(r, logger)


@dataclass
class Run:
    """One distill run's parts, as setup() builds them; the loop's functions below take it."""
    cfg: DictConfig
    out: Path
    acc: Any
    tok: Any
    target: Optional[torch.nn.Module]  # None when nothing needs it after the holdout reference (topk teacher)
    student: torch.nn.Module
    model: torch.nn.Module  # the student inside its loss, as accelerate prepared it
    optimizer: Any
    scheduler: Any
    subset: Optional[VocabSubset]
    vocab: int
    train_set: list
    holdout: list
    ref: Any  # the target's reference distributions on this process's share of the holdout
    records_key: str
    state: TrainState = field(default_factory=TrainState)
    best: dict = field(default_factory=dict)  # best/best.json: the step of the highest α_TF so far
    stopped: str = "max_steps"
    clock: tuple = (0.0, 0.0)  # (perf_counter, state.elapsed_s) when this process started training

    @property
    def global_batch(self) -> int:
        t = self.cfg.train
        return t.batch_size * self.acc.num_processes * t.grad_accum

    @property
    def budget_s(self) -> float:
        t = self.cfg.train
        return t.time_budget_min * 60 if t.time_budget_min else math.inf

    def start_clock(self) -> None:
        self.clock = (time.perf_counter(), self.state.elapsed_s)

    def elapsed(self) -> float:
        """Wall time of the run so far, resumed attempts included."""
        return self.clock[1] + time.perf_counter() - self.clock[0]

    def alpha(self) -> float:
        """α_TF on the whole holdout (every process scores its share)."""
        num, den = measure_alpha(self.student, self.ref, self.acc.device, self.cfg.loss.chunk_size, self.vocab, self.subset)
        tot = self.acc.reduce(torch.tensor([num, den], dtype=torch.float64, device=self.acc.device), "sum")
        return float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")

    def finite(self) -> bool:
        """Every process's weights are finite (checked before anything is written)."""
        bad = torch.tensor(0.0 if ck.all_finite(self.student) else 1.0, device=self.acc.device)
        return float(self.acc.reduce(bad, "max")) == 0


def setup(cfg: DictConfig, out: Path, acc: Any, records_key: str) -> Run:
    """Load the target and the draft, split the records, build the student, its optimizer and schedule, and
    the target's reference distributions on the holdout."""
    t, lc = cfg.train, cfg.loss
    mcfg = OmegaConf.merge(cfg.model, {"device": str(acc.device)})
    target, tok = load_target(mcfg)
    records = check_generated(cfg, tok)
    draft = load_draft(mcfg, target, tok)
    vocab = shared_vocab_size(tok, target, draft)
    train_set, holdout = split_holdout(to_examples(records, t.max_seq_len, t.teacher == "topk"), t.holdout, cfg.seed)
    if not train_set:
        raise ConfigError(f"all {len(holdout)} generated records are held out; generate more or lower train.holdout")
    if cfg.student.kind == "lora" and acc.is_main_process:
        ck.save_init(out, draft, tok)
    ids = run_draft_vocab(cfg, vocab, tok) if t.draft_vocab else None
    subset = VocabSubset(ids.to(acc.device), vocab) if ids is not None else None
    student = make_student(cfg, draft, out)
    if acc.mixed_precision != "no":
        student.float()  # master weights in fp32; autocast computes in bf16
    # the fused kernel: one pass over the weights instead of one per operation
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay, fused=acc.device.type in ("cpu", "cuda"))
    state = TrainState()
    scheduler = schedule(optimizer, t, lambda: state.elapsed_s)
    loss = DraftLoss(student, lc, vocab, prompt_grad=t.prompt_grad or t.gradient_checkpointing, subset=subset)
    model, optimizer = acc.prepare(loss, optimizer)
    acc.register_for_checkpointing(scheduler)
    ref = holdout_reference(target, holdout[acc.process_index::acc.num_processes], t.batch_size, vocab, acc.device,
                            lc.chunk_size)
    if not (t.teacher == "online" or t.on_policy_fraction > 0):
        target = None  # the stored top-k logits teach: the target is not needed again
    return Run(cfg, out, acc, tok, target, student, model, optimizer, scheduler, subset, vocab, train_set, holdout,
               ref, records_key, state)


def resume(r: Run) -> None:
    """Continue from the latest good checkpoint (train.resume=auto), else start: α_TF of the undistilled
    draft is step 0 of the history and the first best/."""
    t, acc = r.cfg.train, r.acc
    if t.resume == "auto" and ck.checkpoints(r.out):
        path, saved = resume_point(r.out, acc, r.student)
        r.state.__dict__.update(saved.__dict__)  # in place: the schedule reads r.state
        _use_lr(r.optimizer, r.scheduler, t.lr)
        log.info("distill: resuming from %s (step %d)", path, r.state.step)
    r.best = ck.best_info(r.out) or {}
    if r.state.step == 0:
        a0 = r.alpha()
        r.state.init_teacher_forced_acceptance = a0
        r.state.history = [{"step": 0, "loss": None, "teacher_forced_acceptance": a0, "tokens_per_s": None}]
        if not r.best or a0 > r.best["teacher_forced_acceptance"]:
            r.best = {"step": 0, "teacher_forced_acceptance": a0}
            if acc.is_main_process:
                ck.save_best(r.out, r.student, r.tok, r.best, r.cfg.student.merge)


def train_step(r: Run) -> tuple[dict, bool, bool]:
    """One optimizer step on the next global batch -> (its history entry, over the time budget, the last step).

    Each process takes its micro-batches from the global batch; the loss is normalised by the response
    tokens of the whole global batch, so the step does not depend on the process count."""
    t, acc, state = r.cfg.train, r.acc, r.state
    rank, world, step = acc.process_index, acc.num_processes, state.step
    t0 = time.perf_counter()
    batch_ids = global_batch(len(r.train_set), step, r.global_batch, r.cfg.seed)
    on_policy = t.on_policy_fraction > 0 and random.Random(r.cfg.seed * 1_000_003 + step).random() < t.on_policy_fraction
    micro_batches = []
    for a in range(t.grad_accum):
        lo = (a * world + rank) * t.batch_size
        exs = [r.train_set[i] for i in batch_ids[lo:lo + t.batch_size]]
        if on_policy:
            exs = sample_on_policy(r.student, exs, t.on_policy_max_new_tokens, r.tok, acc.device, r.subset)
        micro_batches.append(exs)
    local_n = sum(len(e.response_ids) for exs in micro_batches for e in exs)
    count = float(acc.reduce(torch.tensor(float(local_n), device=acc.device), "sum"))
    loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
    bad = []
    for a, exs in enumerate(micro_batches):
        topk = t.teacher == "topk" and not on_policy
        b = collate(exs, r.tok.pad_token_id, acc.device, with_topk=topk)
        teacher = _teacher(r.target, b, topk)
        sync = a == len(micro_batches) - 1
        with (contextlib.nullcontext() if sync else acc.no_sync(r.model)), acc.autocast():
            total, _ = r.model(b["input_ids"], b["attention_mask"], b["positions"], b["labels"], teacher)
            if not torch.isfinite(total):
                bad.append(f"micro-batch {a} records {[e.id for e in exs]}")
            acc.backward(total * (world / max(count, 1.0)))
        loss_sum += total.detach().double()
    loss = float(acc.reduce(loss_sum, "sum")) / max(count, 1.0)
    if not math.isfinite(loss):
        raise _diverged(r, f"loss is {loss} at step {step + 1} ({'; '.join(bad) or 'on another process'})")
    apply_step(acc, r.model, r.optimizer, r.scheduler, t.max_grad_norm)
    dt = time.perf_counter() - t0
    over, last_step = state.book(acc, t, r.global_batch, dt, count, r.elapsed(), r.budget_s)
    entry = {"step": state.step, "loss": loss, "lr": r.scheduler.get_last_lr()[0], "tokens_per_s": count / dt,
             "on_policy": on_policy, "elapsed_s": round(state.elapsed_s, 2)}
    return entry, over, last_step


def evaluate_and_save(r: Run, entry: dict, logger: Logger, last_step: bool, over: bool) -> bool:
    """α_TF every train.eval_every steps (and at the last): a new best/ when it is the highest so far; the
    periodic checkpoint and summary. True when the time budget ends the run here."""
    t = r.cfg.train
    if r.state.step % t.eval_every == 0 or last_step:
        a = entry["teacher_forced_acceptance"] = r.alpha()
        if a > r.best.get("teacher_forced_acceptance", -1.0):
            if not r.finite():
                raise _diverged(r, f"the weights are not finite after step {r.state.step}")
            r.best = {"step": r.state.step, "teacher_forced_acceptance": a}
            if r.acc.is_main_process:
                ck.save_best(r.out, r.student, r.tok, r.best, r.cfg.student.merge)
    return close_step(r.state, entry, t, r.acc, r.out, logger, lambda step: _save(r, step),
                      lambda done: summary(r, done), r.elapsed, last_step, over)


def summary(r: Run, done: bool) -> dict:
    """summary.json: the run's result, its settings and history."""
    cfg, t, state, best = r.cfg, r.cfg.train, r.state, r.best
    rates = [h["tokens_per_s"] for h in state.history if h.get("tokens_per_s")]
    return {
        "stage": "distill", "dir": str(r.out), "target": cfg.model.target, "done": done,
        "stopped": r.stopped if done else None, "step": state.step, "max_steps": t.max_steps,
        "time_budget_min": t.time_budget_min, "init_teacher_forced_acceptance": state.init_teacher_forced_acceptance,
        "best_step": best.get("step"), "best_teacher_forced_acceptance": best.get("teacher_forced_acceptance"),
        "logit_scale": best.get("logit_scale", 1.0),
        "uncalibrated_best_teacher_forced_acceptance": best.get("uncalibrated_teacher_forced_acceptance",
                                                                best.get("teacher_forced_acceptance")),
        "best_dir": str(r.out / "best"), "train_tokens": state.train_tokens, "elapsed_s": round(state.elapsed_s, 2),
        "tokens_per_s": round(state.train_tokens / state.train_s, 2) if state.train_s else None,
        "data": r.records_key, "holdout_records": len(r.holdout), "holdout_tail_mass": r.ref.tail_mass,
        "train_records": len(r.train_set),
        "settings": {**settings_of(cfg, r.acc.num_processes), "draft_vocab": r.subset.size if r.subset else 0,
                     "world_size": r.acc.num_processes, "peak_tokens_per_s": max(rates) if rates else None},
        "history": state.history,
    }


def finish(r: Run, logger: Logger) -> dict:
    """Calibrate best/ (train.calibrate, full student); write the final summary and plots/distill.png (loss
    and α_TF per step)."""
    acc, t = r.acc, r.cfg.train
    if t.calibrate and "logit_scale" not in r.best and r.cfg.student.kind == "full":
        r.best = _calibrate(r.student, r.alpha, r.best, r.out / "best")
        if acc.is_main_process and "logit_scale" in r.best:  # rewritten even for s = 1: best.json records the fit
            ck.save_best(r.out, r.student, r.tok, r.best, r.cfg.student.merge)
        acc.wait_for_everyone()
    result = summary(r, True)
    if acc.is_main_process:
        ck.write_summary(r.out, result)
        training_curves(result, stage_path(r.cfg, "plots") / f"{r.out.name}.png")  # distill.png, distill@<tag>.png
    logger.finish(result)
    acc.wait_for_everyone()
    log.info("distill: step %d, α_TF %.4f -> best %.4f at step %s (%s) -> %s", r.state.step,
             result["init_teacher_forced_acceptance"], result["best_teacher_forced_acceptance"], result["best_step"],
             r.stopped, r.out)
    return result


def _save(r: Run, step: int) -> None:
    """checkpoint-<step>, after checking every process's weights are finite (never write a non-finite one)."""
    if not r.finite():
        raise _diverged(r, f"the weights are not finite after step {step}")
    st = r.state.trainer_state(r.cfg.train.max_steps, r.global_batch, r.acc.num_processes, r.best, r.out)
    ck.save_checkpoint(r.out, step, r.acc, r.student, r.tok, st, r.cfg.student.merge, r.cfg.train.keep_checkpoints)


def _diverged(r: Run, what: str) -> TrainingDiverged:
    """Set aside what the weights of the current step made (they diverged); the error names the last good
    checkpoint, the one a rerun resumes from."""
    t, bad_step = r.cfg.train, r.state.step
    bad = [p.name for s, p in ck.checkpoints(r.out) if s >= bad_step]
    if r.acc.is_main_process:
        ck.set_aside_diverged(r.out, bad_step)
    r.acc.wait_for_everyone()
    good = ck.checkpoints(r.out)
    aside = f" {', '.join(bad)} came from the weights that diverged: set aside as diverged-*." if bad else ""
    fix = f"lower train.lr (now {t.lr}) or raise train.warmup_steps (now {t.warmup_steps}), then rerun"
    if good:
        return TrainingDiverged(f"{what}; stopped.{aside} The last good checkpoint is {good[-1][1]}; {fix}: "
                                f"resume=auto continues from {good[-1][1].name} with the new train.lr")
    return TrainingDiverged(f"{what}; stopped.{aside} No good checkpoint was saved before it; {fix}: the "
                            "rerun starts from scratch")


def _use_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float) -> None:
    """After loading a checkpoint: schedule train.lr (not the rate saved with it), so that a rerun with a
    lower train.lr after a divergence trains with that rate from the resumed step on."""
    if all(b == lr for b in scheduler.base_lrs):
        return
    log.info("distill: train.lr=%g (the checkpoint was trained with %g): the resumed steps use %g",
             lr, scheduler.base_lrs[0], lr)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


LOGIT_SCALES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0)


def _calibrate(student: torch.nn.Module, alpha: Callable[[], float], best: dict, path) -> dict:
    """Load best/ into the student and scale its logits by the s in LOGIT_SCALES with the highest α_TF on
    the holdout. Forward KL fits q to the average of the p's the draft cannot tell apart, which is not
    the q of most overlap Σ min(p, q) (the default SmolLM2 drafts prefer a sharper q: docs/measurements.md);
    one scalar is cheap to fit on few records. Returns best's info with logit_scale, the α_TF of each
    scale and the α_TF before."""
    ck.load_weights(student, path)
    scale = LogitScale(student)
    if not scale.ok:
        log.info("distill: no logit calibration (the draft has no final norm that scales its logits exactly)")
        return best
    scores = {}
    for s in LOGIT_SCALES:
        scale.set(s)
        scores[s] = alpha()
    s = max(scores, key=lambda k: (scores[k], k == 1.0))
    scale.set(s)
    log.info("distill: logit scale %.2f on best/ (α_TF %.4f -> %.4f on the holdout)", s, scores[1.0], scores[s])
    return {**best, "teacher_forced_acceptance": scores[s], "uncalibrated_teacher_forced_acceptance": scores[1.0],
            "logit_scale": s, "calibration": {str(k): v for k, v in scores.items()}}


def _teacher(target, b: dict, topk: bool):
    if topk:
        return TopKTeacher(b["topk_ids"], b["topk_logits"])
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    return HiddenTeacher(hidden[b["positions"]], target.get_output_embeddings())


@stage_main("distill")
def main(cfg: DictConfig) -> None:
    cli(run, cfg)


if __name__ == "__main__":
    main()
