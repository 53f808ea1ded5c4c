"""Decoding with a feature head (specdec.heads.FeatureHead): the drafter, its KV cache, and exact replay.

    from specdec import SpeculativeDecoder
    from specdec.head_drafter import HeadDrafter, head_replay_proposals
    out = SpeculativeDecoder(target, HeadDrafter(head), gamma=4).generate(prompts, max_new_tokens=64)
    props, gaps = head_replay_proposals(head, target, prompt_ids, y, depth=4)   # no decoding

How a round goes (x_m = the token the target just emitted, target features known for positions < m):
  propose: feed the pending pairs — (f_t, x_{t+1}) for every position t the target verified since the
           last round, the last of them (f_{m-1}, x_m) — with real target features; its output predicts
           d_1; then k-1 steps on the head's own (g, d_i) pairs predict d_2..d_k.
  observe: the verify pass's features f_m..f_{m+k} (the decoder hands them over).
  rollback: drop the k-1 speculative cache columns; row b's next pending pairs are (f_{m+j}, d_{j+1})
           for j < n_b accepted, then (f_{m+n_b}, next token).
So the head's cache only ever holds pairs with real target features: its proposals depend on the
sequence alone, not on where rounds began. That is what makes head_replay_proposals exact. Rows of a
ragged batch catch up different numbers of pairs: the block is left-padded and the padding becomes
masked cache columns (holes), positions counting real columns only, as in kv.KVModel.

A row without any target feature yet (a one-token prompt) proposes its first round from a zero
feature; that pair is masked out of the cache at rollback.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .drafters import Drafter
from .features import FeatureTaps
from .heads import FeatureHead
from .sampling import logits_to_probs, sample


class HeadCache:
    """Keys/values of each head layer [B, kv heads, L, D], a [B, L] mask of real columns, positions."""

    def __init__(self, num_layers: int, batch: int, device: torch.device):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)  # next position per row
        self.holes = False

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def append(self, q: int, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Book q new columns (valid [B, q], None = all real) -> (positions [B, q], SDPA mask or None)."""
        B, L, dev = self.mask.shape[0], self.length, self.mask.device
        if valid is None:
            valid = torch.ones(B, q, dtype=torch.bool, device=dev)
            positions = self.pos[:, None] + torch.arange(q, device=dev)
        else:
            self.holes = self.holes or not bool(valid.all())
            positions = (self.pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)
        self.pos = self.pos + valid.long().sum(1)
        self.mask = torch.cat([self.mask, valid], dim=1)
        if not self.holes and q == 1:
            return positions, None
        causal = torch.ones(q, L + q, dtype=torch.bool, device=dev).tril(L)  # [q, L + q]
        diag = torch.zeros_like(causal)
        diag[:, L:] = torch.eye(q, dtype=torch.bool, device=dev)  # a masked column still sees itself
        return positions, ((self.mask[:, None, :] & causal) | diag)[:, None]  # [B, 1, q, L + q]

    def attend(self, i: int, mask: torch.Tensor | None):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.keys[i] is not None:
                k, v = torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2)
            self.keys[i], self.values[i] = k, v
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False,
                                                  enable_gqa=k.shape[1] != q.shape[1])

        return attend

    def crop(self, q: int) -> None:
        """Forget the last q columns of every row."""
        if q <= 0:
            return
        kept = self.mask[:, -q:].long().sum(1)
        self.pos = self.pos - kept
        self.mask = self.mask[:, :-q]
        self.keys = [None if k is None else k[:, :, :-q] for k in self.keys]
        self.values = [None if v is None else v[:, :, :-q] for v in self.values]

    def mask_column(self, rows: torch.Tensor, col: int) -> None:
        """Make column col a hole for rows (bool [B]); their later positions move down by one."""
        hit = rows & self.mask[:, col]
        self.mask[:, col] &= ~hit
        self.pos = self.pos - hit.long()
        self.holes = True

    def select(self, idx: torch.Tensor) -> None:
        self.keys = [None if k is None else k[idx] for k in self.keys]
        self.values = [None if v is None else v[idx] for v in self.values]
        self.mask, self.pos = self.mask[idx], self.pos[idx]


