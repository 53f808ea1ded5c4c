"""Feature heads (specdec/heads.py, specdec/head_drafter.py) on tiny random models: lossless decoding
(greedy identity on ragged batches, a G-test at T = 1), exact replay of the proposals, save/reload in
the EAGLE-3 layout, bad input.

    pytest tests/test_heads.py -q
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdec.tiny import tiny_model
from specdec import SamplingParams, SpeculativeDecoder, autoregressive_generate
from specdec.features import FeatureTaps
from specdec.head_drafter import HeadDrafter, head_replay_proposals
from specdec.heads import FeatureHead, default_feature_layers, load_head
from specdec.hybrid import HybridHeadDrafter
from specdec.replay import hybrid_proposals, replay
from test_specdec_decoder import _chi2_sf, _exact_first_two, _g_test, _hf_greedy
from test_specdec_replay import COUNTERS

PROMPTS = [[5, 6, 7], [9] * 9, [44], [3, 4, 5, 6, 7, 8], [100, 101], [12] * 3, [200, 1, 2, 3]]
G_PROMPT = [5, 17, 42]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, num_layers=4)


def fit_head(target, prompts, steps: int = 60, ttt: int = 3, vocab_ids=None, sampled: int = 64) -> FeatureHead:
    """A head fit (forward KL to the target, TTT over `ttt` steps) to the target's greedy continuations of
    `prompts` and to `sampled` sampled continuations of G_PROMPT: partial acceptance on exactly these inputs (a
    tiny random target is too chaotic for a head to generalise to others)."""
    head = FeatureHead.from_target(target, vocab_ids=vocab_ids)
    greedy = autoregressive_generate(target, prompts, max_new_tokens=40, eos_token_id=[]).tokens
    sampled = autoregressive_generate(target, [G_PROMPT] * sampled, max_new_tokens=4, temperature=1.0, seed=3,
                                      eos_token_id=[]).tokens if sampled else []
    seqs = [p + r for p, r in zip(prompts, greedy)] + [G_PROMPT + r for r in sampled]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    valid = torch.tensor([[True] * len(s) + [False] * (T - len(s)) for s in seqs])
    with torch.no_grad(), FeatureTaps(target, head.feature_layers) as taps:
        logp = target(ids).logits[..., head.vocab_ids].log_softmax(-1)  # [B, T, S]: p over the draft vocabulary
        feats = taps.take()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            out = head.unroll(feats[:, :-1], ids[:, 1:], ttt, lambda j, _: F.pad(ids[:, j:], (0, j - 1)), valid[:, :-1])
            loss = 0
            for j, g in enumerate(out, start=1):  # step j at pair t predicts position t + j + 1
                n = T - 1 - j
                p, lq, m = logp[:, j : j + n], head.logits(g[:, :n]).log_softmax(-1), valid[:, j + 1 : j + 1 + n]
                loss = loss + ((p.exp() * (p - lq)).sum(-1) * m).sum() / m.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def head(target):
    return fit_head(target, PROMPTS)


class _Recording(HeadDrafter):
    """Records, per row, (tokens emitted before the round, the round's proposals)."""

    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.rows = list(range(context_ids.shape[0]))  # original row of each batch row
        self.emitted = [0] * len(self.rows)
        self.log = [[] for _ in self.rows]

    def propose(self, last_tokens, k, params, generator):
        d, q = super().propose(last_tokens, k, params, generator)
        for i, b in enumerate(self.rows):
            self.log[b].append((self.emitted[b], d[i].tolist()))
        return d, q

    def rollback(self, n_accepted, n_host):
        super().rollback(n_accepted, n_host)
        for i, b in enumerate(self.rows):
            self.emitted[b] += n_host[i] + 1

    def select_rows(self, rows):
        super().select_rows(rows)
        self.rows = [self.rows[i] for i in rows]


def _assert_replayed(head, target, prompt, y, log, depth, tie=1e-4):
    """Every recorded round's proposals equal the replay's row, except after a float tie (gap < tie)."""
    props, gaps = head_replay_proposals(head, target, prompt, y, depth)
    assert props.shape == (len(y), depth) and gaps.shape == (len(y), depth)
    compared = 0
    for e, d in log:
        for j, tok in enumerate(d):
            if tok != int(props[e, j]):
                assert float(gaps[e, j]) < tie, f"round at {e}: proposal {j} is {tok}, replay says {int(props[e, j])}"
                break
            compared += 1
    return compared


# -- construction ---------------------------------------------------------------------------------
def test_default_layers_follow_eagle3_and_stay_distinct():
    assert default_feature_layers(32) == (2, 16, 29)  # EAGLE-3: inputs of layers 2, L//2, L-3
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(6) == (2, 3, 5)
    assert default_feature_layers(4) == (1, 2, 3)
    assert default_feature_layers(2) == (1,)


def test_features_are_the_hidden_states_entering_each_layer(target):
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), FeatureTaps(target, (1, 3)) as taps:
        out = target(ids, output_hidden_states=True)
        feats = taps.take()
    # hidden_states[j] is the input of layer j (hidden_states[0]: the embeddings)
    assert torch.equal(feats, torch.cat([out.hidden_states[1], out.hidden_states[3]], -1))


