"""The metric definitions of docs/architecture.md ("Metric definitions"), in code, computed from the decoding loop's own counters.

    from specdec.metrics import predicted_speedup, expected_tokens_per_call
    predicted_speedup(alpha=0.8, gamma=4, c=0.1)      # 2.38...
    result.metrics.to_dict()                          # every number below, by its table name

Names: gamma, acceptance_rate (α: accepted ÷ tried, tried = accepted + the one rejection that ends a
round), draft_acceptance_ratio (accepted ÷ proposed), tokens_per_target_call (τ), per-position
acceptance, cost_ratio (c: one draft step ÷ one target step), predicted_speedup.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch


def expected_tokens_per_call(alpha: float, gamma: float) -> float:
    """E[tokens per target call] = (1 − α^(γ+1)) ÷ (1 − α) for i.i.d. acceptance (γ + 1 at α = 1)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha})")
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, gamma: float, c: float) -> float:
    """(1 − α^(γ+1)) ÷ ((1 − α)(γc + 1)) (Leviathan et al., 2023); (γ+1) ÷ (γc + 1) at α = 1."""
    return expected_tokens_per_call(alpha, gamma) / (gamma * c + 1)


def overlap(p: torch.Tensor, q: torch.Tensor, log: bool = False) -> torch.Tensor:
    """Σ_x min(p(x), q(x)) = 1 − TV(p, q) per position: the probability that a draft token sampled from
    q is accepted against p. p, q [..., V] -> [...]; log=True takes log-probs (exp is monotone, so the min
    is taken first and one exp allocated). The one definition every α_TF in the project uses."""
    return (torch.minimum(p, q).exp() if log else torch.minimum(p, q)).sum(dim=-1)