class HeadDrafter(Drafter):
    """A Drafter around a FeatureHead (attached to the target). sample: under sampling, draw proposals
    from q (True) or propose the argmax (False); greedy decoding always proposes the argmax. q is the
    head's softmax over its draft vocabulary, zero elsewhere (lossless, as with ModelDrafter(vocab=))."""

    def __init__(self, head: FeatureHead, sample: bool = True):
        head.embed  # raises if no target is attached
        self.head = head.eval()
        self.samples = sample
        self.feature_layers = head.feature_layers
        self.vocab_width = head.vocab_size
        self.cache: HeadCache | None = None

    @property
    def device(self) -> torch.device:
        return self.head.lm_head.weight.device

    def begin(self, context_ids, context_mask, vocab_size):
        if int(self.head.vocab_ids.max()) >= vocab_size:
            raise ValueError(f"the head's draft vocabulary holds ids >= vocab_size={vocab_size}; build it from the "
                             "target's tokenizer (ids below len(tokenizer))")
        self._vocab_size = vocab_size
        self._context = (context_ids.to(self.device), context_mask.to(self.device))
        self.cache = HeadCache(self.head.num_layers, context_ids.shape[0], self.device)
        self._pending = self._verify = self._proposal = None
        self._k = 0

    def _run(self, h: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Feed pairs (h [B, q, H], tokens [B, q]) to the head's cache -> g [B, q, H]."""
        positions, mask = self.cache.append(tokens.shape[1], valid)
        attends = [self.cache.attend(i, mask) for i in range(self.head.num_layers)]
        return self.head.step(h, tokens, positions, attends)

    def observe(self, features: torch.Tensor | None) -> None:
        if features is None:  # an empty prefill (every prompt has one token)
            features = torch.zeros(self._context[0].shape[0], 0, self.head.fc.in_features, device=self.device)
        features = features.to(self.device, self.head.fc.weight.dtype)
        if self._pending is not None:  # a verify pass: f_m..f_{m+k}, used at rollback
            self._verify = features
            return
        ids, mask = self._context  # the prefill: [B, S] context (left-padded), features [B, S, F]
        B, S = ids.shape
        if S >= 2:  # pairs (f_t, x_{t+1}) for all but the last context position
            self._run(self.head.fuse(features[:, :-1]), ids[:, 1:], mask[:, :-1])
        last = mask[:, -1] if S else torch.zeros(B, dtype=torch.bool, device=self.device)
        f_last = features[:, -1:] if S else features.new_zeros(B, 1, features.shape[-1])
        self._fake = ~last  # no feature yet: a zero feature for one round, masked at rollback
        self._pending = (f_last * last[:, None, None], ids.new_zeros(B, 0), None)

    def propose(self, last_tokens, k, params, generator):
        assert k >= 1 and self._pending is not None, "observe the prefill's features before proposing"
        out_device = last_tokens.device
        last = last_tokens.to(self.device)
        feats, tokens, valid = self._pending
        g = self._run(self.head.fuse(feats), torch.cat([tokens, last[:, None]], 1), valid)[:, -1:]  # [B, 1, H]
        self._catchup_end = self.cache.length
        ids = self.head.vocab_ids
        use_q = self.samples and not params.greedy
        picks, probs = [], []
        for i in range(k):
            if i > 0:
                g = self._run(g, picks[-1][:, None], None)  # the last proposal is never fed
            logits = self.head.logits(g[:, 0])  # [B, S]
            if use_q:
                q = logits_to_probs(logits, params).to(out_device)
                col = sample(q, generator).to(self.device)
                probs.append(q.new_zeros(q.shape[0], self._vocab_size).index_copy_(1, ids.to(out_device), q))
            else:
                col = logits.argmax(-1)
            picks.append(ids[col])
        self._k = k
        self._proposal = torch.stack(picks, dim=1)  # [B, k]
        return self._proposal.to(out_device), (torch.stack(probs, dim=1) if use_q else None)

    def rollback(self, n_accepted, n_host):
        k = self._k
        if k == 0:
            return
        self.cache.crop(k - 1)  # speculative columns; only real features stay
        if bool(self._fake.any()):
            self.cache.mask_column(self._fake, self._catchup_end - 1)
            self._fake = torch.zeros_like(self._fake)
        V = self._verify  # [B, k+1, F]: f_m .. f_{m+k}
        assert V is not None and V.shape[1] == k + 1, "observe the verify pass's features before rollback"
        B, N = V.shape[0], max(n_host) + 1
        n = n_accepted.to(self.device)
        src = torch.arange(N, device=self.device)[None, :] - (N - 1 - n[:, None])  # [B, N] column in V
        valid = src >= 0
        src = src.clamp(min=0)
        feats = V.gather(1, src[:, :, None].expand(B, N, V.shape[2])) * valid[:, :, None]
        toks = self._proposal.gather(1, src[:, : N - 1].clamp(max=k - 1)) * valid[:, : N - 1]  # [B, N-1]
        self._pending = (feats, toks, None if bool(valid.all()) else valid)
        self._verify = None

    def select_rows(self, rows):
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.select(idx)
        feats, toks, valid = self._pending
        self._pending = (feats[idx], toks[idx], None if valid is None else valid[idx])
        self._fake = self._fake[idx]
        if self._proposal is not None:
            self._proposal = self._proposal[idx]


@torch.inference_mode()
def head_replay_proposals(head: FeatureHead, target: torch.nn.Module, prompt_ids: Sequence[int],
                          y: Sequence[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy proposals of HeadDrafter(head) at batch 1, for every round start, without decoding.

    Row e: the first `depth` tokens proposed in a round that starts after the target has emitted y[:e]
    (its first pair is (f_{P+e-2}, x_{P+e-1}) for a P-token prompt, x = prompt + y). Computed with one
    target pass over prompt + y[:-1] and a depth-step unroll of the head over every pair (the TTT
    pattern; tokens after the first are the head's own argmax). Returns proposals [len(y), depth] long
    and gaps [len(y), depth] float (top-1 minus top-2 logit of each proposal: near 0 means a float tie
    could flip it). Equal to decoding's proposals up to such ties.
    """
    if depth < 1 or not y or not prompt_ids:
        raise ValueError("need depth >= 1, a non-empty prompt and a non-empty y")
    device = next(target.parameters()).device
    seq = torch.tensor([list(prompt_ids) + list(y)], device=device)  # [1, P + len(y)]
    P, n_cols = len(prompt_ids), len(prompt_ids) + len(y) - 1
    with FeatureTaps(target, head.feature_layers) as taps:
        target(input_ids=seq[:, :n_cols], use_cache=False)
        feats = taps.take().to(head.fc.weight.dtype)  # [1, n_cols, F]

    def argmax_ids(j: int, g: torch.Tensor) -> torch.Tensor:
        return head.vocab_ids[head.logits(g).argmax(-1)]

    def proposals(f: torch.Tensor, toks: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        steps = head.unroll(f, toks, depth, argmax_ids)
        logits = torch.stack([head.logits(g[0, rows]) for g in steps], dim=1)  # [R, depth, S]
        top = logits.topk(min(2, logits.shape[-1]), dim=-1).values
        gap = top[..., 0] - top[..., 1] if top.shape[-1] > 1 else torch.full_like(top[..., 0], float("inf"))
        return head.vocab_ids[logits.argmax(-1)], gap.float()

    parts = []
    if P == 1:  # the round with no target feature yet: a zero feature, as HeadDrafter does
        parts.append(proposals(feats.new_zeros(1, 1, feats.shape[-1]), seq[:, :1], slice(0, 1)))
    if n_cols >= 2:  # pairs t = 0..n_cols-2; row e is pair P+e-2
        parts.append(proposals(feats[:, :-1], seq[:, 1:n_cols], slice(max(P - 2, 0), n_cols - 1)))
    props = torch.cat([p for p, _ in parts]).cpu()
    gaps = torch.cat([g for _, g in parts]).cpu()
    assert props.shape[0] == len(y)
    return props, gaps
