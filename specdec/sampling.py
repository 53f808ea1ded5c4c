"""Logits -> probabilities, and the speculative acceptance test, as pure tensor functions.

    from specdec.sampling import SamplingParams, logits_to_probs, rejection_sample
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    p = logits_to_probs(target_logits, params)            # [B, k+1, V]
    q = logits_to_probs(draft_logits, params)             # [B, k, V], the same transform as p
    n_accepted, next_token = rejection_sample(draft_tokens, q, p, generator)

The acceptance rule is the one of Leviathan et al. (2023) and Chen et al. (2023): draft token x_j is
kept with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the replacement is drawn
from normalize(max(p_j - q_j, 0)); if all k are kept, a bonus token is drawn from p_{k+1}. The
emitted tokens are then distributed exactly as if the target had sampled them one by one.

Every random draw takes an explicit ``torch.Generator``, so a run is a function of its seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are formed; applied identically to the target (p) and draft (q)."""

    temperature: float = 0.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p; 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}); use 0 to switch top-k off")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); use 1.0 to switch top-p off")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _as_float(logits: torch.Tensor) -> torch.Tensor:
    # Half-precision softmax loses the small probabilities the acceptance test divides by.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set every logit below the k-th largest to -inf (ties with the k-th are kept). [..., V] -> [..., V]."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their mass reaches top_p (at least one).

    Same rule as Hugging Face's TopPLogitsWarper, so plain sampling here and there agree:
    sorted ascending, a token is dropped while the mass at or below it is <= 1 - top_p.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending, [..., V]
    mass_below = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
    drop = mass_below <= 1 - top_p
    drop[..., -1] = False  # the most likely token always stays
    drop = torch.zeros_like(drop).scatter(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (Hugging Face's order), then softmax. [..., V] -> [..., V].

    Greedy params give the one-hot distribution of the argmax, so greedy is a limit case of sampling.
    """
    logits = _as_float(logits)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    if params.temperature != 1:
        logits = logits / params.temperature
    logits = filter_top_p(filter_top_k(logits, params.top_k), params.top_p)
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from ``probs`` [..., V] (need not sum to 1) -> token ids [...].

    Inverse CDF: one uniform per row against the running sum, taken in float64 so that rounding
    cannot move mass between tokens; a token of probability 0 is never drawn. Needs no host sync,
    and one random number per row rather than one per token (the cost of an exponential race).
    """
    wide = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = probs.to(wide).cumsum(dim=-1)  # [..., V]
    total = cdf[..., -1:].contiguous()  # [..., 1]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=wide) * total
    # first index whose running sum exceeds u; u == total (rounding) -> the last token with mass
    idx = torch.minimum(torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total))
    return idx[..., 0]


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the longest prefix where the draft equals the target's argmax.

    draft_tokens [B, k]; target_logits [B, k+1, V] (position j scores the token after draft token j).
    Returns n_accepted [B] in 0..k and next_token [B]: the target's argmax after the accepted prefix
    (the correction at the first mismatch, or the bonus token after full acceptance).
    """
    k = draft_tokens.shape[1]
    best = target_logits.argmax(dim=-1)  # [B, k+1]
    match = (draft_tokens == best[:, :k]).long()  # [B, k]
    n_accepted = match.cumprod(dim=1).sum(dim=1)  # [B]
    next_token = best.gather(1, n_accepted[:, None])[:, 0]  # [B]
    return n_accepted, next_token


def _gather_token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [B, k, V], tokens [B, k] -> probs[b, j, tokens[b, j]] [B, k]."""
    return probs.gather(-1, tokens[..., None])[..., 0]


def acceptance_probs(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor
) -> torch.Tensor:
    """min(1, p_j(x_j) / q_j(x_j)) for each draft token. -> [B, k].

    draft_tokens [B, k]; draft_probs [B, k, V] or None for a deterministic drafter (q is then the
    one-hot of the proposal, so the ratio is p_j(x_j)); target_probs [B, k+1, V] (only the first k used).
    """
    k = draft_tokens.shape[1]
    p = _gather_token_probs(target_probs[:, :k], draft_tokens)  # [B, k]
    if draft_probs is None:
        return p.clamp(max=1.0)
    q = _gather_token_probs(draft_probs, draft_tokens)  # [B, k]
    # q > 0 for a token sampled from q; the guard only keeps 0/0 out of the division.
    return torch.where(q > 0, (p / q.clamp(min=torch.finfo(q.dtype).tiny)).clamp(max=1.0), (p > 0).to(p.dtype))


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) over the last dim; p itself where the residual has no mass.

    The fallback only matters for p == q, where a rejection has probability zero anyway.
    """
    r = (p - q).clamp(min=0)  # [..., V]
    mass = r.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


def next_token_probs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    n_accepted: torch.Tensor,
) -> torch.Tensor:
    """The distribution the token after the accepted prefix is drawn from. -> [B, V].

    n_accepted [B] in 0..k. For n < k (draft token n+1 was rejected): normalize(max(p_{n+1} - q_{n+1}, 0)),
    with q the one-hot of the proposal for a deterministic drafter. For n = k: the bonus
    distribution p_{k+1}.
    """
    k = draft_tokens.shape[1]
    idx = n_accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])  # [B, 1, V]
    p_next = target_probs.gather(1, idx)[:, 0]  # [B, V]
    if k == 0:
        return p_next
    at = n_accepted.clamp(max=k - 1)  # position of the rejected token (clamped for n == k)
    if draft_probs is None:
        rejected = draft_tokens.gather(1, at[:, None])  # [B, 1]
        q_next = torch.zeros_like(p_next).scatter_(1, rejected, 1.0)  # one-hot proposal
    else:
        q_next = draft_probs.gather(1, at[:, None, None].expand(-1, 1, draft_probs.shape[-1]))[:, 0]  # [B, V]
    full = (n_accepted == k)[:, None]  # [B, 1]
    return torch.where(full, p_next, residual_probs(p_next, q_next))


def first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row: [B, k] bool -> [B] long."""
    return accepted.long().cumprod(dim=1).sum(dim=1)


def draw_uniforms(
    draft_tokens: torch.Tensor, generator: torch.Generator | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The U[0, 1) acceptance draws of rejection_sample, [B, k] in the probabilities' dtype (a caller
    that needs them before the probabilities consumes the generator exactly as rejection_sample)."""
    return torch.rand(draft_tokens.shape, generator=generator, device=draft_tokens.device, dtype=dtype)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative sampling step for a block of k draft tokens per row.

    draft_tokens [B, k]; draft_probs [B, k, V] or None (deterministic proposals); target_probs [B, k+1, V].
    uniforms [B, k]: the acceptance draws, if the caller made them already (see draw_uniforms).
    Returns n_accepted [B] in 0..k and next_token [B] (replacement after a rejection, or bonus).
    """
    accept_p = acceptance_probs(draft_tokens, draft_probs, target_probs)  # [B, k]
    u = draw_uniforms(draft_tokens, generator, target_probs.dtype) if uniforms is None else uniforms
    n_accepted = first_rejection(u < accept_p)  # P(u < a) = a for u ~ U[0, 1)
    probs = next_token_probs(draft_tokens, draft_probs, target_probs, n_accepted)  # [B, V]
    return n_accepted, sample(probs, generator)
