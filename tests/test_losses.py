"""distill/losses.py against references computed another way (F.kl_div, float64 enumeration)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distill.losses import (
    DenseTeacher, HiddenTeacher, LOSSES, TopKTeacher, VocabSubset, chunked_distill_loss, chunked_overlap, divergence,
    forward_kl, generalized_jsd, log_probs, reverse_kl, teacher_forced_acceptance, total_variation,
)


def logits(n=7, v=11, seed=0, scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=dtype) * scale)


def ref_jsd(p_logits, q_logits, beta):
    """Generalized JSD by enumeration in float64: β KL(p‖m) + (1−β) KL(q‖m), m = βp + (1−β)q."""
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    m = beta * p + (1 - beta) * q
    kl = lambda a, b: (a * (a / b).log()).sum(-1)  # noqa: E731
    return (beta * kl(p, m) + (1 - beta) * kl(q, m)).mean()


@pytest.mark.parametrize("name", LOSSES)
def test_identical_logits_give_zero(name):
    x = logits()
    assert divergence(name, x, x.clone()).abs().item() < 1e-12


def test_forward_and_reverse_kl_match_f_kl_div():
    p, q = logits(seed=1), logits(seed=2)
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    # F.kl_div(input=log q, target=log p) = Σ p (log p − log q) = KL(p ‖ q)
    ref_f = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1).mean()
    ref_r = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1).mean()
    torch.testing.assert_close(forward_kl(p, q), ref_f)
    torch.testing.assert_close(reverse_kl(p, q), ref_r)
    assert not torch.allclose(ref_f, ref_r)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_matches_enumeration(beta):
    p, q = logits(seed=3), logits(seed=4)
    torch.testing.assert_close(generalized_jsd(p, q, beta=beta), ref_jsd(p, q, beta))


def test_jsd_endpoints_and_symmetry():
    p, q = logits(seed=5), logits(seed=6)
    torch.testing.assert_close(generalized_jsd(p, q, beta=0.0), forward_kl(p, q))
    torch.testing.assert_close(generalized_jsd(p, q, beta=1.0), reverse_kl(p, q))
    # the limits: JSD_β / β -> KL(p‖q) as β -> 0, JSD_β / (1−β) -> KL(q‖p) as β -> 1
    eps = 1e-6
    torch.testing.assert_close(generalized_jsd(p, q, beta=eps) / eps, forward_kl(p, q), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(p, q, beta=1 - eps) / eps, reverse_kl(p, q), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(generalized_jsd(p, q, beta=0.5), generalized_jsd(q, p, beta=0.5))
    # JSD(0.5) ≤ ln 2
    assert generalized_jsd(p * 100, q * 100, beta=0.5) <= torch.log(torch.tensor(2.0, dtype=torch.float64)) + 1e-12


def test_tvd_in_unit_interval_and_equals_one_minus_acceptance():
    p, q = logits(seed=7), logits(seed=8)
    tv = total_variation(p, q)
    ref = 0.5 * (p.softmax(-1) - q.softmax(-1)).abs().sum(-1).mean()
    torch.testing.assert_close(tv, ref)
    assert 0 <= tv <= 1
    torch.testing.assert_close(teacher_forced_acceptance(p, q), 1 - tv)
    ref_overlap = torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(teacher_forced_acceptance(p, q), ref_overlap)
    # disjoint supports: TV = 1, α_TF = 0; identical: TV = 0, α_TF = 1
    a = torch.tensor([[50.0, -50.0]], dtype=torch.float64)
    assert abs(total_variation(a, -a).item() - 1) < 1e-12
    assert abs(teacher_forced_acceptance(a, a).item() - 1) < 1e-12


@pytest.mark.parametrize("name", LOSSES)
def test_mask_equals_subset_and_all_masked_is_zero_with_grad(name):
    p, q = logits(seed=9), logits(seed=10)
    mask = torch.tensor([True, False, True, True, False, False, True])
    q_bad = q.clone()
    q_bad[~mask] = float("nan")  # masked rows must not leak in (values or gradients)
    torch.testing.assert_close(divergence(name, p, q_bad, mask), divergence(name, p[mask], q[mask]))
    qq = q.clone().requires_grad_(True)
    zero = divergence(name, p, qq, torch.zeros(7, dtype=torch.bool))
    assert zero.item() == 0.0
    zero.backward()
    assert qq.grad is not None and torch.all(qq.grad == 0)


def test_temperature_and_ce_mix():
    p, q = logits(seed=11), logits(seed=12)
    labels = torch.arange(7) % 11
    torch.testing.assert_close(divergence("fkl", p, q, temperature=2.0), forward_kl(p / 2, q / 2))
    ce = F.cross_entropy(q, labels)
    torch.testing.assert_close(divergence("tvd", p, q, labels=labels, ce_weight=0.3), total_variation(p, q) + 0.3 * ce)


def _setup(seed=0, B=3, T=9, H=8, V=13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    positions = torch.rand(B, T, generator=g) > 0.4
    labels = torch.randint(0, V, (B, T), generator=g)
    n = int(positions.sum())
    p_logits = torch.randn(n, V, generator=g) * 2
    return hidden, head, positions, labels, p_logits


@pytest.mark.parametrize("name", LOSSES)
def test_chunked_equals_unchunked_and_reference(name):
    hidden, head, positions, labels, p_logits = _setup()
    kw = dict(name=name, beta=0.3, temperature=1.5, labels=labels, ce_weight=0.2)
    s1, n1 = chunked_distill_loss(hidden, head, positions, DenseTeacher(p_logits), chunk_size=1000, **kw)
    (g1,) = torch.autograd.grad(s1, hidden)
    s2, n2 = chunked_distill_loss(hidden, head, positions, DenseTeacher(p_logits), chunk_size=3, **kw)
    (g2,) = torch.autograd.grad(s2, hidden)
    torch.testing.assert_close(s1, s2)
    torch.testing.assert_close(g1, g2)
    assert n1 == n2 == positions.sum()
    q_logits = head(hidden[positions])
    ref = divergence(name, p_logits, q_logits, beta=0.3, temperature=1.5, labels=labels[positions], ce_weight=0.2)
    torch.testing.assert_close(s1 / n1, ref)


def test_hidden_teacher_equals_dense_teacher():
    hidden, head, positions, labels, _ = _setup(seed=1)
    t_hidden = torch.randn(int(positions.sum()), 8)
    t_head = torch.nn.Linear(8, 13, bias=False)
    a, _ = chunked_distill_loss(hidden, head, positions, HiddenTeacher(t_hidden, t_head), "jsd", chunk_size=4)
    b, _ = chunked_distill_loss(hidden, head, positions, DenseTeacher(t_head(t_hidden).detach()), "jsd", chunk_size=4)
    torch.testing.assert_close(a, b)


def test_topk_teacher_renormalises_over_its_support():
    hidden, head, positions, _, p_logits = _setup(seed=2)
    top = p_logits.topk(4, dim=-1)
    sparse = TopKTeacher(top.indices, top.values)
    dense = torch.full_like(p_logits, float("-inf")).scatter(1, top.indices, top.values)
    q_logits = head(hidden[positions])
    for name in ("fkl", "tvd", "jsd"):
        s, n = chunked_distill_loss(hidden, head, positions, sparse, name, chunk_size=5)
        torch.testing.assert_close(s / n, divergence(name, dense, q_logits))
    # reverse KL: q restricted to the same support (else it is infinite)
    s, n = chunked_distill_loss(hidden, head, positions, sparse, "rkl", chunk_size=5)
    q_support = torch.full_like(q_logits, float("-inf")).scatter(1, top.indices, q_logits.gather(1, top.indices))
    assert torch.isfinite(s)
    torch.testing.assert_close(s / n, divergence("rkl", dense, q_support))
    # k = V: exactly the dense loss
    full = p_logits.topk(13, dim=-1)
    for name in LOSSES:
        s, n = chunked_distill_loss(hidden, head, positions, TopKTeacher(full.indices, full.values), name, chunk_size=5)
        torch.testing.assert_close(s / n, divergence(name, p_logits, q_logits))


def test_chunked_overlap_and_empty_positions():
    hidden, head, positions, _, p_logits = _setup(seed=3)
    s, n = chunked_overlap(hidden, head, positions, DenseTeacher(p_logits), chunk_size=2)
    torch.testing.assert_close(float(s / n), float(teacher_forced_acceptance(p_logits, head(hidden[positions]).detach())))
    none = torch.zeros_like(positions)
    total, count = chunked_distill_loss(hidden, head, none, DenseTeacher(p_logits[:0]), "fkl")
    assert total.item() == 0 and count.item() == 0
    total.backward()
    assert hidden.grad is not None and torch.all(hidden.grad == 0)


def test_overlap_with_exact_topk_reference_is_a_lower_bound_within_the_tail():
    hidden, head, positions, _, p_logits = _setup(seed=4)
    exact = teacher_forced_acceptance(p_logits, head(hidden[positions]).detach())
    logp = p_logits.log_softmax(-1)
    for k, exact_match in ((13, True), (5, False)):
        top = logp.topk(k, dim=-1)  # full-vocabulary log-probs, not renormalised
        s, n = chunked_overlap(hidden, head, positions, TopKTeacher(top.indices, top.values, normalized=True), chunk_size=4)
        tail = (1 - top.values.exp().sum(-1)).mean()
        assert float(s / n) <= float(exact) + 1e-6 and float(exact) - float(s / n) <= float(tail) + 1e-6
        if exact_match:
            assert float(s / n) == pytest.approx(float(exact), abs=1e-6)


# ---------------------------------------------------------------- a draft vocabulary (VocabSubset)


def _subset_reference(name, p_logits, q_logits, ids, **kw):
    """The divergence between p restricted to ids (renormalised) and q's softmax over ids, densely."""
    return divergence(name, p_logits[:, ids], q_logits[:, ids], **kw)


