"""Divergences between the target's (p) and the draft's (q) next-token distributions, as pure functions.

    from distill.losses import divergence, teacher_forced_acceptance, chunked_distill_loss
    loss = divergence("fkl", p_logits, q_logits, mask)               # [N, V] logits, mask [N] -> scalar
    alpha = teacher_forced_acceptance(p_logits, q_logits, mask)       # mean Σ_x min(p, q) = 1 − TV
    total, count = chunked_distill_loss(hidden, lm_head, positions, teacher, name="tvd")

Conventions: logits are [N, V], already gathered at the positions that count (response tokens);
mask [N] bool says which rows count (None = all). Every function computes in float32 (float64 in,
float64 out) and returns the *mean over counted rows*; an all-masked input returns 0 that still
carries a gradient (so a batch without response tokens is a no-op step, never a NaN).

Divergences (p = target, q = draft, both after dividing logits by `temperature`):
- fkl: KL(p ‖ q) = Σ p (log p − log q); mass-covering.
- rkl: KL(q ‖ p); mode-seeking.
- jsd: generalized Jensen–Shannon with m = β p + (1 − β) q: β KL(p ‖ m) + (1 − β) KL(q ‖ m).
  It tends to β·KL(p‖q) as β → 0 and (1 − β)·KL(q‖p) as β → 1; the endpoints themselves are defined
  as the KLs (β = 0: fkl, β = 1: rkl), as in GKD. Symmetric in p, q at β = 0.5.
- tvd: ½ Σ |p − q| ∈ [0, 1]; 1 − tvd is exactly the per-token acceptance probability α_TF.
Optionally `ce_weight` · CE(q, labels) (cross-entropy on the target's own tokens) is added.

Teacher signal for the chunked driver: full target logits (`DenseTeacher`, or `HiddenTeacher` that
projects the target's hidden states chunk by chunk) or the sparse top-k logits stored by the generate
stage (`TopKTeacher`). Top-k approximation: p is renormalised over its k ids and is 0 elsewhere, while
q keeps the draft's full vocabulary (so fkl/jsd/tvd also push the draft's mass off the tail). Reverse
KL is infinite where p = 0, so for rkl (and jsd at β = 1) q is renormalised over the same k ids too.

Why one module of this size: every divergence, its chunked form and the teachers share one set of
conventions (masks, dtypes, the mean over counted rows), and α_TF is the overlap of the same p and q.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specdec.metrics import overlap

LOSSES = ("fkl", "rkl", "jsd", "tvd")


# ---------------------------------------------------------------- per-token divergences on log-probs


def _plogp_ratio(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ_x p (log p − log q) per row, with 0·log 0 = 0 (p may be exactly 0 on a sparse support). [N, V] -> [N]"""
    p = logp.exp()
    term = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    return term.sum(-1)