def teacher_forced_acceptance(p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """α_TF: mean over positions of overlap(p, q). p, q [..., V]; mask [...] bool."""
    overlap_ = overlap(p, q)  # [...]
    if mask is not None:
        overlap_ = overlap_[mask]
    return float(overlap_.double().mean()) if overlap_.numel() else float("nan")


_SETTINGS = ("batch_size", "gamma", "gamma_policy", "temperature", "top_k", "top_p", "draft_sampled")
_COUNTERS = ("target_calls", "row_rounds", "draft_calls", "proposed", "accepted", "rejections", "emitted",
             "gamma_sum", "prefill_time_s", "draft_time_s", "target_time_s", "wall_time_s")
_HISTOGRAMS = ("tried_at", "accepted_at", "accepted_lengths")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class SpecMetrics:
    """Counters filled by the decoding loop, and the metrics derived from them.

    A "row-round" is one row in one round: a round verifies a block for every active row with one
    target forward call. Tokens cut off by a stop token or the token budget are not counted as
    emitted or accepted (a cut round ends without a rejection).
    """

    # settings, recorded with every number
    batch_size: int = 1
    gamma: int = 0  # configured γ (the adaptive policy's starting value)
    gamma_policy: str = "constant"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_sampled: bool = False  # proposals drawn from q (else argmax / lookup)
    # counters
    target_calls: int = 0  # target forward calls after prefill (one per round)
    row_rounds: int = 0  # Σ over target calls of the rows in the batch
    draft_calls: int = 0  # draft forward calls
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted and emitted
    rejections: int = 0  # rounds that ended with a rejected draft token
    emitted: int = 0  # new tokens emitted, all rows
    gamma_sum: int = 0  # Σ over row-rounds of the γ used
    tried_at: list[int] = field(default_factory=list)  # [k-1]: rows that tried draft token k
    accepted_at: list[int] = field(default_factory=list)  # [k-1]: rows that accepted draft token k
    accepted_lengths: list[int] = field(default_factory=list)  # [n]: row-rounds with n accepted
    # time, seconds
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    wall_time_s: float = 0.0
    baseline_target_step_s: float | None = None  # one target-alone decoding step, if measured

    def record(self, gamma: int, accepted: int, rejected: bool, emitted: int) -> None:
        """One row-round: γ proposed, ``accepted`` kept, whether a rejection ended it, tokens emitted."""
        self.row_rounds += 1
        self.gamma_sum += gamma
        self.proposed += gamma
        self.accepted += accepted
        self.rejections += int(rejected)
        self.emitted += emitted
        tried = accepted + int(rejected)
        for counts, upto in ((self.tried_at, tried), (self.accepted_at, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for j in range(upto):
                counts[j] += 1
        self.accepted_lengths.extend([0] * (accepted + 1 - len(self.accepted_lengths)))
        self.accepted_lengths[accepted] += 1

    # -- definitions ---------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.accepted, self.accepted + self.rejections)

    @property
    def draft_acceptance_ratio(self) -> float | None:
        return _ratio(self.accepted, self.proposed)

    @property
    def tokens_per_target_call(self) -> float | None:
        return _ratio(self.emitted, self.row_rounds)

    @property
    def per_position_acceptance(self) -> list[float | None]:
        acc = self.accepted_at + [0] * (len(self.tried_at) - len(self.accepted_at))
        return [_ratio(a, t) for a, t in zip(acc, self.tried_at)]

    @property
    def mean_gamma(self) -> float | None:
        return _ratio(self.gamma_sum, self.row_rounds)

    @property
    def draft_step_s(self) -> float | None:
        return _ratio(self.draft_time_s, self.draft_calls)

    @property
    def target_step_s(self) -> float | None:
        """The baseline's single-token step if measured, else this loop's mean target call."""
        return self.baseline_target_step_s or _ratio(self.target_time_s, self.target_calls)

    @property
    def cost_ratio(self) -> float | None:
        d, t = self.draft_step_s, self.target_step_s
        return d / t if d is not None and t else None

    @property
    def tokens_per_s(self) -> float | None:
        return _ratio(self.emitted, self.wall_time_s)

    @property
    def predicted_speedup(self) -> float | None:
        a, g, c = self.acceptance_rate, self.mean_gamma, self.cost_ratio
        return predicted_speedup(a, g, c) if None not in (a, g, c) else None

    @property
    def expected_tokens_per_call(self) -> float | None:
        a, g = self.acceptance_rate, self.mean_gamma
        return expected_tokens_per_call(a, g) if None not in (a, g) else None

    @classmethod
    def merge(cls, parts: list["SpecMetrics"], batch_size: int | None = None) -> "SpecMetrics":
        """Sum the counters, histograms and times of runs with the same settings (the definitions
        then apply to the sums). Settings come from the first part; batch_size overrides its."""
        if not parts:
            raise ValueError("nothing to merge")
        first = parts[0]
        out = cls(**{f.name: getattr(first, f.name) for f in fields(cls) if f.name in _SETTINGS})
        if batch_size is not None:
            out.batch_size = batch_size
        for p in parts:
            for k in _COUNTERS:
                setattr(out, k, getattr(out, k) + getattr(p, k))
            for k in _HISTOGRAMS:
                a, b = getattr(out, k), getattr(p, k)
                setattr(out, k, [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))])
        return out

    def to_dict(self) -> dict:
        """Settings, counters and every derived metric, under the names of docs/architecture.md."""
        out = asdict(self)
        for name in ("acceptance_rate", "draft_acceptance_ratio", "tokens_per_target_call",
                     "per_position_acceptance", "mean_gamma", "draft_step_s", "target_step_s",
                     "cost_ratio", "tokens_per_s", "predicted_speedup", "expected_tokens_per_call"):
            out[name] = getattr(self, name)
        out["accepted_length_histogram"] = out.pop("accepted_lengths")
        return out


def bootstrap_ci(num: list[float], den: list[float] | None = None, level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> list[float] | None:
    """Percentile bootstrap interval over items (prompts) of Σnum ÷ Σden (den None: the mean of num).

    Each resample draws len(num) items with replacement and takes the ratio of the sums, so a
    per-token rate (α, τ) weights prompts by their tokens as the point estimate does. Returns
    [low, high], or None for fewer than 2 items (one item has no spread to resample); resamples whose
    denominator is 0 are dropped.
    """
    import numpy as np

    n = len(num)
    x = np.asarray(num, dtype=np.float64)
    d = np.ones(n) if den is None else np.asarray(den, dtype=np.float64)
    if d.shape != x.shape:
        raise ValueError(f"num and den need the same length (got {n} and {len(d)})")
    if n < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    tops, bottoms = x[idx].sum(1), d[idx].sum(1)
    ok = bottoms != 0
    if not ok.any():
        return None
    ratios = tops[ok] / bottoms[ok]
    tail = (1 - level) / 2
    return [float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))]