def test_head_starts_from_the_target(target):
    ids = torch.tensor([3, 7, 200])
    head = FeatureHead.from_target(target, vocab_ids=ids)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[ids])
    assert head.embed is target.get_input_embeddings()
    assert not any(p is target.get_input_embeddings().weight for p in head.parameters())  # not trained or saved


# -- lossless decoding ----------------------------------------------------------------------------
@pytest.mark.parametrize("gamma,lazy", [(1, False), (2, True), (3, False), (4, False)])
def test_greedy_equals_target_ragged_batch(target, head, gamma, lazy):
    ref = _hf_greedy(target, PROMPTS, 30, eos=None)
    rec = _Recording(head)
    res = SpeculativeDecoder(target, rec, gamma=gamma, eos_token_id=[], lazy_head=lazy).generate(PROMPTS, max_new_tokens=30)
    assert res.tokens == ref
    m = res.metrics
    assert 0.2 < m.acceptance_rate < 0.95, "the head must be partly right for this test to mean anything"
    if gamma > 1:
        assert sum(1 for c in m.accepted_lengths if c) >= 3, "rounds must accept different counts"
    # every row's proposals are those a batch of one would make (its cache, holes and all, is exact)
    compared = sum(_assert_replayed(head, target, p, y, log, gamma) for p, y, log in zip(PROMPTS, res.tokens, rec.log))
    assert compared > 50


def test_greedy_stops_at_eos_and_budget(target, head):
    prompts = PROMPTS[:4]
    ref = _hf_greedy(target, prompts, 23, eos=137)  # a token these continuations contain
    res = SpeculativeDecoder(target, HeadDrafter(head), gamma=3, eos_token_id=137).generate(prompts, max_new_tokens=23)
    assert res.tokens == ref
    assert any(r[-1] == 137 for r in ref) and any(len(r) == 23 for r in ref)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_replay_equals_the_proposals_of_decoding(target, head, depth):
    for prompt in ([5, 6, 7], [44], [100, 101], [7, 8, 9, 10, 11]):
        rec = _Recording(head)
        res = SpeculativeDecoder(target, rec, gamma=depth, eos_token_id=[]).generate([prompt], max_new_tokens=25)
        assert len(rec.log[0]) >= 5
        assert _assert_replayed(head, target, prompt, res.tokens[0], rec.log[0], depth) >= len(rec.log[0])


def test_draft_vocabulary_head_is_lossless_and_proposes_only_its_ids(target):
    ref = _hf_greedy(target, PROMPTS, 30, eos=None)
    ids = torch.tensor(sorted({t for r in ref for t in r} | set(range(3, 60))))
    sub = fit_head(target, PROMPTS, vocab_ids=ids)
    rec = _Recording(sub)
    res = SpeculativeDecoder(target, rec, gamma=3, eos_token_id=[]).generate(PROMPTS, max_new_tokens=30)
    assert res.tokens == ref
    assert 0.2 < res.metrics.acceptance_rate < 0.95
    assert {t for log in rec.log for _, d in log for t in d} <= set(ids.tolist())
    for p, y, log in zip(PROMPTS, res.tokens, rec.log):
        _assert_replayed(sub, target, p, y, log, 3)


