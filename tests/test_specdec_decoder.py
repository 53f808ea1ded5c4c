"""The speculative decoder on tiny random models: greedy token equality with the target's own
generate(), sampled distributions (G-test), edge cases and bad input.

    pytest tests/test_specdec_decoder.py -q
"""
from __future__ import annotations

import pytest
import torch

from specdec import cache, lean, small_rows
from specdec.tiny import tiny_draft, tiny_model
from specdec import (
    Drafter,
    GammaPolicy,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingParams,
    SpeculativeDecoder,
    autoregressive_generate,
    logits_to_probs,
)
from specdec.drafters import DRAFT_VOCAB_FILE, frequent_tokens, load_draft_vocab, save_draft_vocab

EOS = 2  # tiny_config's eos_token_id


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models are dominated by per-op overhead; a second OpenMP thread only adds contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return tiny_draft(target, noise=0.04)  # partial acceptance: α ≈ 0.4-0.5


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompts, max_new_tokens, eos=EOS):
    """model.generate(do_sample=False) on a left-padded batch; each row cut after its first EOS."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)[:, S:].tolist()
    rows = []
    for r in out:
        rows.append(r[: r.index(eos) + 1] if eos is not None and eos in r else r)
    return rows


# -- greedy equivalence ---------------------------------------------------------------------------
@pytest.mark.parametrize("gamma,policy,lazy", [(1, "constant", True), (3, "constant", True), (3, "constant", False),
                                               (5, "constant", True), (2, "adaptive", False)])
def test_greedy_equals_target_generate_ragged_batch(target, draft, gamma, policy, lazy):
    prompts = _prompts([3, 9, 1, 6, 12, 2])
    ref = _hf_greedy(target, prompts, 40)
    dec = SpeculativeDecoder(target, draft, gamma=gamma, gamma_policy=policy, lazy_head=lazy)
    res = dec.generate(prompts, max_new_tokens=40)
    assert res.tokens == ref
    m = res.metrics
    assert 0.1 < m.acceptance_rate < 0.9, "the draft must be partly right for this test to mean anything"
    assert sum(1 for c in m.accepted_lengths if c) >= 2, "rows must accept different counts"
    assert res.finish_reasons == ["eos" if r[-1] == EOS and len(r) <= 40 and EOS in r else "length" for r in ref]


class _CheckedDrafter(ModelDrafter):
    """A ModelDrafter that checks every greedy proposal against the draft model run from scratch on
    the row's full context: its cache (holes, crops, carried tokens, dropped rows) must be exact."""

    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.contexts = [[t for t, m in zip(r, mr) if m] for r, mr in zip(context_ids.tolist(), context_mask.tolist())]
        self.checked = 0

    def propose(self, last_tokens, k, params, generator):
        tokens, probs = super().propose(last_tokens, k, params, generator)
        for ctx, last, prop in zip(self.contexts, last_tokens.tolist(), tokens.tolist()):
            ctx.append(last)
            ref = self.model.generate(torch.tensor([ctx]), max_new_tokens=k, do_sample=False, min_new_tokens=k,
                                      pad_token_id=0, eos_token_id=None)[0, len(ctx):].tolist()
            assert prop == ref
            self.checked += 1
        return tokens, probs

    def rollback(self, n_accepted, n_host):
        super().rollback(n_accepted, n_host)
        for ctx, prop, n in zip(self.contexts, self._proposal.tolist(), n_host):
            ctx.extend(prop[:n])

    def select_rows(self, rows):
        super().select_rows(rows)
        self.contexts = [self.contexts[i] for i in rows]


def test_draft_cache_stays_exact_across_rounds(target, draft):
    prompts = _prompts([3, 9, 1, 6], seed=6)
    checked = _CheckedDrafter(draft)
    res = SpeculativeDecoder(target, checked, gamma=3).generate(prompts, max_new_tokens=30)
    assert res.tokens == _hf_greedy(target, prompts, 30)
    assert checked.checked > 20 and 0.1 < res.metrics.acceptance_rate < 0.9


def test_greedy_equals_target_with_tensor_input_and_right_padding(target, draft):
    prompts = _prompts([5, 2, 7], seed=1)
    S = 7
    ids = torch.tensor([p + [0] * (S - len(p)) for p in prompts])  # right-padded on purpose
    mask = torch.tensor([[1] * len(p) + [0] * (S - len(p)) for p in prompts])
    res = SpeculativeDecoder(target, draft, gamma=4).generate(ids, attention_mask=mask, max_new_tokens=25)
    assert res.tokens == _hf_greedy(target, prompts, 25)


