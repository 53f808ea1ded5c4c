"""A hybrid drafter: prompt lookup where the context has a match, the draft model where it has none.

    from specdec.hybrid import HybridDrafter
    dec = SpeculativeDecoder(target, HybridDrafter(draft, vocab=ids), gamma=2)

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
        found = []
        for ctx, pend, tok in zip(self.lookup.contexts, self.pending, last_tokens.tolist()):
            ctx.append(tok)
            pend.append(tok)
            found.append(self.lookup.lookup(ctx, k))
        self._model_rows = [not f for f in found]
        self._ran = any(self._model_rows)
        if not self._ran:  # every row has a match: lookup alone, deterministic
            width = max(len(f) for f in found)
            self._block = [f + [ctx[-1]] * (width - len(f)) for f, ctx in zip(found, self.lookup.contexts)]
            return torch.tensor(self._block, dtype=torch.long, device=last_tokens.device), None
        tokens, q = self._model_block(k, params, generator, last_tokens.device)  # [B, k], [B, k, V] | None
        for b, f in enumerate(found):
            if f:  # a lookup row: its match (filler to k), one-hot q
                row = f + [self.lookup.contexts[b][-1]] * (k - len(f))
                tokens[b] = torch.tensor(row, dtype=torch.long, device=tokens.device)
                if q is not None:
                    q[b] = torch.nn.functional.one_hot(tokens[b], q.shape[-1]).to(q.dtype)
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