def test_sampling_distribution_matches_target(target, head):
    # as tests/test_specdec_decoder.py's G-test: N rows of one prompt, first two tokens against the exact joint
    params, N = SamplingParams(temperature=1.0), 20_000
    dec = SpeculativeDecoder(target, HeadDrafter(head), gamma=2, eos_token_id=[])
    res = dec.generate([G_PROMPT] * N, max_new_tokens=3, temperature=1.0, seed=11)
    assert 0.2 < res.metrics.acceptance_rate < 0.95
    assert res.metrics.draft_sampled
    first_two = torch.tensor([r[:2] for r in res.tokens])
    counts = torch.bincount(first_two[:, 0] * 259 + first_two[:, 1], minlength=259 * 259).double()
    joint = _exact_first_two(target, G_PROMPT, params).reshape(-1)
    assert _g_test(counts, joint) > 1e-3
    shifted = joint.clone()  # the same samples reject a 2% TV shift (the test has that power)
    top = torch.topk(joint, 2).indices
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert _g_test(counts, shifted) < 1e-3
    # the third token (from a later round for most rows) against plain target sampling
    base = autoregressive_generate(target, [G_PROMPT] * N, max_new_tokens=3, temperature=1.0, seed=12, eos_token_id=[])
    assert _third_tokens_agree(res, base) > 1e-3


def _third_tokens_agree(res, base) -> float:
    """p-value of a G-test of homogeneity between the third tokens of two runs (tokens seen >= 10 times)."""
    table = torch.stack([torch.bincount(torch.tensor([r[2] for r in x.tokens]), minlength=259).double()
                         for x in (res, base)])
    table = table[:, table.sum(0) >= 10]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    g = 2 * float((table * torch.log(table.clamp(min=1e-300) / expected)).sum())
    return _chi2_sf(g, table.shape[1] - 1)


# -- prompt lookup + head (specdec.hybrid.HybridHeadDrafter) ---------------------------------------
class _HybridSpy(HybridHeadDrafter):
    """Counts rounds where the head slept (every row matched) and rounds where it ran."""

    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.slept = self.ran = 0

    def propose(self, last_tokens, k, params, generator):
        out = super().propose(last_tokens, k, params, generator)
        self.slept, self.ran = self.slept + self._slept, self.ran + (not self._slept)
        return out


REPEATING = [[5, 6, 7, 5, 6, 7, 5], [9] * 9, [44], [3, 4, 5, 6, 7, 8], [12] * 3, [200, 1, 2, 200, 1]]


@pytest.mark.parametrize("gamma", [1, 3])
def test_hybrid_head_greedy_equals_target_while_the_head_sleeps_and_wakes(target, head, gamma):
    ref = _hf_greedy(target, REPEATING, 30, eos=None)
    spy = _HybridSpy(head)
    res = SpeculativeDecoder(target, spy, gamma=gamma, eos_token_id=[]).generate(REPEATING, max_new_tokens=30)
    assert res.tokens == ref
    assert 0 < res.metrics.acceptance_rate < 1
    one = [_HybridSpy(head) for _ in REPEATING[:2]]  # alone, a repeating row sleeps through lookup rounds
    for p, d in zip(REPEATING[:2], one):
        assert SpeculativeDecoder(target, d, gamma=gamma, eos_token_id=[]).generate([p], max_new_tokens=30).tokens[0] \
            == _hf_greedy(target, [p], 30, eos=None)[0]
    assert spy.ran > 0 and sum(d.slept for d in one) > 0 and sum(d.ran for d in one) > 0


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_hybrid_head_replay_equals_decoding(target, head, gamma):
    checked = 0
    for p in REPEATING:
        res = SpeculativeDecoder(target, HybridHeadDrafter(head), gamma=gamma, eos_token_id=[]).generate(
            [p], max_new_tokens=25)
        y = res.tokens[0]
        props, gaps = head_replay_proposals(head, target, p, y, gamma)
        if bool((gaps < 1e-4).any()):  # a float tie could flip one argmax: not comparable exactly
            continue
        rows = props.tolist()
        got = replay(y, hybrid_proposals(p, y, lambda e, k: rows[e][:k] if e < len(rows) else [-1] * k),
                     gamma, 25, set())
        assert {k: getattr(got, k) for k in COUNTERS} == {k: getattr(res.metrics, k) for k in COUNTERS}
        checked += 1
    assert checked >= 4


