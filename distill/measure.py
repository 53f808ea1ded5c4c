"""How the evaluate stage measures: reference answers, exact replay, timing, the cost model, intervals.

    from distill.measure import reference_answers, time_decoders, costs_from, modeled_speedup

Three kinds of number, each from the cheapest measurement that is exact (docs/architecture.md,
"Evaluation"):
- greedy α, τ and every counter: exact replay (specdec/replay.py) over every prompt of a set at
  full length, from the target's own greedy answers and one teacher-forced pass of each draft;
- costs (one target step, one verify call, one draft step, prefill per prompt token): decoding a
  small timed subset, warm-up excluded, repeats interleaved so drift hits every decoder alike;
- speedup: measured end to end on the timed subset, and modeled on every prompt from the replayed
  counts and the measured costs (`modeled_speedup`); the two are compared on the timed subset.
Intervals are percentile bootstraps over prompts (specdec.metrics.bootstrap_ci).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from specdec.decoder import DecodeResult, autoregressive_generate
from specdec.features import FeatureTaps
from specdec.metrics import SpecMetrics, bootstrap_ci, teacher_forced_acceptance
from specdec.sampling import SamplingParams, logits_to_probs

FLOAT_TIE_GAP = 1e-4  # docs/architecture.md, "Lossless"
Decode = Callable[..., DecodeResult]  # (batch of prompts, seed, max_new_tokens=None: the decoder's own) -> result
WARMUP_TOKENS = 8  # a warm-up run decodes this many: the first call's one-time costs, not a full answer


# -- the target's own answers ---------------------------------------------------------------------
def reference_answers(target, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                      seed: int, eos: int, pad: int, vocab: int, batch_size: int, bar=None) -> list[list[int]]:
    """The target's answers to every prompt, decoded in batches of similar-length prompts (greedy:
    the answers speculative greedy decoding must reproduce; sampled: contexts for α_TF)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for j in range(0, len(order), batch_size):
        idx = order[j : j + batch_size]
        res = autoregressive_generate(target, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, seed=seed + j, eos_token_id=eos,
                                      pad_token_id=pad, vocab_size=vocab)
        for i, toks in zip(idx, res.tokens):
            out[i] = toks
        if bar is not None:
            bar.update(len(idx))
    return out


class Answers:
    """The target's answers, each distinct prompt decoded once per temperature: a turn-2 set's first
    turns are the turn-1 set's prompts, and the greedy answers serve replay, timing and checks alike."""

    def __init__(self, target, max_new_tokens: int, top_p: float, seed: int, eos: int, pad: int, vocab: int,
                 batch_size: int):
        self.target, self.max_new, self.top_p, self.seed = target, max_new_tokens, top_p, seed
        self.eos, self.pad, self.vocab, self.batch_size = eos, pad, vocab, batch_size
        self._done: dict[tuple[float, tuple[int, ...]], list[int]] = {}

    def __call__(self, prompts: list[list[int]], temperature: float) -> list[list[int]]:
        keys = [(float(temperature), tuple(p)) for p in prompts]
        todo = list(dict.fromkeys(k for k in keys if k not in self._done))
        if todo:
            got = reference_answers(self.target, [list(k[1]) for k in todo], self.max_new, temperature,
                                    self.top_p if temperature else 1.0, self.seed, self.eos, self.pad, self.vocab,
                                    self.batch_size)
            self._done.update(zip(todo, got))
        return [self._done[k] for k in keys]


# -- timing ---------------------------------------------------------------------------------------
@dataclass
class Timed:
    """One decoder's timed runs over the timed subset."""

    walls: list[list[float]]  # [repeat][batch] seconds
    results: list[DecodeResult]  # per batch, from the repeat of median total wall time (its costs' source)
    batches: list[list[int]]  # indices into the timed prompts

    def totals(self) -> list[float]:
        return [sum(w) for w in self.walls]

    def batch_medians(self) -> list[float]:
        return [statistics.median(w[b] for w in self.walls) for b in range(len(self.batches))]

    def tokens(self, n: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(n)]
        for b, res in zip(self.batches, self.results):
            for i, toks in zip(b, res.tokens):
                out[i] = toks
        return out

    def metrics(self, batch_size: int) -> SpecMetrics:
        return SpecMetrics.merge([r.metrics for r in self.results], batch_size)


