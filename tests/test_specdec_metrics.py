"""Metric definitions (docs/architecture.md, "Metric definitions") on scripted counters.

    pytest tests/test_specdec_metrics.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from specdec.metrics import SpecMetrics, expected_tokens_per_call, predicted_speedup, teacher_forced_acceptance


def test_counters_on_a_scripted_sequence():
    # (gamma, accepted, ended by a rejection, tokens emitted) per row-round
    script = [(4, 4, False, 5), (4, 1, True, 2), (4, 0, True, 1), (4, 3, True, 4), (4, 2, False, 2)]
    m = SpecMetrics(gamma=4)
    for g, a, r, e in script:
        m.record(g, a, r, e)
    m.target_calls = len(script)
    # α = accepted / (accepted + rejections) = 10 / (10 + 3)
    assert m.acceptance_rate == pytest.approx(10 / 13)
    assert m.draft_acceptance_ratio == pytest.approx(10 / 20)
    assert m.tokens_per_target_call == pytest.approx(14 / 5)
    # position k: rows that accepted draft token k ÷ rows that tried it (accepted or rejected it)
    tried = [sum(1 for _, a, r, _ in script if a + r >= k) for k in (1, 2, 3, 4)]
    acc = [sum(1 for _, a, _, _ in script if a >= k) for k in (1, 2, 3, 4)]
    assert tried == [5, 4, 2, 2] and acc == [4, 3, 2, 1]
    assert m.per_position_acceptance == pytest.approx([a / t for a, t in zip(acc, tried)])
    assert m.to_dict()["accepted_length_histogram"] == [1, 1, 1, 1, 1]
    # α is also Σ accepted / Σ tried over positions
    assert m.acceptance_rate == pytest.approx(sum(acc) / sum(tried))


def test_to_dict_names():
    m = SpecMetrics(gamma=3)
    m.record(3, 2, True, 3)
    m.target_calls, m.draft_calls, m.draft_time_s, m.target_time_s, m.wall_time_s = 1, 3, 0.3, 1.0, 2.0
    d = m.to_dict()
    for name in ("gamma", "acceptance_rate", "draft_acceptance_ratio", "tokens_per_target_call",
                 "per_position_acceptance", "accepted_length_histogram", "draft_time_s", "target_time_s",
                 "cost_ratio", "tokens_per_s", "predicted_speedup"):
        assert name in d
    assert d["cost_ratio"] == pytest.approx(0.1)
    assert d["tokens_per_s"] == pytest.approx(1.5)
    m.baseline_target_step_s = 0.5
    assert m.cost_ratio == pytest.approx(0.2)
    assert SpecMetrics().to_dict()["acceptance_rate"] is None  # 0/0 is undefined, not 0


@pytest.mark.parametrize("alpha,gamma,c",
                         [(0.0, 4, 0.1), (0.5, 3, 0.2), (0.8, 4, 0.05), (0.9, 7, 0.0), (0.999999, 5, 0.1)])
def test_predicted_speedup_formula(alpha, gamma, c):
    expected = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
    assert predicted_speedup(alpha, gamma, c) == pytest.approx(expected, rel=1e-9)
    # E[tokens per call] is the mean of a capped geometric: Σ_{i=0..γ} α^i
    assert expected_tokens_per_call(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)), rel=1e-6)


def test_predicted_speedup_alpha_one_limit():
    assert predicted_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert predicted_speedup(1.0, 4, 0.1) == pytest.approx(predicted_speedup(1 - 1e-9, 4, 0.1), rel=1e-6)
    assert expected_tokens_per_call(1.0, 3) == 4
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    with pytest.raises(ValueError):
        expected_tokens_per_call(1.5, 3)


def test_teacher_forced_acceptance_is_one_minus_tv():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(3, 4, 9, generator=gen).softmax(-1)
    q = torch.randn(3, 4, 9, generator=gen).softmax(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert teacher_forced_acceptance(p, q) == pytest.approx(float(1 - tv.mean()), rel=1e-6)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, :2] = True
    assert teacher_forced_acceptance(p, q, mask) == pytest.approx(float(1 - tv[0, :2].mean()), rel=1e-6)
    assert teacher_forced_acceptance(p, p) == pytest.approx(1.0)
    assert math.isnan(teacher_forced_acceptance(p, q, torch.zeros(3, 4, dtype=torch.bool)))