def test_hybrid_head_sampling_distribution_matches_target(target, head):
    params, N = SamplingParams(temperature=1.0), 20_000
    prompt = [5, 17, 42, 5, 17]  # "5 17" repeats: lookup proposes in round one for every row
    spy = _HybridSpy(head)
    res = SpeculativeDecoder(target, spy, gamma=2, eos_token_id=[]).generate([prompt] * N, max_new_tokens=3,
                                                                              temperature=1.0, seed=13)
    assert spy.slept > 0 and spy.ran > 0
    first_two = torch.tensor([r[:2] for r in res.tokens])
    counts = torch.bincount(first_two[:, 0] * 259 + first_two[:, 1], minlength=259 * 259).double()
    assert _g_test(counts, _exact_first_two(target, prompt, params).reshape(-1)) > 1e-3
    base = autoregressive_generate(target, [prompt] * N, max_new_tokens=3, temperature=1.0, seed=14, eos_token_id=[])
    assert _third_tokens_agree(res, base) > 1e-3


# -- saving ---------------------------------------------------------------------------------------
def test_save_and_reload_give_the_same_head(target, head, tmp_path):
    path = head.save_pretrained(tmp_path / "head")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    again = load_head(path, target)
    for (k, a), (k2, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert torch.equal(again.vocab_ids, head.vocab_ids) and again.feature_layers == head.feature_layers
    a = SpeculativeDecoder(target, HeadDrafter(head), gamma=3).generate(PROMPTS, max_new_tokens=20)
    b = SpeculativeDecoder(target, HeadDrafter(again), gamma=3).generate(PROMPTS, max_new_tokens=20)
    assert a.tokens == b.tokens and a.metrics.accepted_lengths == b.metrics.accepted_lengths
    head.save_pretrained(path)  # replacing an existing directory leaves no temp or parked copy behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_subset_head_saves_the_draft_to_target_offsets(target, tmp_path):
    ids = torch.tensor([2, 5, 9, 250])
    head = FeatureHead.from_target(target, layers=[1, 3], num_layers=2, vocab_ids=ids)
    head.save_pretrained(tmp_path / "h")
    t = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert t["d2t"].tolist() == [2, 4, 7, 247] and t["d2t"].dtype == torch.int64  # target id − draft id
    assert t["t2d"].dtype == torch.bool and t["t2d"].nonzero().flatten().tolist() == [2, 5, 9, 250]
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # vLLM: input of layer j
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2]  # SGLang: output of layer j
    again = load_head(tmp_path / "h", target)
    assert again.vocab_ids.tolist() == [2, 5, 9, 250] and again.num_layers == 2
    x = torch.randn(1, 3, 2 * 64)
    tok = torch.tensor([[5, 6, 7]])
    nt = lambda j, lg: tok  # noqa: E731
    for g1, g2 in zip(head.unroll(x, tok, 2, nt), again.unroll(x, tok, 2, nt)):
        assert torch.equal(head.logits(g1), again.logits(g2))


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input(target, head, tmp_path):
    head.save_pretrained(tmp_path / "h")
    with pytest.raises(ValueError, match="hidden size 32"):
        load_head(tmp_path / "h", tiny_model(num_layers=4, hidden=32))
    with pytest.raises(ValueError, match="6 layers"):
        load_head(tmp_path / "h", tiny_model(num_layers=6))
    with pytest.raises(ValueError, match="not a feature head directory"):
        load_head(tmp_path)
    with pytest.raises(ValueError, match=r"distinct ids in \[1, 3\]"):
        FeatureHead.from_target(target, layers=[0, 2])
    with pytest.raises(ValueError, match="vocab_ids"):
        FeatureHead.from_target(target, vocab_ids=[1, 300])
    with pytest.raises(ValueError, match="no embeddings"):
        HeadDrafter(load_head(tmp_path / "h"))
    with pytest.raises(ValueError, match="vocab_size=100"):
        SpeculativeDecoder(target, HeadDrafter(head), vocab_size=100).generate([[5, 6]], max_new_tokens=4)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_head(tmp_path / "h", target)