def time_decoders(decoders: list[Decode], prompts: list[list[int]], batches: list[list[int]], warmup: int,
                  repeats: int, seed: int) -> list[Timed]:
    """Warm each decoder up on the first batch (untimed, WARMUP_TOKENS tokens), then time `repeats` passes
    over every batch, interleaved (repeat r runs every decoder in turn) so drift on a shared machine hits
    all alike. Each decoder keeps the results (counters and timers) of its repeat with the median total
    wall time, the statistic its measured speedup uses, so one slow or fast repeat does not set its costs."""
    for decode in decoders:
        for _ in range(warmup):
            decode([prompts[i] for i in batches[0]], seed, WARMUP_TOKENS)
    out = [Timed([], [], batches) for _ in decoders]
    kept: list[list[list[DecodeResult]]] = [[] for _ in decoders]  # [decoder][repeat] results per batch
    for _ in range(repeats):
        for decode, t, k in zip(decoders, out, kept):
            walls, results = [], []
            for j, b in enumerate(batches):
                t0 = time.perf_counter()
                results.append(decode([prompts[i] for i in b], seed + j))
                walls.append(time.perf_counter() - t0)
            t.walls.append(walls)
            k.append(results)
    for t, k in zip(out, kept):
        order = sorted(range(len(k)), key=lambda r: t.totals()[r])
        t.results = k[order[(len(order) - 1) // 2]] if order else []
    return out


def measured_speedup(base: Timed, spec: Timed) -> dict:
    """Median total wall of the baseline ÷ the decoder's, the spread over repeats, and a bootstrap
    interval over batches (prompts at batch 1) of Σ median baseline wall ÷ Σ median wall."""
    mb, ms = statistics.median(base.totals()), statistics.median(spec.totals())
    return {"speedup": mb / ms, "speedup_spread": [mb / max(spec.totals()), mb / min(spec.totals())],
            "speedup_ci": bootstrap_ci(base.batch_medians(), spec.batch_medians()), "wall_time_s": ms,
            "wall_times_s": spec.totals()}


# -- the cost model -------------------------------------------------------------------------------
@dataclass
class Costs:
    """Seconds per unit, measured on the timed subset (the median repeat's counters and timers). A verify call
    scoring k proposals costs verify_base_s + k · verify_token_s: the line through the target-alone step
    (k = 0) and the speculative run's mean verify call at its mean k, so one timed γ models every γ."""

    target_step_s: float  # one target-alone decoding step
    target_prefill_s: float  # target-alone prefill, per prompt token
    verify_base_s: float  # a verify call with no proposal
    verify_token_s: float  # each proposal a verify call also scores
    draft_step_s: float  # one draft step (a forward pass, or a lookup)
    spec_prefill_s: float  # the speculative run's prefill (target and drafter), per prompt token

    def verify_call_s(self, k: float) -> float:
        return self.verify_base_s + k * self.verify_token_s

    def times(self, prompt_tokens: int, m: SpecMetrics) -> tuple[float, float]:
        """(target alone, speculative) seconds for one prompt whose replay gave the counters m. Only
        forward passes, lookups and prefill are modeled: the decoder's bookkeeping is not, which is
        what the comparison with the measured speedup checks."""
        base = self.target_prefill_s * prompt_tokens + self.target_step_s * m.emitted
        spec = (self.spec_prefill_s * prompt_tokens + self.verify_base_s * m.target_calls
                + self.verify_token_s * m.proposed + self.draft_step_s * m.draft_calls)
        return base, spec


def costs_from(base: SpecMetrics, spec: SpecMetrics, prompt_tokens: int) -> Optional[Costs]:
    """Costs from the timed target-alone and speculative runs over prompts of `prompt_tokens` in all."""
    if not (base.target_calls and spec.target_calls and prompt_tokens):
        return None
    step = base.target_time_s / base.target_calls
    verify = spec.target_time_s / spec.target_calls
    mean_k = spec.proposed / spec.target_calls
    per_token = max(0.0, (verify - step) / mean_k) if mean_k else 0.0
    return Costs(step, base.prefill_time_s / prompt_tokens, verify - per_token * mean_k, per_token,
                 spec.draft_time_s / spec.draft_calls if spec.draft_calls else 0.0, spec.prefill_time_s / prompt_tokens)


def modeled_speedup(costs: Costs, prompt_tokens: Sequence[int], parts: Sequence[SpecMetrics]) -> dict:
    """Σ modeled target-alone time ÷ Σ modeled speculative time over prompts, with a bootstrap interval."""
    times = [costs.times(n, m) for n, m in zip(prompt_tokens, parts)]
    base, spec = [t[0] for t in times], [t[1] for t in times]
    return {"value": sum(base) / sum(spec) if sum(spec) else None, "ci": bootstrap_ci(base, spec)}


# -- correctness ----------------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None or len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def greedy_check(target, prompts: list[list[int]], ids: list[str], reference: list[list[int]],
                 got: list[list[int]], vocab: int) -> tuple[list[dict], list[dict]]:
    """(mismatches, float ties): per prompt, the first position where speculative greedy tokens
    differ from the target's, with the target's top-2 logit gap there (a tie if < FLOAT_TIE_GAP)."""
    bad, ties = [], []
    dev = next(target.parameters()).device
    for p, pid, ref, out in zip(prompts, ids, reference, got):
        j = first_divergence(ref, out)
        if j is None:
            continue
        logits = target(torch.tensor([p + ref[:j]], device=dev)).logits[0, -1, :vocab].float()  # [V]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        item = {"prompt_id": pid, "position": j, "gap": gap,
                "expected": ref[j] if j < len(ref) else None, "got": out[j] if j < len(out) else None}
        (ties if gap < FLOAT_TIE_GAP else bad).append(item)
    return bad, ties


