"""Drafters: whatever proposes the next k tokens for the target to verify.

    from specdec.drafters import ModelDrafter, PromptLookupDrafter
    drafter = ModelDrafter(draft_model)          # any causal LM with the target's tokenizer
    drafter = PromptLookupDrafter(max_ngram=3)   # no model: continue the latest matching n-gram

One small interface (``Drafter``), driven by the decoder once per round:

    begin(context_ids, context_mask, vocab_size)   # a new batch; the context is everything but
                                                   # the last prompt token
    propose(last_tokens, k, params, generator)     # last_tokens [B]: the token the target emitted
        -> draft_tokens [B, k'], draft_probs [B, k', V] | None      (k' <= k)
    rollback(n_accepted, n_host)                   # forget proposals after the accepted prefix
    select_rows(rows)                              # finished rows leave the batch

``draft_probs`` is None for a deterministic proposal (argmax, or a lookup): the acceptance test
then uses the one-hot q, which keeps sampling lossless.
"""
from __future__ import annotations

import torch

from .kv import KVModel, logits_width
from .sampling import SamplingParams, logits_to_probs, sample


class Drafter:
    """Interface of a drafter; see the module docstring for the call order."""

    vocab_width: int | None = None  # logit columns of a model drafter (None: proposes token ids only)
    samples: bool = False  # True when proposals are drawn from q under sampling (else deterministic)

    def begin(self, context_ids: torch.Tensor, context_mask: torch.Tensor, vocab_size: int) -> None:
        raise NotImplementedError

    def propose(
        self, last_tokens: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def rollback(self, n_accepted: torch.Tensor, n_host: list[int]) -> None:
        raise NotImplementedError

    def select_rows(self, rows: list[int]) -> None:
        raise NotImplementedError


class ModelDrafter(Drafter):
    """A small causal LM with its own KV cache: the context is encoded once, then each round feeds
    only the tokens the draft has not seen (the target's last token, plus the draft's own last
    proposal after a fully accepted round) and proposes k tokens autoregressively.

    sample: under sampling, draw proposals from q (True, the standard algorithm) or propose the
    draft's argmax (False; lossless too, with a one-hot q). Under greedy decoding it is always argmax.
    """

    def __init__(self, model: torch.nn.Module, sample: bool = True):
        self.model = model
        self.vocab_width = logits_width(model)
        self.samples = sample
        self.kv: KVModel | None = None
        self._carry = self._carry_valid = None  # [B]: last proposal, unseen by the draft's cache
        self._carry_host: list[bool] = []
        self._proposal: torch.Tensor | None = None  # [B, k] last proposal
        self._k = 0

    def begin(self, context_ids: torch.Tensor, context_mask: torch.Tensor, vocab_size: int) -> None:
        self.kv = KVModel(self.model, vocab_size)
        self.kv.prefill(context_ids.to(self.kv.device), context_mask.to(self.kv.device))
        B = context_ids.shape[0]
        self._carry = torch.zeros(B, dtype=torch.long, device=self.kv.device)
        self._carry_valid = torch.zeros(B, dtype=torch.bool, device=self.kv.device)
        self._carry_host = [False] * B
        self._k = 0

    def propose(self, last_tokens, k, params, generator):
        assert k >= 1, "a round with no proposal is a plain target step; do not call propose"
        kv = self.kv
        out_device = last_tokens.device  # the target's; the draft may live elsewhere
        last_tokens = last_tokens.to(kv.device)
        if any(self._carry_host):
            tokens = torch.stack([self._carry, last_tokens], dim=1)  # [B, 2]
            both = torch.stack([self._carry_valid, torch.ones_like(self._carry_valid)], dim=1)  # [B, 2]
            valid = None if all(self._carry_host) else both
            logits = kv.step(tokens, valid, keep=1)  # [B, 1, V]
        else:
            logits = kv.step(last_tokens[:, None], keep=1)  # [B, 1, V]
        use_q = self.samples and not params.greedy
        tokens, probs = [], []
        for i in range(k):
            if i > 0:
                logits = kv.step(tokens[-1][:, None], keep=1)  # the last proposal is never fed
            if use_q:
                q = logits_to_probs(logits[:, 0], params).to(out_device)  # [B, V]
                probs.append(q)
                tokens.append(sample(q, generator).to(kv.device))  # the generator lives with the target
            else:
                tokens.append(logits[:, 0].argmax(-1))
        self._k = k
        self._proposal = torch.stack(tokens, dim=1)  # [B, k]
        return self._proposal.to(out_device), (torch.stack(probs, dim=1) if use_q else None)  # [B, k], [B, k, V]

    def rollback(self, n_accepted, n_host):
        k = self._k
        if k == 0:
            return
        # The cache holds proposals 1..k-1 (the k-th was never fed); keep the accepted ones.
        keep_host = [min(n, k - 1) for n in n_host]
        n_accepted = n_accepted.to(self.kv.device)
        self.kv.rollback(k - 1, n_accepted.clamp(max=k - 1), keep_host)
        self._carry_valid = n_accepted == k  # full acceptance: proposal k is accepted but unseen
        self._carry = self._proposal[:, -1]
        self._carry_host = [n == k for n in n_host]

    def select_rows(self, rows):
        idx = torch.tensor(rows, dtype=torch.long, device=self.kv.device)
        self.kv.select_rows(idx)
        self._carry, self._carry_valid = self._carry[idx], self._carry_valid[idx]
        self._carry_host = [self._carry_host[i] for i in rows]
        if self._proposal is not None:
            self._proposal = self._proposal[idx]


class PromptLookupDrafter(Drafter):
    """Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the context's last
    n tokens (n = max_ngram down to min_ngram) and propose the tokens that followed it.

    Proposals are deterministic (one-hot q), so speculative sampling stays lossless. Rows without a
    match get filler proposals (a repeat of their last token) when other rows have a match; if no
    row matches, the round proposes nothing and is a plain target step.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.contexts: list[list[int]] = []
        self._proposals: list[list[int]] = []
        self.device = torch.device("cpu")

    def begin(self, context_ids, context_mask, vocab_size):
        self.device = context_ids.device
        ids, mask = context_ids.tolist(), context_mask.tolist()
        self.contexts = [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(ids, mask)]
        self._proposals = [[] for _ in self.contexts]

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the context's suffix n-gram."""
        best: list[int] = []
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = context[L - n :]
            for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
                if context[start : start + n] == pattern:
                    cont = context[start + n : start + n + k]
                    if len(cont) > len(best):
                        best = cont
                    if len(best) == k:
                        return best
            if best:
                return best
        return best

    def propose(self, last_tokens, k, params, generator):
        rows = []
        for ctx, tok in zip(self.contexts, last_tokens.tolist()):
            ctx.append(tok)
            rows.append(self.lookup(ctx, k))
        width = max((len(r) for r in rows), default=0)
        self._proposals = [r + [ctx[-1]] * (width - len(r)) for r, ctx in zip(rows, self.contexts)]
        tokens = torch.tensor(self._proposals, dtype=torch.long, device=last_tokens.device).reshape(len(rows), width)
        return tokens, None  # [B, k']

    def rollback(self, n_accepted, n_host):
        for ctx, prop, n in zip(self.contexts, self._proposals, n_host):
            ctx.extend(prop[:n])

    def select_rows(self, rows):
        self.contexts = [self.contexts[i] for i in rows]
        self._proposals = [self._proposals[i] for i in rows]
