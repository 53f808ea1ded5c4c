"""Exact greedy replay equals decoding: the same counters (rounds, proposals, acceptances, histograms)
for model drafts and prompt lookup, γ = 1..4 and the adaptive policy, with stop tokens and budget ends
inside a round. Tiny random Llamas built here (specdec is tested without the distill package)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, autoregressive_generate
from specdec.metrics import bootstrap_ci
from specdec.replay import draft_argmax, lookup_proposals, model_proposals, replay

EOS = 2
COUNTERS = ("target_calls", "row_rounds", "draft_calls", "proposed", "accepted", "rejections", "emitted",
            "gamma_sum", "tried_at", "accepted_at", "accepted_lengths")


def llama(seed: int, vocab: int = 40, layers: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.5, eos_token_id=EOS, pad_token_id=0, bos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def noisy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    out = llama(0, model.config.vocab_size, model.config.num_hidden_layers)
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    for p in out.parameters():
        p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return out


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = llama(0)
    return target, noisy(target, 0.35)


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # small alphabets repeat n-grams, so prompt lookup finds matches
    return [torch.randint(3, 12, (int(torch.randint(4, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def counters(m) -> dict:
    return {k: getattr(m, k) for k in COUNTERS}


@pytest.mark.parametrize("gamma,policy", [(1, "constant"), (2, "constant"), (3, "constant"), (4, "constant"),
                                          (2, "adaptive")])
@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_replay_counts_equal_decoded_counts(models, gamma, policy, kind):
    target, draft = models
    max_new = 23
    ps = prompts(6)
    # batch > 1 for the reference answers: replay needs only y, however it was produced
    ys = autoregressive_generate(target, ps, max_new_tokens=max_new, eos_token_id=EOS).tokens
    assert any(y[-1] == EOS and len(y) < max_new for y in ys), "want a stop token inside the budget"
    drafter = (lambda: draft) if kind == "model" else PromptLookupDrafter
    accepted = 0
    for p, y in zip(ps, ys):
        dec = SpeculativeDecoder(target, drafter(), gamma=gamma, gamma_policy=policy, eos_token_id=EOS)
        res = dec.generate([p], max_new_tokens=max_new)
        assert res.tokens[0] == y
        prop = model_proposals(draft_argmax(draft, p, y)[0]) if kind == "model" else lookup_proposals(p, y)
        got = replay(y, prop, gamma, max_new, {EOS}, gamma_policy=policy)
        assert counters(got) == counters(res.metrics)
        accepted += got.accepted
    assert accepted > 0  # partial acceptance, not a draft that never matches


def test_replay_with_a_draft_vocabulary_and_budget_inside_a_round(models):
    target, draft = models
    vocab = torch.arange(0, 40, 2)  # misses half the tokens the target emits
    p = prompts(1, seed=5)[0]
    for max_new in (5, 6, 7):
        y = autoregressive_generate(target, [p], max_new_tokens=max_new, eos_token_id=EOS, stop_token_ids=[]).tokens[0]
        res = SpeculativeDecoder(target, ModelDrafter(draft, vocab=vocab), gamma=4, eos_token_id=EOS).generate(
            [p], max_new_tokens=max_new)
        got = replay(y, model_proposals(draft_argmax(draft, p, y, vocab=vocab)[0]), 4, max_new, {EOS})
        assert counters(got) == counters(res.metrics)


def test_draft_equal_to_target_accepts_all_but_the_bonus(models):
    target, _ = models
    p = prompts(1)[0]
    y = autoregressive_generate(target, [p], max_new_tokens=20, eos_token_id=EOS, stop_token_ids=[]).tokens[0]
    pred, gap = draft_argmax(target, p, y)
    assert pred == y and min(gap) >= 0
    m = replay(y, model_proposals(pred), 3, 20, {EOS})
    assert m.rejections == 0 and m.acceptance_rate == 1.0


def test_replay_refuses_an_answer_that_is_not_complete():
    with pytest.raises(ValueError, match="greedy answer"):
        replay([5, 6, 7], model_proposals([5, 6, 7]), 2, 10, {EOS})
    with pytest.raises(ValueError, match="greedy answer"):
        replay([5, EOS, 7], model_proposals([5, 6, 7]), 2, 3, {EOS})


def test_bootstrap_interval_hand_computed_cases():
    # two prompts with ratios 1 and 3 (equal weight): resamples give 1, 2 or 3 with p = 1/4, 1/2, 1/4
    lo, hi = bootstrap_ci([1.0, 3.0], [1.0, 1.0], resamples=4000, seed=0)
    assert (lo, hi) == (1.0, 3.0)
    lo, hi = bootstrap_ci([1.0, 3.0], [1.0, 1.0], level=0.5, resamples=4000, seed=0)
    assert (lo, hi) == (2.0, 2.0)  # the middle half of the resamples is the mixed pair
    # every prompt at the same rate: the interval is that rate, whatever the weights
    assert bootstrap_ci([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == [2.0, 2.0]
    assert bootstrap_ci([], []) is None
    assert bootstrap_ci([3.0], [1.0]) is None  # one prompt: no spread to resample, no interval
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], [1.0, 2.0])