COUNTERS = ("target_calls", "proposed", "accepted", "rejections", "emitted", "tried_at", "accepted_at")


def replay_check(ids: list[str], replayed: list[SpecMetrics], decoded: list[SpecMetrics],
                 tie_prompts: set[str]) -> dict:
    """Replayed counters against decoded ones, prompt by prompt (batch 1): equal, or a float tie
    explains the difference (a near-tie argmax of draft or target on that prompt)."""
    mismatches, ties = [], []
    for pid, r, d in zip(ids, replayed, decoded):
        diff = {k: [getattr(r, k), getattr(d, k)] for k in COUNTERS if getattr(r, k) != getattr(d, k)}
        if diff:
            (ties if pid in tie_prompts else mismatches).append({"prompt_id": pid, "replayed_vs_decoded": diff})
    return {"prompts": len(ids), "equal": not mismatches, "float_ties": ties, "mismatches": mismatches}


# -- α_TF at a temperature ------------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced(target, draft, prompts: list[list[int]], answers: list[list[int]], temperature: float,
                   top_p: float, vocab: int, draft_vocab: Optional[torch.Tensor] = None) -> list[tuple[float, int]]:
    """Per prompt (Σ over answer positions of Σ_x min(p, q), positions): α_TF's parts. With a draft
    vocabulary, q is the draft's distribution over those ids (zero elsewhere), as decoded."""
    dev = next(target.parameters()).device
    params = SamplingParams(temperature, 0, top_p)
    out = []
    for p, resp in zip(prompts, answers):
        if not resp:
            out.append((0.0, 0))
            continue
        ids = torch.tensor([p + resp], device=dev)
        span = slice(len(p) - 1, len(p) - 1 + len(resp))  # positions that predict the response
        tl, dl = target(ids).logits[0, span, :vocab], draft(ids).logits[0, span, :vocab]  # [n, V]
        if draft_vocab is None:
            q = logits_to_probs(dl, params)
        else:
            sub = draft_vocab.to(dl.device)
            q = torch.zeros_like(dl).index_copy_(1, sub, logits_to_probs(dl[:, sub], params))  # [n, V]
        out.append((teacher_forced_acceptance(logits_to_probs(tl, params), q) * len(resp), len(resp)))
    return out


@torch.inference_mode()
def head_teacher_forced(target, head, prompts: list[list[int]], answers: list[list[int]], temperature: float,
                        top_p: float, vocab: int) -> list[tuple[float, int]]:
    """teacher_forced for a feature head: q is its first proposal's distribution at every answer
    position (the pair (f_{t-2}, x_{t-1}) predicts x_t), over its draft vocabulary, zero elsewhere.
    A one-token prompt's first answer token has no target feature to read and is left out."""
    dev = next(target.parameters()).device
    params = SamplingParams(temperature, 0, top_p)
    ids_of = head.vocab_ids.to(dev)
    out = []
    for p, resp in zip(prompts, answers):
        lo = max(len(p), 2)  # first scored position: it needs the pair at lo - 2
        if len(p) + len(resp) <= lo:
            out.append((0.0, 0))
            continue
        ids = torch.tensor([p + resp], device=dev)
        with FeatureTaps(target, head.feature_layers) as taps:
            tl = target(ids).logits[0, lo - 1 : -1, :vocab]  # [n, V]: predicts positions lo..end
            feats = taps.take().to(head.fc.weight.dtype)
        g = head.unroll(feats[:, : -2], ids[:, 1:-1], 1)[0][0, lo - 2 :]  # pairs lo-2..; [n, H]
        ql = head.logits(g).float()
        q = torch.zeros(ql.shape[0], vocab, device=dev).index_copy_(1, ids_of, logits_to_probs(ql, params))
        n = tl.shape[0]
        out.append((teacher_forced_acceptance(logits_to_probs(tl.float(), params), q) * n, n))
    return out