def test_greedy_prompt_lookup_equals_target(target):
    # the random tiny model falls into repetitions within 80 tokens of these prompts (46 46 46 ...)
    prompts = [[5, 6, 7], [10, 11, 12, 13] * 4, [99]]
    ref = _hf_greedy(target, prompts, 80, eos=None)
    dec = SpeculativeDecoder(target, PromptLookupDrafter(max_ngram=3), gamma=4, eos_token_id=[])
    res = dec.generate(prompts, max_new_tokens=80)
    assert res.tokens == ref
    assert res.metrics.accepted > 10
    assert res.metrics.draft_sampled is False
    sampled = dec.generate(prompts, max_new_tokens=30, temperature=1.0)  # one-hot q: still runs
    assert all(len(r) == 30 for r in sampled.tokens)


def test_prompt_lookup_finds_latest_longest_match():
    look = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    assert look.lookup([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]  # 3-gram [1, 2, 3] seen at 0
    assert look.lookup([1, 2, 3, 4, 7, 2, 3, 5, 6, 2, 3], 2) == [5, 6]  # latest of two 2-gram matches
    assert look.lookup([4, 5, 6], 3) == []  # no earlier occurrence of any suffix
    assert look.lookup([7, 1, 7], 4) == [1, 7]  # unigram fallback, continuation up to the end
    assert look.lookup([8], 2) == []


def test_autoregressive_generate_equals_target_generate(target):
    prompts = _prompts([4, 1, 8], seed=2)
    res = autoregressive_generate(target, prompts, max_new_tokens=30)
    assert res.tokens == _hf_greedy(target, prompts, 30)
    assert res.metrics.tokens_per_target_call == 1.0
    assert res.metrics.target_step_s > 0


def test_padded_logits_sliced_to_vocab_size(target):
    """Target and draft with different logit widths (padded embedding rows): compare the first 259."""
    wide = tiny_model(seed=3, vocab_size=320)
    prompts = _prompts([4, 6], seed=3)
    with pytest.raises(ValueError, match="vocab_size=len"):
        SpeculativeDecoder(target, wide)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeDecoder(target, wide, vocab_size=300)
    res = SpeculativeDecoder(target, wide, vocab_size=259, gamma=2).generate(prompts, max_new_tokens=20)
    assert res.tokens == _hf_greedy(target, prompts, 20)
    assert all(t < 259 for row in res.tokens for t in row)


# -- edge cases -----------------------------------------------------------------------------------
def test_draft_equal_to_target_accepts_everything(target):
    same = tiny_draft(target, noise=0.0)
    res = SpeculativeDecoder(target, same, gamma=3, eos_token_id=[]).generate([[5, 6, 7]], max_new_tokens=17)
    m = res.metrics
    assert m.acceptance_rate == 1.0 and m.rejections == 0
    # 4 rounds of γ+1 = 4 tokens, then one token left: a plain target step
    assert m.target_calls == 5 and m.emitted == 17
    assert m.accepted_lengths == [1, 0, 0, 4]
    assert res.tokens == _hf_greedy(target, [[5, 6, 7]], 17, eos=None)
    sampled = SpeculativeDecoder(target, same, gamma=3, eos_token_id=[]).generate(
        [[5, 6, 7]] * 4, max_new_tokens=16, temperature=1.0)
    assert sampled.metrics.acceptance_rate > 0.99  # p == q up to float rounding


class _WrongDrafter(Drafter):
    """Proposes token 0 every time: never the target's argmax in these tests."""

    def begin(self, context_ids, context_mask, vocab_size):
        pass

    def propose(self, last_tokens, k, params, generator):
        return torch.zeros(len(last_tokens), k, dtype=torch.long), None

    def rollback(self, n_accepted, n_host):
        pass

    def select_rows(self, rows):
        pass


def test_always_wrong_draft(target):
    prompts = _prompts([3, 5], seed=4)
    ref = _hf_greedy(target, prompts, 20)
    assert all(0 not in r for r in ref)
    res = SpeculativeDecoder(target, _WrongDrafter(), gamma=4).generate(prompts, max_new_tokens=20)
    assert res.tokens == ref
    assert res.metrics.acceptance_rate == 0.0 and res.metrics.tokens_per_target_call == 1.0
    sampled = SpeculativeDecoder(target, _WrongDrafter(), gamma=4).generate(prompts, max_new_tokens=20, temperature=1.0)
    assert sampled.metrics.acceptance_rate < 0.05


def test_eos_inside_an_accepted_block(target):
    same = tiny_draft(target, noise=0.0)
    free = _hf_greedy(target, [[5, 6, 7]], 20, eos=None)[0]
    # a token first seen at position j = 6: the second draft token of round two (γ = 4)
    j = next(i for i in range(6, 20) if free[i] not in free[:i])
    assert j < 9
    res = SpeculativeDecoder(target, same, gamma=4, eos_token_id=free[j]).generate([[5, 6, 7]], max_new_tokens=20)
    assert res.tokens == [free[: j + 1]] and res.finish_reasons == ["eos"]
    assert res.metrics.emitted == j + 1
    assert res.metrics.rejections == 0  # stopping is not a rejection
    # stop_token_ids at generate() do the same
    res2 = SpeculativeDecoder(target, same, gamma=4, eos_token_id=[]).generate(
        [[5, 6, 7]], max_new_tokens=20, stop_token_ids=[free[j]])
    assert res2.tokens == res.tokens


def test_gamma_larger_than_budget(target, draft):
    ref = _hf_greedy(target, [[8, 9]], 3, eos=None)
    res = SpeculativeDecoder(target, draft, gamma=10, eos_token_id=[]).generate([[8, 9]], max_new_tokens=3)
    assert res.tokens == ref and len(res.tokens[0]) == 3
    assert res.metrics.gamma_sum <= 2 + 1  # never more than budget − 1 proposals in a round
    assert max(len(res.metrics.tried_at), 0) <= 2


def test_budget_ends_inside_a_block(target, draft):
    # rows at different lengths: the shared γ exceeds what some rows have left
    prompts = _prompts([2, 7, 4, 3], seed=5)
    for max_new in (1, 2, 5, 13):
        ref = _hf_greedy(target, prompts, max_new, eos=None)
        res = SpeculativeDecoder(target, draft, gamma=4, eos_token_id=[]).generate(prompts, max_new_tokens=max_new)
        assert res.tokens == ref and all(len(r) == max_new for r in res.tokens)
        assert res.finish_reasons == ["length"] * 4


def test_adaptive_gamma_stays_in_bounds(target):
    same = tiny_draft(target, noise=0.0)
    dec = SpeculativeDecoder(target, same, gamma=2, gamma_policy="adaptive", gamma_min=1, gamma_max=5, eos_token_id=[])
    res = dec.generate([[5, 6, 7]], max_new_tokens=40)
    assert len(res.metrics.tried_at) == 5  # grew to gamma_max and no further
    pol = GammaPolicy(3, "adaptive", gamma_min=2, gamma_max=4)
    pol.update(3, [3]); assert pol.gamma == 4
    pol.update(4, [4]); assert pol.gamma == 4
    pol.update(4, [0]); assert pol.gamma == 3
    pol.update(3, [0, 1]); assert pol.gamma == 2
    pol.update(2, [0]); assert pol.gamma == 2
    pol.update(2, [1, 2]); assert pol.gamma == 2  # a partial round moves nothing


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lazy_head_verify_equals_full_verify(target, draft, temperature):
    """Skipping the LM head after a row's first rejection changes nothing: same tokens, same counters
    (so the statistical test below, which runs the default full path, covers the lazy path too)."""
    prompts = _prompts([3, 9, 1, 6, 12, 2] * 4, seed=7)
    runs = [SpeculativeDecoder(target, draft, gamma=3, lazy_head=lazy).generate(
        prompts, max_new_tokens=30, temperature=temperature, top_p=0.95 if temperature else 1.0, seed=3)
        for lazy in (True, False)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].metrics.accepted_lengths == runs[1].metrics.accepted_lengths
    assert 0.1 < runs[0].metrics.acceptance_rate < 0.9


def test_sampling_is_deterministic_per_seed(target, draft):
    dec = SpeculativeDecoder(target, draft, gamma=3)
    a = dec.generate([[5, 6], [7]], max_new_tokens=20, temperature=0.9, top_p=0.95, seed=1)
    b = dec.generate([[5, 6], [7]], max_new_tokens=20, temperature=0.9, top_p=0.95, seed=1)
    c = dec.generate([[5, 6], [7]], max_new_tokens=20, temperature=0.9, top_p=0.95, seed=2)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert a.metrics.draft_sampled is True


def test_metrics_are_consistent(target, draft):
    res = SpeculativeDecoder(target, draft, gamma=3).generate(_prompts([3, 6]), max_new_tokens=30)
    m = res.metrics
    assert m.emitted == sum(len(r) for r in res.tokens)
    assert m.tokens_per_target_call == pytest.approx(m.emitted / m.row_rounds)
    # τ = 1 + mean accepted, except that a row's last round may be cut (by EOS or the budget)
    assert m.row_rounds - 2 <= m.emitted - m.accepted <= m.row_rounds
    assert sum(m.accepted_lengths) == m.row_rounds
    assert m.draft_calls <= m.gamma_sum  # one draft forward per step serves the whole batch
    d = m.to_dict()
    assert d["cost_ratio"] > 0 and d["predicted_speedup"] > 0 and d["tokens_per_s"] > 0


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input(target, draft):
    with pytest.raises(ValueError, match="gamma must be"):
        SpeculativeDecoder(target, draft, gamma=0)
    with pytest.raises(ValueError, match="gamma_policy"):
        SpeculativeDecoder(target, draft, gamma_policy="fast")
    with pytest.raises(ValueError, match="gamma_min"):
        SpeculativeDecoder(target, draft, gamma=4, gamma_policy="adaptive", gamma_max=3)
    dec = SpeculativeDecoder(target, draft)
    with pytest.raises(ValueError, match="temperature"):
        dec.generate([[5]], temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        dec.generate([[5]], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        dec.generate([[5]], temperature=1.0, top_p=1.2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        dec.generate([[5], []])
    with pytest.raises(ValueError, match="no prompts"):
        dec.generate([])
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([[5]], max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        dec.generate([[5, 400]])


# -- sampling: distribution equals the target's (G-test) -----------------------------------------
def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, x/2), the regularized upper gamma."""
    half = lambda v: torch.tensor(v / 2, dtype=torch.float64)  # noqa: E731
    return float(torch.special.gammaincc(half(df), half(x)))


def _g_test(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of a G-test of counts [K] against probabilities [K]; small cells lumped into one."""
    n = counts.sum()
    e = expected_p * n
    big = e >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([e[big], e[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    g = 2 * float((obs * torch.log(obs.clamp(min=1e-300) / exp)).sum())
    return _chi2_sf(g, int(keep.sum()) - 1)


@torch.inference_mode()
def _exact_first_two(model, prompt, params):
    """Exact target distribution of the first two sampled tokens: [V, V] joint."""
    V = 259
    p1 = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1].double(), params)  # [V]
    ids = torch.cat([torch.tensor([prompt]).expand(V, -1), torch.arange(V)[:, None]], dim=1)  # [V, S+1]
    p2 = logits_to_probs(model(ids).logits[:, -1].double(), params)  # [V, V]
    return p1[:, None] * p2


@pytest.mark.parametrize("params",
                         [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.9)],
                         ids=["T1", "T0.8-k40-p0.9"])
def test_sampling_distribution_matches_target(target, draft, params):
    # N rows of one prompt in one batch; N is sized so that a 2% TV shift between the two most
    # likely cells (the hardest place to see it) is rejected, which the test checks below.
    prompt, N = [5, 17, 42], 20_000
    dec = SpeculativeDecoder(target, draft, gamma=2, eos_token_id=[])
    res = dec.generate([prompt] * N, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                       top_p=params.top_p, seed=11)
    assert 0.2 < res.metrics.acceptance_rate < 0.9
    first_two = torch.tensor([r[:2] for r in res.tokens])  # [N, 2]
    counts = torch.bincount(first_two[:, 0] * 259 + first_two[:, 1], minlength=259 * 259).double()
    joint = _exact_first_two(target, prompt, params).reshape(-1)
    assert _g_test(counts, joint) > 1e-3
    # the same samples reject a 2% total-variation shift of the truth (the test has that power)
    shifted = joint.clone()
    top = torch.topk(joint, 2).indices
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert _g_test(counts, shifted) < 1e-3
    # the third token (from a later round for most rows) against plain target sampling
    base = autoregressive_generate(target, [prompt] * N, max_new_tokens=3, temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p, seed=12, eos_token_id=[])
    third_spec = torch.bincount(torch.tensor([r[2] for r in res.tokens]), minlength=259).double()
    third_base = torch.bincount(torch.tensor([r[2] for r in base.tokens]), minlength=259).double()
    # two-sample test: G-test of the 2 x K table
    table = torch.stack([third_spec, third_base])  # [2, K]
    table = table[:, table.sum(0) >= 10]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    g = 2 * float((table * torch.log(table.clamp(min=1e-300) / expected)).sum())
    assert _chi2_sf(g, table.shape[1] - 1) > 1e-3


@pytest.mark.parametrize("transposed", [False, True])
def test_small_rows_kernels_compute_the_same_linear(transposed, monkeypatch):
    from specdec import kv

    lin = torch.nn.Linear(24, 40)
    x = torch.randn(1, 5, 24)
    monkeypatch.setattr(small_rows, "_CHOICE", {(40, 24, 5, torch.get_num_threads(), lin.weight.dtype): transposed})
    with torch.inference_mode():
        plain = lin(x)
        with small_rows.small_rows_kernels():
            assert torch.nn.Linear.forward is not small_rows._plain_linear_forward
            fast = lin(x)
            one_row = lin(x[:, :1])  # a single row keeps the plain kernel
    assert torch.nn.Linear.forward is small_rows._plain_linear_forward  # restored
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one_row, plain[:, :1], rtol=1e-5, atol=1e-6)


def test_small_rows_kernel_choice_is_timed_once_per_shape(monkeypatch):
    from specdec import kv

    calls = []
    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "_PACKING", False)
    monkeypatch.setattr(small_rows, "_faster_transposed", lambda w, x: calls.append((tuple(w.shape), x.shape[0])) or True)
    lin = torch.nn.Linear(8, 16)
    with torch.inference_mode(), small_rows.small_rows_kernels():
        for _ in range(3):
            lin(torch.randn(3, 8))
        lin(torch.randn(2, 3, 8))  # 6 rows: another shape
    assert calls == [((16, 8), 3), ((16, 8), 6)]


@pytest.mark.parametrize("transposed_wins", [False, True])
def test_kv_model_stops_wrapping_a_row_count_the_plain_kernel_serves(target, transposed_wins, monkeypatch):
    from specdec import kv

    monkeypatch.setattr(small_rows, "_CHOICE", {})
    monkeypatch.setattr(small_rows, "_faster_transposed", lambda w, x: transposed_wins)
    wrapped = []
    real = small_rows._small_rows_linear_forward
    monkeypatch.setattr(small_rows, "_small_rows_linear_forward", lambda self, x: wrapped.append(x.shape) or real(self, x))
    m = kv.KVModel(target)
    with torch.inference_mode():
        m.prefill(torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.bool))
        for i in range(3):  # 2-token steps: timed on the first, then plain only if nothing chose otherwise
            before = len(wrapped)
            m.step(torch.tensor([[9, 10]]), keep=2)
            m.rollback(2, torch.zeros(1, dtype=torch.long), [0])
            calls = len(wrapped) - before
            assert calls > 0 if transposed_wins or i == 0 else calls == 0
    assert small_rows.plain_kernels_suffice(2) is not transposed_wins
    assert torch.nn.Linear.forward is small_rows._plain_linear_forward


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="MKL prepacked GEMM needs an MKL build")
def test_packed_kernel_equals_linear_and_repacks_an_updated_weight():
    from specdec import kv

    lin = torch.nn.Linear(24, 40)
    x = torch.randn(2, 3, 24)  # 6 rows: the packed path
    with torch.inference_mode():
        with small_rows.small_rows_kernels():
            fast = lin(x)
        torch.testing.assert_close(fast, lin(x), rtol=1e-5, atol=1e-5)
        assert list(small_rows._PACKED[lin]) and all(k[0] == 6 for k in small_rows._PACKED[lin])
        with torch.no_grad():
            lin.weight.mul_(2.0)  # an in-place update (an optimizer step) invalidates the packed copy
        with small_rows.small_rows_kernels():
            fast = lin(x)
        torch.testing.assert_close(fast, lin(x), rtol=1e-5, atol=1e-5)
        assert len(small_rows._PACKED[lin]) == 1


