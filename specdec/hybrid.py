"""A hybrid drafter: prompt lookup where the context has a match, the draft model where it has none.

    from specdec.hybrid import HybridDrafter, HybridHeadDrafter
    dec = SpeculativeDecoder(target, HybridDrafter(draft, vocab=ids), gamma=2)
    dec = SpeculativeDecoder(target, HybridHeadDrafter(head), gamma=2)      # a feature head as the model

Chosen per row and per round. Lookup costs nothing and is right far more often than a small model
where the answer copies its context (a second turn rewriting the first, code repeating names); the
model covers the rounds lookup cannot. The model runs only in rounds where some row has no match,
so in between its cache falls behind: every token a row emits while the model sleeps (accepted
lookup tokens, the target's own tokens) waits in that row's ``pending`` list and is fed, ragged
across rows, at the start of the model's next round. Proposals stay exactly what each part alone
would propose from the same context, so greedy replay (specdec/replay.py: ``hybrid_proposals``)
is exact, and sampling stays lossless: lookup rows carry a one-hot q, model rows the model's q.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .drafters import ModelDrafter, PromptLookupDrafter
from .head_drafter import HeadDrafter


def match_rows(lookup: PromptLookupDrafter, last_tokens: torch.Tensor, k: int) -> list[list[int]]:
    """Add each row's last token to its lookup context -> each row's match (up to k tokens; [] for none)."""
    found = []
    for ctx, tok in zip(lookup.contexts, last_tokens.tolist()):
        ctx.append(tok)
        found.append(lookup.lookup(ctx, k))
    return found


def lookup_block(found: list[list[int]], contexts: list[list[int]]) -> list[list[int]]:
    """A round where every row matched: each row's match, filled to the longest with its context's last token."""
    width = max(len(f) for f in found)
    return [f + [ctx[-1]] * (width - len(f)) for f, ctx in zip(found, contexts)]


def lookup_rows(tokens: torch.Tensor, q: torch.Tensor | None, found: list[list[int]], contexts: list[list[int]]) -> None:
    """In a model round's block (tokens [B, k], q [B, k, V] or None), put each matched row's lookup: its
    match, filled to k with the context's last token, with a one-hot q."""
    k = tokens.shape[1]
    for b, f in enumerate(found):
        if f:
            tokens[b] = torch.tensor(f + [contexts[b][-1]] * (k - len(f)), dtype=torch.long, device=tokens.device)
            if q is not None:
                q[b] = torch.nn.functional.one_hot(tokens[b], q.shape[-1]).to(q.dtype)


class HybridDrafter(ModelDrafter):
    """Prompt lookup rows and draft-model rows in one batch (see the module docstring).

    model, sample, vocab: as for ModelDrafter; max_ngram, min_ngram: as for PromptLookupDrafter.
    """

    def __init__(self, model: torch.nn.Module, sample: bool = True,
                 vocab: torch.Tensor | Sequence[int] | None = None, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(model, sample=sample, vocab=vocab)
        self.lookup = PromptLookupDrafter(max_ngram, min_ngram)
        self.pending: list[list[int]] = []  # per row: emitted tokens the model's cache has not seen
        self._block: list[list[int]] = []  # per row: this round's proposals
        self._model_rows: list[bool] = []  # per row: proposals came from the model this round
        self._ran = False  # the model ran this round (its cache holds proposals 1..k-1)

    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.lookup.begin(context_ids, context_mask, vocab_size)
        self.pending = [[] for _ in range(context_ids.shape[0])]
        self._ran = False

    def propose(self, last_tokens, k, params, generator):
        assert k >= 1, "a round with no proposal is a plain target step; do not call propose"
        found = match_rows(self.lookup, last_tokens, k)
        for pend, tok in zip(self.pending, last_tokens.tolist()):
            pend.append(tok)
        self._model_rows = [not f for f in found]
        self._ran = any(self._model_rows)
        if not self._ran:  # every row has a match: lookup alone, deterministic
            self._block = lookup_block(found, self.lookup.contexts)
            return torch.tensor(self._block, dtype=torch.long, device=last_tokens.device), None
        tokens, q = self._model_block(k, params, generator, last_tokens.device)  # [B, k], [B, k, V] | None
        lookup_rows(tokens, q, found, self.lookup.contexts)
        self._block = tokens.tolist()
        return tokens, q

    def _model_block(self, k: int, params, generator, out_device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed every row's pending tokens (ragged, right-aligned), then propose k tokens with the model."""
        kv = self.kv
        width = max(len(p) for p in self.pending)
        fed = torch.tensor([[0] * (width - len(p)) + p for p in self.pending], dtype=torch.long, device=kv.device)
        valid = None
        if any(len(p) < width for p in self.pending):
            valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in self.pending], device=kv.device)
        self.pending = [[] for _ in self.pending]
        logits = self._next_logits(fed, valid)  # [B, V] or [B, V'] over the draft vocabulary
        tokens, q = self._unroll(logits, k, params, generator, out_device)
        return tokens.to(out_device), q

    def rollback(self, n_accepted, n_host):
        k = len(self._block[0]) if self._block else 0
        for ctx, blk, n in zip(self.lookup.contexts, self._block, n_host):
            ctx.extend(blk[:n])
        if not self._ran:
            for pend, blk, n in zip(self.pending, self._block, n_host):
                pend.extend(blk[:n])
            return
        # The model's cache holds its own proposals 1..k-1 for every row: a model row keeps the accepted
        # ones (and owes the k-th if all were accepted); a lookup row keeps none and owes what it accepted.
        keep = [min(n, k - 1) if mine else 0 for n, mine in zip(n_host, self._model_rows)]
        self.kv.rollback(k - 1, torch.tensor(keep, device=self.kv.device), keep)
        for pend, blk, n, kept in zip(self.pending, self._block, n_host, keep):
            pend.extend(blk[kept:n])

    def select_rows(self, rows):
        idx = torch.tensor(rows, dtype=torch.long, device=self.kv.device)
        self.kv.select_rows(idx)
        self.lookup.select_rows(rows)
        self.pending = [self.pending[i] for i in rows]
        self._block = [self._block[i] for i in rows] if self._block else []
        self._model_rows = [self._model_rows[i] for i in rows] if self._model_rows else []


