"""Sliding-window models in the speculative decoder: caches that roll back past the window, and the
window counted in each row's real tokens when rows have holes.

Tiny random models with 16-token windows (specdec.tiny.ZOO): Mistral (every layer windowed, SDPA),
Gemma 2 (windowed and full layers alternating, eager attention: additive masks), Qwen2 (layer 0 full,
the rest windowed). Every sequence here runs 4+ windows long.

    pytest tests/test_specdec_window.py -q
"""
from __future__ import annotations

import pytest
import torch
from test_specdec_decoder import _exact_first_two, _g_test, _prompts

from specdec.tiny import WINDOW, tiny_draft, tiny_zoo_model
from specdec import SamplingParams, SpeculativeDecoder
from specdec.decoder import left_pad
from specdec.kv import KVModel, attention_windows

# family -> draft noise giving partial acceptance (α ≈ 0.3-0.7 under greedy)
FAMILIES = {"mistral": 0.03, "gemma2": 0.15, "qwen2": 0.05}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = tiny_zoo_model(request.param, seed=0)
    return request.param, target, tiny_draft(target, noise=FAMILIES[request.param])


def test_windows_are_read_from_the_models_cache_layers():
    assert attention_windows(tiny_zoo_model("mistral")) == {"sliding_attention": WINDOW}
    assert attention_windows(tiny_zoo_model("gemma2")) == {"sliding_attention": WINDOW, "full_attention": None}
    assert attention_windows(tiny_zoo_model("qwen2")) == {"full_attention": None, "sliding_attention": WINDOW}
    assert attention_windows(tiny_zoo_model("llama")) == {}
    assert attention_windows(tiny_zoo_model("qwen2", use_sliding_window=False)) == {}


@torch.inference_mode()
def test_kv_steps_with_holes_equal_the_full_forward_past_the_window(pair):
    """Steps, ragged rollbacks (holes), absorb and row selection on a windowed model: every logit equals
    the model run without a cache on the row's real tokens (transformers' own windowed mask)."""
    _, model, _ = pair
    g = torch.Generator().manual_seed(3)
    rows = _prompts([5, 23, 12], seed=1)
    kv = KVModel(model)
    ids, mask = left_pad(rows, None, 0, kv.device)
    kv.prefill(ids, mask)
    holes_past_window = 0
    for r in range(30):
        if r == 10:  # a new row joins mid-stream (continuous batching), then one leaves
            other = KVModel(model)
            extra = _prompts([9], seed=2)
            other.prefill(torch.tensor(extra), torch.ones(1, 9, dtype=torch.bool))
            kv.absorb(other)
            rows += extra
        if r == 20:
            kv.select_rows(torch.tensor([0, 2, 3]))
            rows = [rows[i] for i in (0, 2, 3)]
        q = 4
        new = torch.randint(3, 259, (len(rows), q), generator=g)
        got = kv.step(new, keep=q)  # [B, q, V]
        for b, row in enumerate(rows):
            full = row + new[b].tolist()
            ref = model(input_ids=torch.tensor([full])).logits[0, -q:]  # [q, V]
            torch.testing.assert_close(got[b], ref, rtol=1e-4, atol=1e-4)
        keep = torch.randint(1, q + 1, (len(rows),), generator=g)
        keep_host = keep.tolist()
        kv.rollback(q, keep, keep_host)
        rows = [row + new[b, :k].tolist() for b, (row, k) in enumerate(zip(rows, keep_host))]
        holes_past_window += kv.holes and min(len(r) for r in rows) > 2 * WINDOW
    assert min(len(r) for r in rows) > 4 * WINDOW
    assert holes_past_window > 5, "the rows must carry holes once they are past the window"


def test_greedy_speculative_equals_target_past_the_window(pair):
    family, target, draft = pair
    prompts = _prompts([3, 20, 1, 9], seed=4)
    max_new = 4 * WINDOW + 8
    ref = [target.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # one row: no padding at all
    for gamma in (2, 4):
        res = SpeculativeDecoder(target, draft, gamma=gamma, eos_token_id=[]).generate(prompts, max_new_tokens=max_new)
        assert res.tokens == ref, f"{family} gamma={gamma}"
        m = res.metrics
        assert 0.1 < m.acceptance_rate < 0.9, "the draft must be partly right for this test to mean anything"
        assert len(set(m.accepted_lengths)) > 2, "rows must accept different counts (holes)"


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0)], ids=["T1"])
def test_sampling_distribution_matches_target_past_the_window(params):
    """The joint of the first two sampled tokens after a prompt longer than the window, against the exact
    distribution (no cache). Rows that reject in round one draw their second token in round two,
    through the per-row windowed mask of a batch with holes."""
    target = tiny_zoo_model("mistral", seed=0)
    draft = tiny_draft(target, noise=0.02)
    prompt, N = _prompts([WINDOW + 4], seed=5)[0], 20_000  # generated tokens no longer see the first ones
    res = SpeculativeDecoder(target, draft, gamma=2, eos_token_id=[]).generate(
        [prompt] * N, max_new_tokens=2, temperature=params.temperature, seed=13)
    assert 0.2 < res.metrics.acceptance_rate < 0.9
    first_two = torch.tensor([r[:2] for r in res.tokens])  # [N, 2]
    counts = torch.bincount(first_two[:, 0] * 259 + first_two[:, 1], minlength=259 * 259).double()
    joint = _exact_first_two(target, prompt, params).reshape(-1)
    assert _g_test(counts, joint) > 1e-3
    shifted = joint.clone()  # the same samples reject a 2% total-variation shift (the test has power)
    top = torch.topk(joint, 2).indices
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert _g_test(counts, shifted) < 1e-3