@pytest.mark.parametrize("name", LOSSES)
def test_subset_loss_equals_the_restricted_dense_loss(name):
    hidden, head, positions, labels, p_logits = _setup(seed=4)
    ids = torch.tensor([11, 0, 5, 7, 2, 9, 3])  # 7 of 13 ids, unsorted
    sub = VocabSubset(ids, 13)
    q_logits = head(hidden[positions])
    kw = dict(beta=0.3, temperature=1.5)
    want = _subset_reference(name, p_logits, q_logits, ids, **kw)
    for teacher in (DenseTeacher(p_logits), TopKTeacher(*p_logits.topk(13, dim=-1)[::-1])):  # a top-k teacher with k = V
        t, keep = sub.restrict(teacher)
        assert keep is None or bool(keep.all())
        s, n = chunked_distill_loss(hidden, sub.project(head), positions, t, name, vocab_size=sub.size + 1, chunk_size=4, **kw)
        torch.testing.assert_close(s / n, want.float())
        (g,) = torch.autograd.grad(s, hidden)
        assert torch.isfinite(g).all()


def test_subset_of_every_id_changes_nothing_and_labels_map_to_columns():
    hidden, head, positions, labels, p_logits = _setup(seed=5)
    sub = VocabSubset(torch.randperm(13, generator=torch.Generator().manual_seed(0)), 13)
    top = p_logits.topk(5, dim=-1)
    for name in LOSSES:
        a, _ = chunked_distill_loss(hidden, head, positions, TopKTeacher(top.indices, top.values), name, labels=labels, ce_weight=0.5)
        b, _ = chunked_distill_loss(hidden, sub.project(head), positions, sub.restrict(TopKTeacher(top.indices, top.values))[0],
                                    name, labels=sub.labels(labels), ce_weight=0.5, vocab_size=14)
        torch.testing.assert_close(a, b)
    small = VocabSubset(torch.tensor([4, 1]), 13)
    assert small.labels(torch.tensor([1, 4, 2, -100])).tolist() == [1, 0, -100, -100]


def test_subset_drops_teacher_rows_wholly_outside_and_scores_overlap_as_decoded():
    hidden, head, positions, _, p_logits = _setup(seed=6)
    ids = torch.tensor([0, 1, 2, 3])
    sub = VocabSubset(ids, 13)
    top = p_logits.topk(3, dim=-1)
    t, keep = sub.restrict(TopKTeacher(top.indices, top.values))
    assert torch.equal(keep, (top.indices < 4).any(-1)) and not bool(keep.all())
    # α_TF over the subset: Σ_x min(p(x), q_S(x)) with p over the full vocabulary (a normalised reference)
    logp = log_probs(p_logits)
    ref = TopKTeacher(*logp.topk(13, dim=-1)[::-1], normalized=True)
    s, n = chunked_overlap(hidden, sub.project(head), positions, sub.restrict(ref)[0], vocab_size=5)
    q_sub = torch.zeros_like(p_logits).index_copy_(1, ids, head(hidden[positions])[:, ids].softmax(-1)).detach()
    want = torch.minimum(logp.exp(), q_sub).sum(-1).mean()
    torch.testing.assert_close(float(s / n), float(want))