class HybridHeadDrafter(HeadDrafter):
    """Prompt lookup where the context has a match, a feature head (specdec.heads) where it has none.

    As HybridDrafter, per row and per round. The head proposes from pairs with real target features
    only, so it can sleep through lookup rounds: the pairs the target verified meanwhile (its features
    from each verify pass, the tokens emitted) wait in the head's pending block and are fed, holes
    for rows that emitted fewer, at the start of its next round. Its proposals therefore stay what
    HeadDrafter alone would propose from the same sequence, and greedy replay is exact
    (``hybrid_proposals`` over ``head_replay_proposals``). A one-token prompt's placeholder pair (no
    target feature yet) is dropped when a lookup round comes first.
    """

    def __init__(self, head, sample: bool = True, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(head, sample=sample)
        self.lookup = PromptLookupDrafter(max_ngram, min_ngram)
        self._block: list[list[int]] = []
        self._slept = False  # this round's proposals all came from lookup: the head did not run

    def begin(self, context_ids, context_mask, vocab_size):
        super().begin(context_ids, context_mask, vocab_size)
        self.lookup.begin(context_ids, context_mask, vocab_size)
        self._block, self._slept = [], False

    def propose(self, last_tokens, k, params, generator):
        assert k >= 1 and self._pending is not None, "observe the prefill's features before proposing"
        found = match_rows(self.lookup, last_tokens, k)
        self._slept = all(found)
        if self._slept:  # lookup alone: the round's last token joins the pending pairs, the head sleeps
            self._block = lookup_block(found, self.lookup.contexts)
            feats, toks, valid = self._pending
            last = last_tokens.to(self.device)[:, None]
            if valid is None:
                valid = torch.ones(feats.shape[:2], dtype=torch.bool, device=self.device)
            if bool(self._fake.any()):  # a placeholder pair (no target feature yet) is never fed
                valid = valid.clone()
                valid[:, 0] &= ~self._fake
                self._fake = torch.zeros_like(self._fake)
            self._pending = (feats, torch.cat([toks, last], 1), valid)
            self._k = 0
            self._proposal = torch.tensor(self._block, dtype=torch.long, device=self.device)
            return torch.tensor(self._block, dtype=torch.long, device=last_tokens.device), None
        tokens, q = super().propose(last_tokens, k, params, generator)
        lookup_rows(tokens, q, found, self.lookup.contexts)
        self._proposal = tokens.to(self.device)  # what the pending pairs are built from at rollback
        self._block = tokens.tolist()
        return tokens, q

    def rollback(self, n_accepted, n_host):
        for ctx, blk, n in zip(self.lookup.contexts, self._block, n_host):
            ctx.extend(blk[:n])
        if not self._slept:
            super().rollback(n_accepted, n_host)
            return
        # The head did not run: append this round's verified pairs (f_{m+j}, d_{j+1}) and f_{m+n} to the
        # pending block (left-padded per row as HeadDrafter.rollback builds them).
        V = self._verify  # [B, w+1, F]: f_m .. f_{m+w}
        assert V is not None, "observe the verify pass's features before rollback"
        B, N = V.shape[0], max(n_host) + 1
        n = n_accepted.to(self.device)
        src = torch.arange(N, device=self.device)[None, :] - (N - 1 - n[:, None])
        valid = src >= 0
        src = src.clamp(min=0)
        feats = V.gather(1, src[:, :, None].expand(B, N, V.shape[2])) * valid[:, :, None]
        w = self._proposal.shape[1]
        toks = self._proposal.gather(1, src[:, : N - 1].clamp(max=w - 1)) * valid[:, : N - 1]
        old_feats, old_toks, old_valid = self._pending
        self._pending = (torch.cat([old_feats, feats], 1), torch.cat([old_toks, toks], 1),
                         torch.cat([old_valid, valid], 1))
        self._verify = None

    def select_rows(self, rows):
        super().select_rows(rows)
        self.lookup.select_rows(rows)
        self._block = [self._block[i] for i in rows] if self._block else []
