"""The rejection sampler is exact: enumeration of every proposal and accept/reject outcome (float64).

    pytest tests/test_specdec_sampling.py -q
"""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.sampling import (
    SamplingParams,
    acceptance_probs,
    greedy_verify,
    logits_to_probs,
    next_token_probs,
    rejection_sample,
    sample,
)

SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=4, top_p=0.7),
]


def _random_lm(V: int, k: int, gen: torch.Generator, scale: float = 2.0) -> dict[tuple, torch.Tensor]:
    """Next-token logits for every prefix of length 0..k: a toy LM whose conditionals all differ."""
    return {
        prefix: torch.randn(V, generator=gen, dtype=torch.float64) * scale
        for m in range(k + 1)
        for prefix in itertools.product(range(V), repeat=m)
    }


def _exact_completed_distribution(p_of, q_of, V: int, k: int, deterministic: bool) -> torch.Tensor:
    """P(x_1..x_{k+1}) when the emitted block of one speculative round is completed by sampling the
    target: lossless iff this equals the target's joint. p_of/q_of: prefix -> probs [V].

    Enumerates every proposal d (weight Π q(d_j | d_<j)), every accepted length m (weight
    Π_{j<m} a_j (1 − a_m)), and the distribution of the token after the prefix, using the same
    functions the sampler uses.
    """
    if deterministic:  # one proposal: the draft's argmax at every step
        d: list[int] = []
        for _ in range(k):
            d.append(int(q_of[tuple(d)].argmax()))
        proposals = torch.tensor([d])
    else:
        proposals = torch.tensor(list(itertools.product(range(V), repeat=k)))  # [N, k]
    N = proposals.shape[0]
    rows = [tuple(r) for r in proposals.tolist()]
    P = torch.stack([torch.stack([p_of[r[:j]] for j in range(k + 1)]) for r in rows])  # [N, k+1, V]
    Q = torch.stack([torch.stack([q_of[r[:j]] for j in range(k)]) for r in rows])  # [N, k, V]
    if deterministic:
        Q_used, weight = None, torch.ones(N, dtype=torch.float64)
    else:
        Q_used = Q
        weight = Q.gather(-1, proposals[..., None])[..., 0].prod(dim=1)  # [N] P(proposal)
    a = acceptance_probs(proposals, Q_used, P)  # [N, k]
    # target joint over k+1 tokens, and its marginals over the first j tokens
    joint = torch.ones([V] * 0, dtype=torch.float64)
    for j in range(k + 1):
        cond = torch.stack([p_of[pre] for pre in itertools.product(range(V), repeat=j)])  # [V^j, V]
        joint = (joint.reshape(-1, 1) * cond).reshape([V] * (j + 1))
    completed = torch.zeros_like(joint)
    for m in range(k + 1):
        stay = a[:, :m].prod(dim=1) * ((1 - a[:, m]) if m < k else 1.0)  # [N] P(exactly m accepted)
        nxt = next_token_probs(proposals, Q_used, P, torch.full((N,), m))  # [N, V]
        emitted = torch.zeros(V**m, V, dtype=torch.float64)  # [prefix d_1..d_m, x]
        flat = torch.zeros(N, dtype=torch.long)
        for j in range(m):
            flat = flat * V + proposals[:, j]
        emitted.index_add_(0, flat, (weight * stay)[:, None] * nxt)
        emitted = emitted.reshape([V] * (m + 1))
        # complete with the target: P(rest | emitted prefix) = joint / marginal(prefix)
        marginal = joint.sum(dim=tuple(range(m + 1, k + 1))) if m < k else joint
        ratio = torch.where(marginal > 0, emitted / marginal.clamp(min=1e-300), torch.zeros_like(emitted))
        assert torch.all(emitted[marginal == 0] == 0), "emitted a token the target cannot produce"
        completed += ratio.reshape(list(ratio.shape) + [1] * (k - m)) * joint
    return completed, joint


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_sampler_exact_by_enumeration(k, params, deterministic):
    V = 6 if k == 3 else 7
    gen = torch.Generator().manual_seed(100 * k + int(params.temperature * 10) + params.top_k)
    target_logits, draft_logits = _random_lm(V, k, gen), _random_lm(V, k, gen)
    p_of = {pre: logits_to_probs(l, params) for pre, l in target_logits.items()}
    q_of = {pre: logits_to_probs(l, params) for pre, l in draft_logits.items()}
    completed, joint = _exact_completed_distribution(p_of, q_of, V, k, deterministic)
    assert abs(float(joint.sum()) - 1) < 1e-12
    torch.testing.assert_close(completed, joint, atol=1e-12, rtol=0)
    # the first emitted token alone (every round emits one) is distributed as p(. | context)
    torch.testing.assert_close(completed.sum(dim=tuple(range(1, k + 1))), p_of[()], atol=1e-12, rtol=0)


