"""The distill stage for student=head: train an EAGLE-3 style feature head (specdec.heads) on the target's answers.

    python -m distill.distill model=tiny experiment=smoke student=head run_name=try   # after distill.generate
    python -m distill.distill student=head model.draft_vocab=8192 train.time_budget_min=10

distill.distill.run hands over here when student.kind=head; the stage's files are the same (see
distill/checkpoint.py): checkpoint-<step>/ and best/ are head directories in the EAGLE-3 layout (plus the
tokenizer, trainer_state.json and accelerate/), summary.json has the same keys.

The target stays in memory: every micro-batch of generated records (distill/batches.py's padding and
positions) runs through it once, which yields the features the head reads (FeatureTaps) and, with
train.teacher=online, its distribution p at every response position (train.teacher=topk reads the stored
top-k logits instead). The head is unrolled head.ttt_steps = K steps (training-time test, FeatureHead.unroll):
step j at pair t (features of position t, token t+1) predicts token t+j+1, and the configured loss
(loss.*, distill/losses.py) against p at that position is summed over every step and response position,
then divided by the global batch's response tokens. q is the head's softmax over its draft vocabulary
(model.draft_vocab; the whole vocabulary when 0), p restricted to it, as in the standalone trainer.

α_TF of the head's first proposal (Σ min(p, q) over held-out response positions) picks best/, as for
standalone drafts; its greedy agreement (argmax q = argmax p) is logged beside it.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from distill import checkpoint as ck
from distill.batches import Reference, collate, holdout_reference, split_holdout, to_examples
from distill.config import ConfigError, stage_path
from distill.losses import SINK, HiddenTeacher, TopKTeacher, VocabSubset, chunked_distill_loss, chunked_overlap, gather_teacher
from distill.models import load_target, shared_vocab_size
from distill.plots import training_curves
from distill.records import run_draft_vocab
from distill.training import (
    Logger, TrainingDiverged, TrainState, apply_step, check_generated, close_step, global_batch, open_stage, resume_point,
    schedule, settings_of,
)
from specdec.features import FeatureTaps
from specdec.heads import FeatureHead

log = logging.getLogger(__name__)


def subset_logits(head: FeatureHead):
    """[*, H] -> [*, S + 1]: the head's logits over its draft vocabulary plus VocabSubset's sink column."""

    def fn(h: torch.Tensor) -> torch.Tensor:
        z = head.logits(h)
        return torch.cat([z, z.new_full((*z.shape[:-1], 1), SINK)], dim=-1)

    return fn


class HeadLoss(torch.nn.Module):
    """The head plus its TTT loss, one module for accelerate: batch -> loss sum over steps and positions."""

    def __init__(self, head: FeatureHead, loss_cfg: Any, subset: VocabSubset, steps: int):
        super().__init__()
        self.head, self.lc, self.subset, self.steps = head, loss_cfg, subset, steps

    def forward(self, feats, input_ids, attention_mask, positions, labels, teacher):
        L = input_ids.shape[1]
        ids = input_ids[:, 1:]
        # step j's token at pair t is x_{t+j} (the target's own tokens: those accepted in a greedy round)
        nxt = lambda j, g: torch.nn.functional.pad(input_ids[:, j:], (0, j - 1))  # noqa: E731
        steps = self.head.unroll(feats[:, :-1], ids, min(self.steps, L - 1), nxt, attention_mask[:, 1:].bool())
        cols = positions.nonzero()[:, 1]  # column of each teacher row (row-major)
        lc, head_fn, total = self.lc, subset_logits(self.head), feats.new_zeros(())
        for j, g in enumerate(steps, start=1):
            pos = positions[:, j:]  # [B, L-j]: step j at pair t stands for column t + j's distribution
            tch, keep = self.subset.restrict(gather_teacher(teacher, cols >= j))
            if keep is not None and not bool(keep.all()):  # top-k rows wholly outside the draft vocabulary
                pos = pos.clone()
                pos[pos.clone()] = keep
                tch = gather_teacher(tch, keep)
            s, _ = chunked_distill_loss(g[:, : L - j], head_fn, pos, tch, lc.name, lc.beta, lc.temperature,
                                        self.subset.labels(labels[:, j:]), lc.ce_weight, lc.chunk_size,
                                        self.subset.size + 1)
            total = total + s
        return total


@torch.no_grad()
def target_pass(target, taps: FeatureTaps, b: dict, topk: bool):
    """One target forward over a collated batch -> (features [B, L, n·H], teacher over its positions)."""
    hidden = target.get_decoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    feats = taps.take()
    if topk:
        return feats, TopKTeacher(b["topk_ids"], b["topk_logits"])
    return feats, HiddenTeacher(hidden[b["positions"]], target.get_output_embeddings())


@torch.no_grad()
def measure_head(head: FeatureHead, ref: Reference, feats: list[torch.Tensor], subset: VocabSubset,
                 chunk_size: int = 512) -> tuple[float, float, float]:
    """(Σ min(p, q), greedy agreements, positions) of the head's first proposal over held-out positions."""
    was = head.training
    head.eval()
    tf = agree = den = 0.0
    fn = subset_logits(head)
    for b, teacher, f in zip(ref.batches, ref.teachers, feats):
        pos = b["positions"][:, 1:]  # step 1 at pair t: column t + 1's distribution
        g = head.unroll(f[:, :-1], b["input_ids"][:, 1:], 1, valid=b["attention_mask"][:, 1:].bool())[0]
        keep = b["positions"].nonzero()[:, 1] >= 1
        p = gather_teacher(teacher, keep)
        s, c = chunked_overlap(g.float(), fn, pos, subset.restrict(p)[0], chunk_size, subset.size + 1)
        picks = head.vocab_ids[head.logits(g[pos]).argmax(-1)]
        agree += float((picks == p.ids[:, 0].long()).sum())
        tf, den = tf + float(s), den + float(c)
    head.train(was)
    return tf, agree, den