# -- draft vocabulary: the draft's LM head restricted to a token subset ----------------------------
def _subset(target, prompts, size=120, drop=8):
    """The `size` ids the target's greedy answers use most, minus `drop` of them it does emit: rounds
    whose target token lies outside the subset must reject there."""
    ref = _hf_greedy(target, prompts, 40, eos=None)
    ids = frequent_tokens(ref, size, 259)
    used = sorted({t for r in ref for t in r})
    gone = set(used[:: max(1, len(used) // drop)][:drop])
    return ids[~torch.isin(ids, torch.tensor(sorted(gone)))], gone


class _RecordingDrafter(ModelDrafter):
    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.proposed, self.qs = set(), []

    def propose(self, last_tokens, k, params, generator):
        tokens, q = super().propose(last_tokens, k, params, generator)
        self.proposed.update(tokens.flatten().tolist())
        if q is not None:
            self.qs.append(q)
        return tokens, q


def test_draft_vocab_greedy_equals_target_and_proposes_only_the_subset(target, draft):
    prompts = _prompts([3, 9, 1, 6, 12, 2], seed=8)
    ids, gone = _subset(target, prompts)
    ref = _hf_greedy(target, prompts, 40, eos=None)
    assert any(t in gone for r in ref for t in r), "the target must emit tokens outside the subset"
    drafter = _RecordingDrafter(draft, vocab=ids)
    res = SpeculativeDecoder(target, drafter, gamma=3, eos_token_id=[]).generate(prompts, max_new_tokens=40)
    assert res.tokens == ref
    assert drafter.proposed <= set(ids.tolist()) and drafter.proposed
    assert 0.05 < res.metrics.acceptance_rate < 0.95


def test_draft_vocab_of_every_token_proposes_what_the_full_head_does(target, draft):
    prompts = _prompts([4, 7, 2], seed=9)
    full = _RecordingDrafter(draft)
    every = _RecordingDrafter(draft, vocab=torch.arange(259))
    outs = [SpeculativeDecoder(target, d, gamma=3).generate(prompts, max_new_tokens=24, temperature=1.0, seed=3)
            for d in (full, every)]
    assert outs[0].tokens == outs[1].tokens
    for q_full, q_every in zip(full.qs, every.qs):
        torch.testing.assert_close(q_every, q_full, rtol=1e-5, atol=1e-6)


def test_draft_vocab_q_is_the_subset_softmax_and_zero_elsewhere(target, draft):
    prompt = [5, 17, 42]
    ids, _ = _subset(target, [prompt])
    drafter = _RecordingDrafter(draft, vocab=ids)
    SpeculativeDecoder(target, drafter, gamma=1, eos_token_id=[]).generate([prompt], max_new_tokens=2,
                                                                            temperature=0.7, seed=0)
    q = drafter.qs[0][0, 0]  # [V]: the first proposal's distribution
    with torch.inference_mode():
        logits = draft(torch.tensor([prompt])).logits[0, -1]
    expect = torch.zeros(259)
    expect[ids] = torch.softmax(logits[ids] / 0.7, -1)
    torch.testing.assert_close(q, expect, rtol=1e-4, atol=1e-6)


def test_draft_vocab_sampling_distribution_matches_target(target, draft):
    # As test_sampling_distribution_matches_target, with a subset that misses tokens the target
    # samples often: the residual must put their mass back.
    prompt, N = [5, 17, 42], 20_000
    params = SamplingParams(temperature=1.0)
    joint = _exact_first_two(target, prompt, params)  # [V, V]
    out = torch.cat([torch.topk(joint.sum(1), 3).indices[1:], torch.topk(joint.sum(0), 3).indices[1:]])
    ids = torch.tensor([t for t in range(259) if t not in out.tolist()])  # 2nd, 3rd likeliest 1st/2nd tokens: out
    assert joint.sum(1)[out[:2]].sum() > 0.05
    dec = SpeculativeDecoder(target, ModelDrafter(draft, vocab=ids), gamma=2, eos_token_id=[])
    res = dec.generate([prompt] * N, max_new_tokens=3, temperature=1.0, seed=13)
    assert 0.1 < res.metrics.acceptance_rate < 0.9
    first_two = torch.tensor([r[:2] for r in res.tokens])
    counts = torch.bincount(first_two[:, 0] * 259 + first_two[:, 1], minlength=259 * 259).double()
    assert _g_test(counts, joint.reshape(-1)) > 1e-3


class _ScaledLogits(torch.nn.Module):
    """A causal LM whose logits are not head(hidden): what a draft vocabulary cannot serve."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.base_model = model, model.config, model.model

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits * 2.0
        return out


def test_draft_vocab_bad_input(target, draft, tmp_path):
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        ModelDrafter(draft, vocab=[5, 300])
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        ModelDrafter(draft, vocab=[])
    with pytest.raises(ValueError, match="vocab_size=200"):
        SpeculativeDecoder(target, ModelDrafter(draft, vocab=[5, 250]), vocab_size=200).generate([[5, 6]])
    with pytest.raises(ValueError, match="LM head applied to the last hidden state"):
        SpeculativeDecoder(target, ModelDrafter(_ScaledLogits(draft), vocab=[5, 6])).generate([[5, 6]])
    (tmp_path / DRAFT_VOCAB_FILE).write_text("[1, 2")
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        load_draft_vocab(tmp_path)
    with pytest.raises(ValueError, match="size must be"):
        frequent_tokens([[1]], 0, 259)


def test_frequent_tokens_ranks_by_count_then_fills_with_lowest_ids(tmp_path):
    ids = frequent_tokens([[9, 9, 9, 7, 7, 300], [5, 7, 9]], 5, vocab_size=259)
    # counts: 9 x4, 7 x3, 5 x1 (300 is outside the vocabulary); then the lowest unused ids 0, 1
    assert ids.tolist() == [0, 1, 5, 7, 9]
    assert frequent_tokens([[9, 9, 7, 7, 5]], 2, vocab_size=259).tolist() == [7, 9]  # tie 7/9 beats 5
    assert load_draft_vocab(tmp_path) is None
    save_draft_vocab(tmp_path, ids, source="test")
    assert load_draft_vocab(tmp_path).tolist() == ids.tolist()
    assert not list(tmp_path.glob(".*.tmp"))


def _tokenizer_with_specials_first():
    """Ids 0-2 specials, 3-7 added <unused*> slots, 8-12 plain <unused*> tokens, 13-15 words, 16-21 single
    characters: the layout of vocabularies whose lowest ids are not the useful ones."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", *[f"<unused{i}>" for i in range(10)], "the", "and", "of", *"abcde", "x"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.add_tokens([f"<unused{i}>" for i in range(5)])  # already in the vocabulary: marked added, same ids
    assert tok.convert_tokens_to_ids(["<unused0>", "the", "a"]) == [3, 13, 16] and len(tok) == 22
    return tok


def test_frequent_tokens_fill_with_single_characters_never_specials():
    from specdec.drafters import single_char_tokens

    tok = _tokenizer_with_specials_first()
    assert single_char_tokens(tok, 22) == [16, 17, 18, 19, 20, 21]
    assert frequent_tokens([[14, 14, 17]], 6, 22).tolist() == [0, 1, 2, 3, 14, 17]  # no tokenizer: lowest ids
    assert frequent_tokens([[14, 14, 17]], 6, 22, tok).tolist() == [14, 16, 17, 18, 19, 20]
    # past the single characters: plain tokens by id (the <unused*> entries of the model's own vocabulary
    # too: nothing marks them), specials and added tokens only when nothing else is left
    assert frequent_tokens([[1]], 12, 22, tok).tolist() == [1, 8, 9, 10, 11, 12, 16, 17, 18, 19, 20, 21]
    assert frequent_tokens([], 17, 22, tok).tolist() == [0, 1, 2, *range(8, 22)]  # 14 non-excluded, then 0-2
    assert frequent_tokens([[1, 1]], 3, 22, tok).tolist() == [1, 16, 17]  # a special that occurs still counts


# -- the lean forward (Llama-style models, steps without masked columns) ---------------------------
def test_lean_forward_equals_the_models_forward(target):
    from specdec import kv

    assert lean.lean_forward_ok(target)
    ids = torch.tensor(_prompts([9], seed=5))  # [1, 9]
    with torch.inference_mode():
        ref = target(input_ids=ids).logits  # one uncached pass: the reference for every position
        m = kv.KVModel(target)
        assert m.lean
        m.prefill(ids[:, :4], torch.ones(1, 4, dtype=torch.bool))
        got = [m.step(ids[:, 4:5]), m.step(ids[:, 5:8], keep=3), m.step(ids[:, 8:9])]  # 1, 3, 1 tokens
        m.rollback(1, torch.tensor([0]), [0])  # crop, then step again: the cache stays consistent
        again = m.step(ids[:, 8:9])
    torch.testing.assert_close(torch.cat(got, dim=1), ref[:, 4:9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, ref[:, 8:9], rtol=1e-4, atol=1e-4)
    assert all(lean._QKV[layer.self_attn][1] is not None for layer in target.model.layers)  # stacked q, k, v ran


def test_stacked_qkv_follows_the_weights_and_biases():
    from specdec import kv

    attn = tiny_model(seed=3).model.layers[0].self_attn
    x = torch.randn(2, 3, attn.q_proj.in_features)
    def check():
        with torch.inference_mode():
            fused = lean._fused_qkv(attn)
            want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
            torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-6)
            assert lean._fused_qkv(attn) is fused  # kept while nothing changes
        return fused

    first = check()
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # an in-place update (an optimizer step): stacked again
    second = check()
    assert second is not first
    for p in (attn.q_proj, attn.k_proj, attn.v_proj):
        p.bias = torch.nn.Parameter(torch.randn(p.out_features))
    assert check().bias is not None
    attn.v_proj.bias = None  # mixed biases: no stacking
    with torch.inference_mode():
        assert lean._fused_qkv(attn) is None
    assert lean._fused_qkv(tiny_model(seed=3).model.layers[0].self_attn) is None  # autograd on: never stacked


def test_lean_forward_is_refused_for_other_models(target, monkeypatch):
    from specdec import kv

    other = tiny_model(seed=4)
    other.config.final_logit_softcapping = 30.0  # a feature the lean forward does not model
    assert not lean.lean_forward_ok(other)
    assert not kv.KVModel(other).lean


def _kv_script(make, prompts, extra):
    """One sequence of KVModel operations with left padding, holes, rollback, absorb and row selection
    on KVModels from make(); returns the first KVModel and every logits tensor it produced."""
    from specdec.decoder import left_pad

    m, out = make(), []
    ids, mask = left_pad(prompts, None, 0, m.device)
    m.prefill(ids[:, :-1], mask[:, :-1])
    out.append(m.step(ids[:, -1:]))
    out.append(m.step(torch.tensor([[5, 6, 7], [8, 9, 10]]), keep=3))
    m.rollback(3, torch.tensor([1, 3]), [1, 3])  # rows keep different counts: holes for row 0
    out.append(m.step(torch.tensor([[11], [12]])))
    other = make()
    ids2, mask2 = left_pad(extra, None, 0, m.device)
    other.prefill(ids2, mask2)
    m.absorb(other)
    out.append(m.step(torch.tensor([[13], [14], [15]])))
    m.select_rows(torch.tensor([0, 2]))
    out.append(m.step(torch.tensor([[16, 17], [18, 19]]), keep=2))
    return m, out


def test_select_rows_drops_the_columns_no_kept_row_attends_to(target):
    """A short row kept from a batch with a long one: the cache shrinks to the short row's own span and
    its next logits equal the row decoded alone; absorbing a row afterwards pads only to that span."""
    from specdec import kv
    from specdec.decoder import left_pad

    (short, long_), (extra,) = _prompts([2, 9], seed=10), _prompts([4], seed=11)
    with torch.inference_mode():
        m = kv.KVModel(target)
        ids, mask = left_pad([short, long_], None, 0, m.device)
        m.prefill(ids, mask)
        m.step(torch.tensor([[20], [21]]))
        assert m.length == 10
        m.select_rows(torch.tensor([0]))
        assert m.length == 3 and m.cache.get_seq_length() == 3 and bool(m.mask[:, :3].all()) and not m.holes
        got = m.step(torch.tensor([[22]]))
        alone = kv.KVModel(target)
        alone.prefill(torch.tensor([short + [20]]), torch.ones(1, 3, dtype=torch.bool))
        torch.testing.assert_close(got, alone.step(torch.tensor([[22]])), rtol=1e-5, atol=1e-5)
        other = kv.KVModel(target)
        other.prefill(torch.tensor([extra]), torch.ones(1, 4, dtype=torch.bool))
        m.absorb(other)
        assert m.length == 4  # max(4, 4): not the 11 columns the batch had before the long row left


def test_lean_forward_with_masked_columns_and_growing_cache_equal_the_models_forward(target, monkeypatch):
    from transformers import DynamicCache

    from specdec import kv

    prompts, extra = _prompts([3, 7], seed=8), _prompts([5], seed=9)
    with torch.inference_mode():
        fast, got = _kv_script(lambda: kv.KVModel(target), prompts, extra)
        assert fast.lean
        assert all(isinstance(x, cache.GrowingLayer) for x in fast.cache.layers)
        ptr = fast.cache.layers[0].keys.data_ptr()
        fast.step(torch.tensor([[20], [21]]))
        assert fast.cache.layers[0].keys.data_ptr() == ptr  # appended in place, not copied
        monkeypatch.setattr(kv, "new_cache", lambda model: DynamicCache(config=model.config))

        def reference():  # the model's own forward and transformers' concatenating cache
            return kv.KVModel(target, fast=False)

        _, ref = _kv_script(reference, prompts, extra)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
