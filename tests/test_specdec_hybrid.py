"""The hybrid drafter (prompt lookup where it matches, the model elsewhere): greedy output identical to
the target's in ragged batches where rows switch between the two, exact replay, and sampled output
with the target's distribution (G-test)."""
from __future__ import annotations

import pytest
import torch
from test_specdec_decoder import _chi2_sf, _g_test
from test_specdec_replay import COUNTERS, EOS, llama, noisy

from specdec import PromptLookupDrafter, SpeculativeDecoder, autoregressive_generate
from specdec.hybrid import HybridDrafter
from specdec.replay import draft_argmax, hybrid_proposals, replay
from specdec.sampling import SamplingParams, logits_to_probs

V = 40


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = llama(0, V)
    return target, noisy(target, 0.35)


def repetitive(n: int, seed: int = 7) -> list[list[int]]:
    """Prompts made of a few repeated n-grams, so lookup matches in some rounds and not in others."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        motif = torch.randint(3, V, (3,), generator=g).tolist()
        out.append(torch.randint(3, V, (2,), generator=g).tolist() + motif * int(torch.randint(1, 4, (1,), generator=g))
                   + torch.randint(3, V, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist())
    return out


class Spy(HybridDrafter):
    """Counts rounds by which part proposed them."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lookup_rows = self.model_rows = 0

    def propose(self, last_tokens, k, params, generator):
        out = super().propose(last_tokens, k, params, generator)
        self.model_rows += sum(self._model_rows)
        self.lookup_rows += len(self._model_rows) - sum(self._model_rows)
        return out


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_equals_target_with_rows_switching_parts(models, gamma):
    target, draft = models
    ps = repetitive(6)
    ref = autoregressive_generate(target, ps, max_new_tokens=30, eos_token_id=EOS).tokens
    spy = Spy(draft)
    res = SpeculativeDecoder(target, spy, gamma=gamma, eos_token_id=EOS).generate(ps, max_new_tokens=30)
    assert res.tokens == ref
    assert spy.lookup_rows > 0 and spy.model_rows > 0  # both parts proposed, in one batch
    assert 0 < res.metrics.acceptance_rate < 1


def test_draft_vocabulary_and_adaptive_gamma(models):
    target, draft = models
    ps = repetitive(4, seed=3)
    ref = autoregressive_generate(target, ps, max_new_tokens=25, eos_token_id=EOS).tokens
    dec = SpeculativeDecoder(target, HybridDrafter(draft, vocab=torch.arange(0, V, 2)), gamma=2,
                             gamma_policy="adaptive", eos_token_id=EOS)
    assert dec.generate(ps, max_new_tokens=25).tokens == ref


@pytest.mark.parametrize("gamma,policy", [(1, "constant"), (3, "constant"), (2, "adaptive")])
def test_replay_equals_decoding(models, gamma, policy):
    target, draft = models
    for p in repetitive(5, seed=11):
        y = autoregressive_generate(target, [p], max_new_tokens=24, eos_token_id=EOS).tokens[0]
        res = SpeculativeDecoder(target, HybridDrafter(draft), gamma=gamma, gamma_policy=policy,
                                 eos_token_id=EOS).generate([p], max_new_tokens=24)
        got = replay(y, hybrid_proposals(p, y, draft_argmax(draft, p, y)[0]), gamma, 24, {EOS}, gamma_policy=policy)
        assert {k: getattr(got, k) for k in COUNTERS} == {k: getattr(res.metrics, k) for k in COUNTERS}


def test_hybrid_accepts_at_least_what_lookup_alone_accepts_when_lookup_matches(models):
    target, draft = models
    p = [5, 9, 13, 21, 5, 9, 13, 21, 5, 9]
    alone = SpeculativeDecoder(target, PromptLookupDrafter(), gamma=2, eos_token_id=EOS).generate([p], max_new_tokens=20)
    both = SpeculativeDecoder(target, HybridDrafter(draft), gamma=2, eos_token_id=EOS).generate([p], max_new_tokens=20)
    assert both.tokens == alone.tokens
    assert both.metrics.proposed >= alone.metrics.proposed  # the model fills the rounds lookup leaves empty


@torch.inference_mode()
def test_sampling_distribution_matches_target(models):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    prompt, N = [5, 17, 22, 5, 17], 20_000  # "5 17" repeats: lookup matches in round one, not always later
    spy = Spy(draft)
    res = SpeculativeDecoder(target, spy, gamma=2, eos_token_id=[]).generate(
        [prompt] * N, max_new_tokens=4, temperature=1.0, seed=5)
    assert spy.lookup_rows > 0 and spy.model_rows > 0
    p1 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1].double(), params)  # [V]
    ids = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V)[:, None]], dim=1)
    joint = (p1[:, None] * logits_to_probs(target(ids).logits[:, -1].double(), params)).reshape(-1)
    first_two = torch.tensor([r[:2] for r in res.tokens])
    counts = torch.bincount(first_two[:, 0] * V + first_two[:, 1], minlength=V * V).double()
    assert _g_test(counts, joint) > 1e-3
    # tokens 3 and 4 (later rounds, mixed lookup and model rows) against plain target sampling
    base = autoregressive_generate(target, [prompt] * N, max_new_tokens=4, temperature=1.0, seed=6, eos_token_id=[])
    for j in (2, 3):
        spec = torch.bincount(torch.tensor([r[j] for r in res.tokens]), minlength=V).double()
        plain = torch.bincount(torch.tensor([r[j] for r in base.tokens]), minlength=V).double()
        table = torch.stack([spec, plain])
        table = table[:, table.sum(0) >= 10]
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        g = 2 * float((table * torch.log(table.clamp(min=1e-300) / expected)).sum())
        assert _chi2_sf(g, table.shape[1] - 1) > 1e-3