def run(cfg: DictConfig, stage: str = "distill") -> dict:
    """Train (or finish training) the feature head of runs/<run> into runs/<run>/<stage>; returns the summary
    (also <stage>/summary.json)."""
    out, acc, records_key, finished = open_stage(cfg, stage)
    if finished:
        return finished
    t, lc, hc = cfg.train, cfg.loss, cfg.head
    target, tok = load_target(OmegaConf.merge(cfg.model, {"device": str(acc.device)}))
    target.requires_grad_(False)
    records = check_generated(cfg, tok)
    vocab = shared_vocab_size(tok, target)
    train_set, holdout = split_holdout(to_examples(records, t.max_seq_len, t.teacher == "topk"), t.holdout, cfg.seed)
    if not train_set:
        raise ConfigError(f"all {len(holdout)} generated records are held out; generate more or lower train.holdout")
    ids = run_draft_vocab(cfg, vocab)
    try:
        head = FeatureHead.from_target(target, None if hc.layers is None else list(hc.layers), hc.num_layers,
                                       ids if ids is not None else torch.arange(vocab))
    except ValueError as err:
        raise ConfigError(f"head.layers / head.num_layers: {err}") from None
    subset = VocabSubset(head.vocab_ids, vocab)
    head.train()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=hc.lr,
                                  weight_decay=t.weight_decay, fused=acc.device.type in ("cpu", "cuda"))
    state = TrainState()
    scheduler = schedule(optimizer, t, lambda: state.elapsed_s)
    model, optimizer = acc.prepare(HeadLoss(head, lc, subset, hc.ttt_steps), optimizer)
    acc.register_for_checkpointing(scheduler)
    rank, world = acc.process_index, acc.num_processes
    taps = FeatureTaps(target, head.feature_layers)
    micro = holdout[rank::world]
    ref = holdout_reference(target, micro, t.batch_size, vocab, acc.device, lc.chunk_size)
    ref_feats = [target_pass(target, taps, b, False)[0] for b in ref.batches]

    def alpha() -> tuple[float, float]:
        tf, agree, den = measure_head(head, ref, ref_feats, subset, lc.chunk_size)
        tot = acc.reduce(torch.tensor([tf, agree, den], dtype=torch.float64, device=acc.device), "sum")
        return (float(tot[0] / tot[2]), float(tot[1] / tot[2])) if tot[2] > 0 else (math.nan, math.nan)

    if t.resume == "auto" and ck.checkpoints(out):
        path, saved = resume_point(out, acc, head)
        state.__dict__.update(saved.__dict__)  # in place: the schedule reads state
        log.info("distill: resuming the head from %s (step %d)", path, state.step)
    best = ck.best_info(out) or {}

    def consider(step: int, tf: float, agree: float) -> None:
        nonlocal best
        if tf > best.get("teacher_forced_acceptance", -1.0):
            best = {"step": step, "teacher_forced_acceptance": tf, "greedy_agreement": agree}
            if acc.is_main_process:
                ck.save_best(out, head, tok, best)

    if state.step == 0:
        a0, g0 = alpha()
        state.init_teacher_forced_acceptance = a0
        state.history = [{"step": 0, "loss": None, "teacher_forced_acceptance": a0, "greedy_agreement": g0}]
        consider(0, a0, g0)

    G = t.batch_size * world * t.grad_accum
    logger = Logger(cfg, out, acc.is_main_process)
    if state.step == 0:
        logger.log(state.history[0])  # the untrained head's α_TF
    budget_s = t.time_budget_min * 60 if t.time_budget_min else math.inf
    bar = tqdm(total=t.max_steps, initial=state.step, unit="step", desc="distill (head)", disable=not acc.is_main_process)
    stopped = "max_steps"

    def save(step: int) -> None:
        ck.save_checkpoint(out, step, acc, head, tok, state.trainer_state(t.max_steps, G, world, best, out),
                           keep=t.keep_checkpoints)

    def summarize(done: bool) -> dict:
        return {
            "stage": stage, "student": "head", "dir": str(out), "done": done, "stopped": stopped if done else None,
            "step": state.step, "max_steps": t.max_steps, "time_budget_min": t.time_budget_min,
            "init_teacher_forced_acceptance": state.init_teacher_forced_acceptance,
            "best_step": best.get("step"), "best_teacher_forced_acceptance": best.get("teacher_forced_acceptance"),
            "best_greedy_agreement": best.get("greedy_agreement"), "logit_scale": 1.0,
            "uncalibrated_best_teacher_forced_acceptance": best.get("teacher_forced_acceptance"),
            "best_dir": str(out / "best"), "train_tokens": state.train_tokens, "elapsed_s": round(state.elapsed_s, 2),
            "tokens_per_s": round(state.train_tokens / state.train_s, 2) if state.train_s else None,
            "data": records_key, "holdout_records": len(holdout), "holdout_tail_mass": ref.tail_mass,
            "train_records": len(train_set),
            "settings": {**settings_of(cfg, world), "head": {**OmegaConf.to_container(hc), "layers": list(head.feature_layers)},
                         "draft_vocab": subset.size, "world_size": world},
            "history": state.history,
        }

    wall0, elapsed0 = time.perf_counter(), state.elapsed_s
    elapsed = lambda: elapsed0 + time.perf_counter() - wall0  # noqa: E731 (wall time, resumed runs included)
    while state.step < t.max_steps:
        step = state.step
        t0 = time.perf_counter()
        batch_ids = global_batch(len(train_set), step, G, cfg.seed)
        micro_batches = [[train_set[i] for i in batch_ids[(a * world + rank) * t.batch_size:][: t.batch_size]]
                         for a in range(t.grad_accum)]
        local_n = sum(len(e.response_ids) for exs in micro_batches for e in exs)
        count = float(acc.reduce(torch.tensor(float(local_n), device=acc.device), "sum"))
        loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        for a, exs in enumerate(micro_batches):
            b = collate(exs, tok.pad_token_id, acc.device, with_topk=t.teacher == "topk")
            feats, teacher = target_pass(target, taps, b, t.teacher == "topk")
            sync = a == len(micro_batches) - 1
            with (contextlib.nullcontext() if sync else acc.no_sync(model)), acc.autocast():
                total = model(feats, b["input_ids"], b["attention_mask"], b["positions"], b["labels"], teacher)
                acc.backward(total * (world / max(count, 1.0)))
            loss_sum += total.detach().double()
        loss = float(acc.reduce(loss_sum, "sum")) / max(count, 1.0)
        if not math.isfinite(loss):
            last = ck.checkpoints(out)
            raise TrainingDiverged(f"loss is {loss} at step {step + 1}; stopped. The last good checkpoint is "
                                   f"{last[-1][1] if last else 'none'}; lower head.lr (now {hc.lr}), then rerun")
        apply_step(acc, model, optimizer, scheduler, t.max_grad_norm)
        dt = time.perf_counter() - t0
        over, last_step = state.book(acc, t, G, dt, count, elapsed(), budget_s)
        entry = {"step": state.step, "loss": loss, "lr": scheduler.get_last_lr()[0], "tokens_per_s": count / dt,
                 "elapsed_s": round(state.elapsed_s, 2)}
        if state.step % t.eval_every == 0 or last_step:
            tf, agree = alpha()
            entry.update(teacher_forced_acceptance=tf, greedy_agreement=agree)
            consider(state.step, tf, agree)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", alpha_tf=f"{entry.get('teacher_forced_acceptance', math.nan):.3f}")
        if close_step(state, entry, t, acc, out, logger, save, summarize, elapsed, last_step, over):
            stopped = "time_budget"
            break
    bar.close()
    taps.close()
    result = summarize(True)
    if acc.is_main_process:
        ck.write_summary(out, result)
        training_curves(result, stage_path(cfg, "plots") / f"{out.name}.png")
    logger.finish(result)
    acc.wait_for_everyone()
    log.info("distill: head step %d, α_TF %.4f -> best %.4f (greedy agreement %.3f) at step %s (%s) -> %s",
             state.step, result["init_teacher_forced_acceptance"], result["best_teacher_forced_acceptance"],
             result["best_greedy_agreement"] or math.nan, result["best_step"], stopped, out)
    return result