def test_rejection_sampler_exact_when_draft_equals_target():
    V, k = 5, 2
    gen = torch.Generator().manual_seed(7)
    lm = _random_lm(V, k, gen)
    p_of = {pre: logits_to_probs(l, SETTINGS[0]) for pre, l in lm.items()}
    completed, joint = _exact_completed_distribution(p_of, p_of, V, k, deterministic=False)
    torch.testing.assert_close(completed, joint, atol=1e-12, rtol=0)
    proposals = torch.tensor([[0, 1]])
    P = torch.stack([p_of[()], p_of[(0,)], p_of[(0, 1)]])[None]
    assert torch.all(acceptance_probs(proposals, P[:, :2], P) == 1)


def test_rejection_sample_matches_its_exact_probabilities():
    """The stochastic step draws from exactly the distributions the enumeration checks."""
    V, k, B = 5, 2, 200_000
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(1, k + 1, V, generator=gen, dtype=torch.float64).softmax(-1).expand(B, -1, -1)
    q = torch.randn(1, k, V, generator=gen, dtype=torch.float64).softmax(-1).expand(B, -1, -1)
    draft = sample(q, gen)  # [B, k]
    n, nxt = rejection_sample(draft, q, p, gen)
    a = acceptance_probs(draft, q, p)
    for m in range(k + 1):
        stay = a[:, :m].prod(1) * ((1 - a[:, m]) if m < k else 1.0)
        expect_n = float(stay.mean())
        assert abs(float((n == m).double().mean()) - expect_n) < 5 * (expect_n / B) ** 0.5 + 1e-4
    # first emitted token: draft[0] if accepted else the replacement; its law must be p_1
    first = torch.where(n > 0, draft[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / B
    assert torch.all((freq - p[0, 0]).abs() < 5 * (p[0, 0] / B).sqrt() + 1e-4)


def test_sample_frequencies():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(100_000, -1), gen)
    freq = torch.bincount(draws, minlength=4).double() / 100_000
    assert freq[1] == 0
    assert torch.all((freq - probs).abs() < 0.01)
    unnormalized = torch.tensor([2.0, 0.0, 6.0])  # a residual before normalizing: weights, not probabilities
    freq = torch.bincount(sample(unnormalized.expand(100_000, -1), gen), minlength=3).double() / 100_000
    assert freq[1] == 0 and abs(float(freq[2]) - 0.75) < 0.01


def test_sample_edges_of_the_uniform_draw_never_pick_a_zero_probability_token(monkeypatch):
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0]])
    for fill, expect in ((0.0, 1), (1.0, 3)):  # u = 0, and u = the total (float rounding of rand() * total)
        monkeypatch.setattr(torch, "rand", lambda shape, fill=fill, **kw: torch.full(shape, fill, dtype=kw["dtype"]))
        assert sample(probs).tolist() == [expect]


def test_logits_to_probs_matches_hf_warpers():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    logits[0, :10] = logits[0, 10]  # ties at the top-k boundary
    for params in SETTINGS + [SamplingParams(temperature=0.5, top_k=50), SamplingParams(temperature=2.0, top_p=0.01)]:
        ref = TemperatureLogitsWarper(params.temperature)(None, logits.clone())
        if params.top_k:
            ref = TopKLogitsWarper(params.top_k)(None, ref)
        if params.top_p < 1:
            ref = TopPLogitsWarper(params.top_p)(None, ref)
        torch.testing.assert_close(logits_to_probs(logits, params), ref.softmax(-1))
    top1 = logits_to_probs(logits, SamplingParams(temperature=2.0, top_p=0.01))
    assert torch.all((top1 > 0).sum(-1) >= 1)


def test_greedy_params_give_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 2.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]  # ties: the first index, like torch.argmax


def test_greedy_verify_prefix_match():
    V = 5
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # target argmax at each of k+1
    logits = torch.nn.functional.one_hot(best, V).float()  # [3, 4, V]
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3]])
    n, nxt = greedy_verify(draft, logits)
    assert n.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 2, 1]  # bonus after full acceptance, else the correction


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError, match="must be"):
        SamplingParams(**bad)
