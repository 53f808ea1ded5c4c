"""Speculative decoding (draft -> verify) with KV caches for both models, and the target-alone baseline.

    from specdec import SpeculativeDecoder, ModelDrafter, autoregressive_generate
    dec = SpeculativeDecoder(target, ModelDrafter(draft), gamma=4)
    out = dec.generate([[1, 2, 3], [4, 5]], max_new_tokens=64)           # greedy, ragged batch
    out = dec.generate(ids, max_new_tokens=64, temperature=1.0, seed=0)  # lossless sampling
    out.tokens[0], out.finish_reasons[0], out.metrics.to_dict()
    base = autoregressive_generate(target, ids, max_new_tokens=64)       # the speed baseline

One round, for every active row at once:
  1. the drafter proposes k = min(γ, budget left − 1) tokens (its cache sees each token once);
  2. the target scores [last token, k proposals] in ONE forward pass -> k+1 distributions;
  3. greedy: keep the prefix equal to the target's argmax, then the target's argmax;
     sampling: keep x_j with probability min(1, p/q), resample the first rejected one from
     normalize(max(p − q, 0)), or draw a bonus token from p after full acceptance;
  4. both caches forget the rejected tokens (crop, or a masked hole for rows that accepted fewer
     than another row; see kv.py), rows that hit a stop token or the budget leave the batch.
Prompts are encoded once (all but their last token, which opens round one); the prefix is never
re-encoded. The draft and target timings per forward call give the cost ratio c.

Why one module of this size: the round, the target-alone baseline and the γ policy share the caches
and the counters; split, each would pass both around.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .drafters import Drafter, ModelDrafter
from .features import FeatureTaps
from .kv import KVModel, logits_width, model_device
from .metrics import SpecMetrics
from .sampling import (
    SamplingParams,
    acceptance_probs,
    draw_uniforms,
    greedy_verify,
    logits_to_probs,
    rejection_sample,
    sample,
)

GAMMA_POLICIES = ("constant", "adaptive")


@dataclass
class DecodeResult:
    """New tokens per row (a stop token, when hit, is the last one), why each row stopped, metrics."""

    tokens: list[list[int]]
    finish_reasons: list[str]  # "eos" | "length"
    metrics: SpecMetrics = field(default_factory=SpecMetrics)


class GammaPolicy:
    """γ per round. constant: always γ. adaptive: γ+1 after a round where every row accepted every
    proposal, γ−1 after a round whose rows accepted fewer than half on average, kept in
    [gamma_min, gamma_max]."""

    def __init__(self, gamma: int, policy: str = "constant", gamma_min: int = 1, gamma_max: int | None = None):
        gamma_max = gamma if policy == "constant" and gamma_max is None else gamma_max or 2 * gamma
        if policy not in GAMMA_POLICIES:
            raise ValueError(f"gamma_policy must be one of {GAMMA_POLICIES} (got {policy!r})")
        if not isinstance(gamma, int) or gamma < 1:
            raise ValueError(
                f"gamma must be an integer >= 1 (got {gamma!r}); for decoding without a draft use autoregressive_generate"
            )
        if not 1 <= gamma_min <= gamma <= gamma_max:
            raise ValueError(f"need 1 <= gamma_min <= gamma <= gamma_max (got {gamma_min}, {gamma}, {gamma_max})")
        self.gamma, self.policy, self.gamma_min, self.gamma_max = gamma, policy, gamma_min, gamma_max

    def update(self, k: int, n_accepted: Sequence[int]) -> None:
        if self.policy != "adaptive" or k < self.gamma or not n_accepted:
            return  # rounds shortened by the budget say nothing about the draft
        if all(n == k for n in n_accepted):
            self.gamma = min(self.gamma + 1, self.gamma_max)
        elif sum(n_accepted) < 0.5 * k * len(n_accepted):
            self.gamma = max(self.gamma - 1, self.gamma_min)


# -- input and bookkeeping helpers ---------------------------------------------------------------
def left_pad(
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | None,
    pad_token_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prompts (lists, or a tensor with any padding mask) -> left-padded ids [B, S], mask [B, S]."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids[None] if input_ids.dim() == 1 else input_ids
        m = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.reshape(ids.shape)
        rows = [[t for t, keep in zip(r, mr) if keep] for r, mr in zip(ids.tolist(), m.bool().tolist())]
    else:
        rows = [list(r) for r in input_ids]
        if rows and not isinstance(input_ids[0], (list, tuple, torch.Tensor)):
            rows = [[int(t) for t in input_ids]]  # a single prompt given as a flat list
    if not rows:
        raise ValueError("no prompts given: pass a list of token-id lists or a [B, S] tensor")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} is empty: every row needs at least one token (e.g. BOS or a chat template)")
    S = max(len(r) for r in rows)
    ids = torch.tensor([[pad_token_id] * (S - len(r)) + [int(t) for t in r] for r in rows], dtype=torch.long)
    mask = torch.tensor([[False] * (S - len(r)) + [True] * len(r) for r in rows], dtype=torch.bool)
    return ids.to(device), mask.to(device)


def _as_id_set(*ids) -> set[int]:
    out: set[int] = set()
    for x in ids:
        if x is None:
            continue
        out.update([int(x)] if isinstance(x, int) else (int(t) for t in x))
    return out


def _default_eos(model: torch.nn.Module):
    gen = getattr(model, "generation_config", None)
    return getattr(gen, "eos_token_id", None) if gen is not None else getattr(model.config, "eos_token_id", None)


def _default_pad(model: torch.nn.Module, eos: set[int]) -> int:
    for src in (getattr(model, "generation_config", None), model.config):
        pad = getattr(src, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return min(eos) if eos else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _emit(out: list[int], tokens: list[int], stop: set[int], max_new: int) -> tuple[int, str | None]:
    """Append a block of new tokens to one row: up to and including a stop token, within the budget.
    Returns (tokens kept, finish reason or None)."""
    room = max_new - len(out)
    for j, t in enumerate(tokens[:room]):
        if t in stop:
            out.extend(tokens[: j + 1])
            return j + 1, "eos"
    kept = min(len(tokens), room)
    out.extend(tokens[:kept])
    return kept, ("length" if len(out) >= max_new else None)


def _check_common(max_new_tokens: int, vocab: int, ids: torch.Tensor) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab}); is the prompt from this model's tokenizer?")


# -- target alone -------------------------------------------------------------------------------
@torch.inference_mode()
def autoregressive_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    pad_token_id: int | None = None,
    vocab_size: int | None = None,
    fast: str | bool = "auto",
) -> DecodeResult:
    """Plain KV-cached decoding with the model alone, one token per forward call: the speed baseline
    and the measurement of one target step (metrics.target_step_s). Same conventions as
    SpeculativeDecoder.generate (eos_token_id None = the model's own); fast: KVModel's."""
    params = SamplingParams(temperature, top_k, top_p)
    device = model_device(model)
    stop = _as_id_set(_default_eos(model) if eos_token_id is None else eos_token_id, stop_token_ids)
    pad = _default_pad(model, stop) if pad_token_id is None else pad_token_id
    ids, mask = left_pad(input_ids, attention_mask, pad, device)
    kv = KVModel(model, vocab_size, fast)
    _check_common(max_new_tokens, kv.vocab_size, ids)
    B = ids.shape[0]
    metrics = SpecMetrics(batch_size=B, temperature=temperature, top_k=top_k, top_p=top_p)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(B)]
    reasons: list[str] = [""] * B
    _sync(device)
    t_start = time.perf_counter()
    kv.prefill(ids[:, :-1], mask[:, :-1])
    cur = ids[:, -1]  # [B]
    _sync(device)
    metrics.prefill_time_s = time.perf_counter() - t_start
    active = list(range(B))
    while active:
        t0 = time.perf_counter()
        logits = kv.step(cur[:, None], keep=1)[:, 0]  # [B, V]
        nxt = logits.argmax(-1) if params.greedy else sample(logits_to_probs(logits, params), gen)  # [B]
        host = nxt.tolist()
        metrics.target_time_s += time.perf_counter() - t0
        metrics.target_calls += 1
        still = []
        for i, b in enumerate(active):
            kept, reason = _emit(out[b], host[i : i + 1], stop, max_new_tokens)
            metrics.record(0, 0, False, kept)
            if reason:
                reasons[b] = reason
            else:
                still.append(i)
        if len(still) < len(active):
            if still:
                kv.select_rows(torch.tensor(still, device=device))
            active = [active[i] for i in still]
            nxt = nxt[still]
        cur = nxt
    _sync(device)
    metrics.wall_time_s = time.perf_counter() - t_start
    return DecodeResult(out, reasons, metrics)


# -- verification ------------------------------------------------------------------------------
def verify(
    target: KVModel, block: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
    params: SamplingParams, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over block [B, k+1] = [last token, k proposals] -> (n_accepted [B], next [B])."""
    k = draft.shape[1]
    logits = target.step(block, keep=k + 1)  # [B, k+1, V]
    if params.greedy:
        return greedy_verify(draft, logits)
    return rejection_sample(draft, q, logits_to_probs(logits, params), gen)


def verify_lazy_head(
    target: KVModel, block: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
    params: SamplingParams, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify() with the LM head applied position by position, only to rows still accepting.

    The head of a large-vocabulary model costs as much as several transformer layers on a CPU; a
    row that rejects draft token j never needs positions after j. Positions left uncomputed stay
    zero and are never read by greedy_verify / rejection_sample (they lie after the row's first
    rejection), and the random draws are made in the same order, so the result equals verify()'s.
    Each position costs one host sync: for CPUs, where syncs are free.
    """
    B, k = draft.shape
    hidden = target.step_hidden(block)  # [B, k+1, H]
    scores = None  # [B, k+1, V]: logits (greedy) or probabilities (sampling), filled lazily
    probs_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # logits_to_probs' output
    u = None if params.greedy else draw_uniforms(draft, gen, probs_dtype)  # [B, k]
    alive = torch.arange(B, device=hidden.device)  # rows that accepted every position so far
    for j in range(k + 1):
        logits = target.head(hidden[alive, j])  # [b, V]
        s_j = logits if params.greedy else logits_to_probs(logits, params)
        if scores is None:
            scores = s_j.new_zeros(B, k + 1, s_j.shape[-1])
        scores[alive, j] = s_j
        if j == k:
            break
        if params.greedy:
            ok = s_j.argmax(-1) == draft[alive, j]  # [b]
        else:
            q_j = None if q is None else q[alive, j : j + 1]
            ok = u[alive, j] < acceptance_probs(draft[alive, j : j + 1], q_j, s_j[:, None])[:, 0]
        alive = alive[ok]
        if alive.numel() == 0:
            break
    if params.greedy:
        return greedy_verify(draft, scores)
    return rejection_sample(draft, q, scores, gen, uniforms=u)


# -- speculative ---------------------------------------------------------------------------------
class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``drafter``.

    drafter: a Drafter, or a causal LM (wrapped in ModelDrafter). gamma: draft tokens per round
    (the start value under gamma_policy="adaptive"). eos_token_id: stop token(s); None = the
    target's own. vocab_size: compare only the first vocab_size logits (needed when target and
    draft logits have different widths, e.g. padded embedding rows: pass len(tokenizer)).
    lazy_head: apply the target's LM head only to positions up to each row's first rejection
    (verify_lazy_head), for models whose logits are exactly head(body(x)). Off by default: with the
    small-rows kernels (specdec.small_rows), one head pass over all γ+1 positions costs about as much as
    a single per-position pass on CPU (docs/measurements.md, "The lazy LM head"). fast: the target's
    KVModel option ("auto": the CPU fast paths where they apply; False: none).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: Drafter | torch.nn.Module,
        gamma: int = 4,
        gamma_policy: str = "constant",
        gamma_min: int = 1,
        gamma_max: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
        lazy_head: bool | None = None,
        fast: str | bool = "auto",
    ):
        self.target, self.fast = target, fast
        self.lazy_head = lazy_head
        self._lazy: bool | None = None
        self.drafter = drafter if isinstance(drafter, Drafter) else ModelDrafter(drafter)
        GammaPolicy(gamma, gamma_policy, gamma_min, gamma_max)  # validate now, not at generate()
        self.gamma, self.gamma_policy, self.gamma_min, self.gamma_max = gamma, gamma_policy, gamma_min, gamma_max
        self.eos = _as_id_set(_default_eos(target) if eos_token_id is None else eos_token_id)
        self.pad_token_id = _default_pad(target, self.eos) if pad_token_id is None else pad_token_id
        self.device = model_device(target)
        t_width, d_width = logits_width(target), self.drafter.vocab_width
        if vocab_size is None:
            if d_width is not None and d_width != t_width:
                raise ValueError(
                    f"target logits have {t_width} columns but the draft's have {d_width}: if both use the "
                    "same tokenizer (check it), pass vocab_size=len(tokenizer) to compare only real tokens"
                )
            vocab_size = t_width
        if not 1 <= vocab_size <= min(t_width, d_width or t_width):
            raise ValueError(
                f"vocab_size={vocab_size} must be in [1, {min(t_width, d_width or t_width)}] (the narrower "
                "model's logit width); pass len(tokenizer)"
            )
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> DecodeResult:
        """Decode up to max_new_tokens per row. input_ids: ragged lists of ids, or [B, S] with an
        optional attention_mask (any padding side). Greedy output equals the target's own greedy
        output; sampled output has the target's distribution (same temperature/top_k/top_p)."""
        # a feature drafter (HeadDrafter) reads the target's hidden states at its layers, recorded while it runs
        taps = FeatureTaps(self.target, self.drafter.feature_layers) if self.drafter.feature_layers else None
        try:
            return self._generate(taps, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed,
                                  stop_token_ids)
        finally:
            if taps is not None:
                taps.close()

    def _generate(self, taps, input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, seed,
                  stop_token_ids) -> DecodeResult:
        params = SamplingParams(temperature, top_k, top_p)
        policy = GammaPolicy(self.gamma, self.gamma_policy, self.gamma_min, self.gamma_max)
        stop = self.eos | _as_id_set(stop_token_ids)
        device, drafter = self.device, self.drafter
        ids, mask = left_pad(input_ids, attention_mask, self.pad_token_id, device)
        _check_common(max_new_tokens, self.vocab_size, ids)
        B = ids.shape[0]
        metrics = SpecMetrics(
            batch_size=B, gamma=self.gamma, gamma_policy=self.gamma_policy, temperature=temperature,
            top_k=top_k, top_p=top_p, draft_sampled=drafter.samples and not params.greedy,
        )
        gen = torch.Generator(device=device).manual_seed(seed)
        target = KVModel(self.target, self.vocab_size, self.fast)
        if self._lazy is None:  # decided once: asked for and the model passes the check
            self._lazy = bool(self.lazy_head and target.lazy_head_ok)
        verify_fn = verify_lazy_head if self._lazy else verify
        out: list[list[int]] = [[] for _ in range(B)]
        reasons: list[str] = [""] * B

        _sync(device)
        t_start = time.perf_counter()
        target.prefill(ids[:, :-1], mask[:, :-1])  # the last prompt token opens round one
        drafter.begin(ids[:, :-1], mask[:, :-1], self.vocab_size)
        if taps is not None:
            drafter.observe(taps.take() if ids.shape[1] > 1 else None)
        cur = ids[:, -1]  # [B] last token, not yet in either cache
        _sync(device)
        metrics.prefill_time_s = time.perf_counter() - t_start

        active = list(range(B))  # original row of each batch row
        while active:
            k = min(policy.gamma, max(max_new_tokens - len(out[b]) for b in active) - 1)
            t0 = time.perf_counter()
            if k > 0:
                draft, q = drafter.propose(cur, k, params, gen)  # [B, k'], [B, k', V] | None
                _sync(device)
            else:  # one token left: a plain target step
                draft, q = cur.new_zeros(len(active), 0), None
            k = draft.shape[1]
            t1 = time.perf_counter()
            n, nxt = verify_fn(target, torch.cat([cur[:, None], draft], dim=1), draft, q, params, gen)  # [B], [B]
            if taps is not None:
                drafter.observe(taps.take())  # [B, k+1, n·H]: the verified block's features
            block = torch.cat([draft, nxt[:, None]], dim=1).scatter(1, n[:, None], nxt[:, None])  # [B, k+1]
            host = torch.cat([n[:, None], block], dim=1).tolist()  # the round's one host sync
            t2 = time.perf_counter()
            metrics.draft_time_s += t1 - t0
            metrics.target_time_s += t2 - t1
            metrics.target_calls += 1
            metrics.draft_calls += k  # draft steps: forward passes of a model drafter, lookups otherwise

            n_host, still = [], []
            for i, b in enumerate(active):
                n_i = host[i][0]
                n_host.append(n_i)
                kept, reason = _emit(out[b], host[i][1 : n_i + 2], stop, max_new_tokens)
                metrics.record(k, min(n_i, kept), n_i < k and kept == n_i + 1, kept)
                if reason:
                    reasons[b] = reason
                else:
                    still.append(i)
            if not still:
                break
            target.rollback(k + 1, n + 1, [x + 1 for x in n_host])  # keep [last token, accepted]
            if k > 0:
                drafter.rollback(n, n_host)
            if len(still) < len(active):
                target.select_rows(torch.tensor(still, device=device))
                drafter.select_rows(still)
                active = [active[i] for i in still]
                nxt = nxt[still]
            policy.update(k, n_host)
            cur = nxt

        _sync(device)
        metrics.wall_time_s = time.perf_counter() - t_start
        return DecodeResult(out, reasons, metrics)