def per_token_divergence(name: str, logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Divergence per row from log-probs. logp, logq [N, V] (normalised) -> [N] (≥ 0)."""
    if name == "fkl" or (name == "jsd" and beta == 0):
        return _plogp_ratio(logp, logq)
    if name == "rkl" or (name == "jsd" and beta == 1):
        return _plogp_ratio(logq, logp)
    if name == "jsd":
        # log m = logsumexp(log β + log p, log(1 − β) + log q), computed without leaving log space
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
        return beta * _plogp_ratio(logp, logm) + (1 - beta) * _plogp_ratio(logq, logm)
    if name == "tvd":
        return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    raise ValueError(f"unknown loss {name!r}; choose from {LOSSES}")


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) in float32 (float64 kept). [..., V] -> [..., V]"""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return F.log_softmax(x / temperature, dim=-1)


def masked_mean(values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of values [N] over mask [N] (None = all); 0 with a gradient when nothing counts."""
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


# ---------------------------------------------------------------- public losses on [N, V] logits


def divergence(
    name: str,
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: Optional[torch.Tensor] = None,
    ce_weight: float = 0.0,
) -> torch.Tensor:
    """Mean divergence of draft logits q [N, V] from target logits p [N, V] over mask [N] (+ CE mix).

    labels [N] (the target's tokens) are needed when ce_weight > 0. Returns a scalar.
    """
    values = per_token_divergence(name, log_probs(p_logits, temperature), log_probs(q_logits, temperature), beta)
    if ce_weight:
        values = values + ce_weight * cross_entropy_per_token(q_logits, labels)
    return masked_mean(values, mask)


def forward_kl(p_logits, q_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(p ‖ q), mean over mask. [N, V], [N, V], [N] -> scalar"""
    return divergence("fkl", p_logits, q_logits, mask, temperature=temperature)


def reverse_kl(p_logits, q_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """KL(q ‖ p), mean over mask. [N, V], [N, V], [N] -> scalar"""
    return divergence("rkl", p_logits, q_logits, mask, temperature=temperature)


def generalized_jsd(p_logits, q_logits, mask=None, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """β KL(p ‖ m) + (1 − β) KL(q ‖ m), m = β p + (1 − β) q; mean over mask. -> scalar"""
    return divergence("jsd", p_logits, q_logits, mask, beta=beta, temperature=temperature)


def total_variation(p_logits, q_logits, mask=None, temperature: float = 1.0) -> torch.Tensor:
    """½ Σ |p − q| ∈ [0, 1], mean over mask. -> scalar"""
    return divergence("tvd", p_logits, q_logits, mask, temperature=temperature)


def cross_entropy_per_token(q_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """−log q(label) per row at temperature 1. [N, V], [N] -> [N]"""
    if labels is None:
        raise ValueError("ce_weight > 0 needs labels (the target's tokens)")
    x = q_logits if q_logits.dtype == torch.float64 else q_logits.float()
    return F.cross_entropy(x, labels.long(), reduction="none")


def teacher_forced_acceptance(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """α_TF: mean over counted rows of Σ_x min(p(x), q(x)) = 1 − TV(p, q), at temperature 1.

    p_logits, q_logits [N, V] (the same positions, the target's and the draft's); mask [N] bool.
    Returns a scalar tensor in [0, 1] (0 when nothing counts).
    """
    return masked_mean(overlap_per_token(log_probs(p_logits), log_probs(q_logits)), mask)


def overlap_per_token(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ_x min(p, q) per row from log-probs (specdec.metrics.overlap). [N, V] -> [N]"""
    return overlap(logp, logq, log=True)


# ---------------------------------------------------------------- teacher signals for the chunked driver


@dataclass
class DenseTeacher:
    """Full target logits at the counted positions: logits [N, V]."""

    logits: torch.Tensor

    def log_probs(self, sl: slice, temperature: float, vocab: int) -> torch.Tensor:
        return log_probs(self.logits[sl, :vocab], temperature)


@dataclass
class HiddenTeacher:
    """The target's final hidden states at the counted positions, hidden [N, H_t], projected by `head`
    chunk by chunk (so the target's [N, V] logits never exist all at once either)."""

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]

    def log_probs(self, sl: slice, temperature: float, vocab: int) -> torch.Tensor:
        with torch.no_grad():
            return log_probs(self.head(self.hidden[sl])[:, :vocab], temperature)


@dataclass
class TopKTeacher:
    """Sparse target signal from the generate stage: ids [N, k] (int) and raw logits [N, k].

    p is renormalised over the k ids (0 elsewhere); see the module docstring for the approximation.
    """

    ids: torch.Tensor
    logits: torch.Tensor
    # True: `logits` are already log-probs normalised over the full vocabulary (kept as they are, the
    # rows then sum to 1 − tail mass); used for α_TF references, at temperature 1 only.
    normalized: bool = False

    def sparse(self, sl: slice, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [C, k] long, log p over them [C, k]) for rows sl."""
        vals = self.logits[sl].float()
        logp = vals if self.normalized else F.log_softmax(vals / temperature, dim=-1)
        return self.ids[sl].long(), logp


def sparse_divergence(name: str, logp: torch.Tensor, q_logits: torch.Tensor, ids: torch.Tensor,
                      beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Divergence per row against a teacher that lives on k ids (p = 0 elsewhere), never densifying p.

    logp [C, k]: the teacher's log-probs on ids [C, k]; q_logits [C, V]: the draft's full logits. Only a
    logsumexp over V and a gather touch the vocabulary, so this is much cheaper than the dense path and
    equal to it (tested): off the support p = 0, so fkl only needs log q there, tvd adds the draft's
    mass off the support (1 − Σ_k q), and jsd's KL(q ‖ m) adds −log(1 − β) per unit of that mass.
    rkl (and jsd at β = 1) compares q renormalised over the k ids (KL(q ‖ p) is infinite otherwise). -> [C]
    """
    z = (q_logits if q_logits.dtype == torch.float64 else q_logits.float()) / temperature  # [C, V]
    zk = z.gather(1, ids)  # [C, k]
    if name == "rkl" or (name == "jsd" and beta == 1):
        logq_s = F.log_softmax(zk, dim=-1)
        return (logq_s.exp() * (logq_s - logp)).sum(-1)
    logq = zk - torch.logsumexp(z, dim=-1, keepdim=True)  # [C, k], normalised over the full vocabulary
    p, q = logp.exp(), logq.exp()
    q_off = (1 - q.sum(-1)).clamp(min=0)  # draft mass off the teacher's support
    if name == "fkl" or (name == "jsd" and beta == 0):
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
    if name == "tvd":
        return 0.5 * ((p - q).abs().sum(-1) + q_off)
    if name == "jsd":
        logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
        kl_pm = torch.where(p > 0, p * (logp - logm), torch.zeros_like(p)).sum(-1)
        kl_qm = (q * (logq - logm)).sum(-1) - q_off * math.log1p(-beta)
        return beta * kl_pm + (1 - beta) * kl_qm
    raise ValueError(f"unknown loss {name!r}; choose from {LOSSES}")


Teacher = DenseTeacher | HiddenTeacher | TopKTeacher


def gather_teacher(teacher: Teacher, keep: torch.Tensor) -> Teacher:
    """The same teacher restricted to rows `keep` (bool [N])."""
    if isinstance(teacher, DenseTeacher):
        return DenseTeacher(teacher.logits[keep])
    if isinstance(teacher, HiddenTeacher):
        return HiddenTeacher(teacher.hidden[keep], teacher.head)
    return TopKTeacher(teacher.ids[keep], teacher.logits[keep], teacher.normalized)


# ---------------------------------------------------------------- a draft vocabulary

SINK = -1e4  # logit of the column that stands for every token outside a vocabulary subset


@dataclass
class VocabSubset:
    """Train and score a draft as it decodes with a draft vocabulary (specdec's ModelDrafter(vocab=ids)).

    q is the softmax over the S ids only, and the target's p is restricted to them and renormalised:
    with q confined to the subset, that is the q that maximises Σ_x min(p, q). Projected logits are
    [*, S + 1]: the S ids in order, then one sink column at SINK for every other token, so a teacher
    id outside the subset maps to a column whose probability underflows to exactly 0 while every
    value stays finite (no inf − inf in any divergence).
    """

    ids: torch.Tensor  # [S] long, distinct token ids
    vocab: int  # the full vocabulary size the ids index into

    def __post_init__(self) -> None:
        self.ids = self.ids.long()
        self.size = int(self.ids.numel())
        self.index = torch.full((self.vocab,), self.size, dtype=torch.long, device=self.ids.device)  # id -> column
        self.index[self.ids] = torch.arange(self.size, device=self.ids.device)

    def project(self, head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """A head [*, H] -> [*, S + 1] from an LM head (nn.Linear): the subset's rows plus the sink."""

        cache: dict = {}

        def rows() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            w, b = head.weight, getattr(head, "bias", None)
            if w.requires_grad or (b is not None and b.requires_grad):
                ids = self.ids.to(w.device)
                return w[ids], b[ids] if b is not None else None
            key = (w.data_ptr(), w._version)  # a frozen head: gather its rows once, again only if it changes
            if cache.get("key") != key:
                ids = self.ids.to(w.device)
                cache.update(key=key, rows=(w[ids], b[ids] if b is not None else None))
            return cache["rows"]

        def subset_head(h: torch.Tensor) -> torch.Tensor:
            z = F.linear(h, *rows())  # [*, S]
            return torch.cat([z, z.new_full((*z.shape[:-1], 1), SINK)], dim=-1)

        return subset_head

    def columns(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> subset columns (S, the sink, for ids outside the subset). Same shape."""
        return self.index.to(token_ids.device)[token_ids.long()]

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Label ids -> columns, with ids outside the subset (and -100) ignored (-100) by the CE mix."""
        cols = self.columns(labels.clamp(min=0))
        return torch.where((labels < 0) | (cols == self.size), torch.full_like(cols, -100), cols)

    def restrict(self, teacher: "Teacher") -> tuple["Teacher", Optional[torch.Tensor]]:
        """(the teacher over the subset's columns, keep [N] bool or None). keep drops the rows of a
        top-k teacher whose k ids all lie outside the subset: p restricted to it is undefined there."""
        if isinstance(teacher, DenseTeacher):
            z = teacher.logits[:, self.ids.to(teacher.logits.device)]
            return DenseTeacher(torch.cat([z, z.new_full((z.shape[0], 1), SINK)], dim=-1)), None
        if isinstance(teacher, HiddenTeacher):
            return HiddenTeacher(teacher.hidden, self.project(teacher.head)), None
        cols = self.columns(teacher.ids)  # [N, k]
        inside = cols < self.size
        logits = torch.where(inside, teacher.logits.float(), torch.full_like(teacher.logits, SINK, dtype=torch.float32))
        keep = None if teacher.normalized else inside.any(-1)
        return TopKTeacher(cols, logits, teacher.normalized), keep


# ---------------------------------------------------------------- the chunked driver


def _chunk_values(
    h: torch.Tensor,
    labels: Optional[torch.Tensor],
    sl: slice,
    head: Callable[[torch.Tensor], torch.Tensor],
    teacher: Teacher,
    name: str,
    beta: float,
    temperature: float,
    ce_weight: float,
    vocab: int,
) -> torch.Tensor:
    """Per-position loss of one chunk: project h [C, H] with the draft head, compare. -> [C]"""
    q_logits = head(h)[:, :vocab]  # [C, V]
    if teacher is None:  # language modelling on the labels alone
        return ce_weight * cross_entropy_per_token(q_logits, labels)
    if isinstance(teacher, TopKTeacher):
        ids, logp = teacher.sparse(sl, temperature)
        values = sparse_divergence(name, logp, q_logits, ids, beta, temperature)
    else:
        values = per_token_divergence(name, teacher.log_probs(sl, temperature, vocab), log_probs(q_logits, temperature), beta)
    if ce_weight:
        values = values + ce_weight * cross_entropy_per_token(q_logits, labels)
    return values


def chunked_distill_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    positions: torch.Tensor,
    teacher: Teacher,
    name: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: Optional[torch.Tensor] = None,
    ce_weight: float = 0.0,
    chunk_size: int = 512,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of per-position losses, number of positions) over the counted positions of a batch.

    hidden [B, T, H]: the draft's final hidden states (after its final norm); head: the draft's LM
    head ([*, H] -> [*, V_model]); positions [B, T] bool: positions whose next token is trained (the
    teacher's rows are these positions in row-major order, N = positions.sum()); labels [B, T] (the
    next tokens) for the CE mix; teacher None: ce_weight × the cross-entropy on labels alone. Only the N
    counted positions are projected to the vocabulary, in chunks of chunk_size; with more than one chunk
    each is recomputed in backward (activation checkpointing), so at most one [chunk_size, V] block of
    logits is alive at a time. vocab_size drops padded rows.

    Returns a sum (not a mean) so callers can normalise by the token count of a whole global batch.
    """
    h = hidden[positions]  # [N, H]
    lab = labels[positions] if labels is not None else None  # [N]
    n = h.shape[0]
    if n == 0:
        return hidden.sum() * 0.0, torch.zeros((), device=hidden.device)
    vocab = vocab_size or int(_head_rows(head, h[:1]))
    total = h.new_zeros((), dtype=torch.float32)
    chunked = n > chunk_size
    for start in range(0, n, chunk_size):
        sl = slice(start, min(n, start + chunk_size))
        args = (h[sl], lab[sl] if lab is not None else None, sl, head, teacher, name, beta, temperature, ce_weight, vocab)
        if chunked and h.requires_grad:
            values = checkpoint(_chunk_values, *args, use_reentrant=False)
        else:
            values = _chunk_values(*args)
        total = total + values.sum()
    return total, torch.tensor(float(n), device=hidden.device)


def chunked_overlap(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    positions: torch.Tensor,
    teacher: Teacher,
    chunk_size: int = 512,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over counted positions of Σ_x min(p, q), count): α_TF's numerator and denominator, no grad."""
    with torch.no_grad():
        h = hidden[positions]
        n = h.shape[0]
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        if n == 0:
            return total, torch.zeros((), device=hidden.device)
        vocab = vocab_size or int(_head_rows(head, h[:1]))
        for start in range(0, n, chunk_size):
            sl = slice(start, min(n, start + chunk_size))
            logq = log_probs(head(h[sl])[:, :vocab])  # [C, V]
            if isinstance(teacher, TopKTeacher):  # p = 0 off the support, so min(p, q) = 0 there
                ids, logp = teacher.sparse(sl, 1.0)
                overlap = torch.minimum(logp, logq.gather(1, ids)).exp().sum(-1)
            else:
                overlap = overlap_per_token(teacher.log_probs(sl, 1.0, vocab), logq)
            total += overlap.double().sum()
        return total, torch.tensor(float(n), device=hidden.device)


def _head_rows(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> int:
    with torch.no_grad():
        return head(h).shape[-1]
