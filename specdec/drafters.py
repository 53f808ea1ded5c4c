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
    observe(features)                              # only if feature_layers: the target's hidden states
                                                   # at those layers, [B, q, n·H], after the prefill
                                                   # (q = context columns) and each verify pass (q = k+1)

``draft_probs`` is None for a deterministic proposal (argmax, or a lookup): the acceptance test
then uses the one-hot q, which keeps sampling lossless.

A draft vocabulary (``ModelDrafter(draft, vocab=ids)``) restricts the draft's LM head to the given
token ids, e.g. the few thousand a model's answers mostly use (``frequent_tokens``). A small
draft's full-vocabulary head costs as much as several of its layers; with a subset each draft step
reads a fraction of those weights. Decoding stays lossless: q is the draft's softmax over the
subset (zero elsewhere), and the target's test and residual are taken over the whole vocabulary. A
target token outside the subset is simply never proposed (that round rejects there).
"""
from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from .kv import KVModel, logits_width
from .sampling import SamplingParams, logits_to_probs, sample

DRAFT_VOCAB_FILE = "draft_vocab.json"  # {"ids": [...], "source": "..."} beside a draft's weights


def _special_or_added(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens and of every token added on top of its model's vocabulary."""
    return set(getattr(tokenizer, "all_special_ids", None) or []) | set(getattr(tokenizer, "added_tokens_decoder", None) or {})


def single_char_tokens(tokenizer, vocab_size: int) -> list[int]:
    """Ids below vocab_size whose token decodes to exactly one character, ascending: the byte tokens of
    a byte-level BPE (a lone byte of a multi-byte character decodes to U+FFFD, still one character), the
    <0xNN> byte-fallback and single-character pieces of a SentencePiece vocabulary. Special and added
    tokens (BOS/EOS, <unused*> slots, chat markers) are never among them."""
    excluded = _special_or_added(tokenizer)
    ids = [i for i in range(min(vocab_size, len(tokenizer))) if i not in excluded]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return [i for i, text in zip(ids, texts) if len(text) == 1]


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, vocab_size: int, tokenizer=None) -> torch.Tensor:
    """The ``size`` ids (< vocab_size) that occur most often in ``sequences`` -> sorted [size] long.

    Ties go to the lower id. When fewer distinct ids occur than ``size``, the rest is filled:
    - with a ``tokenizer``: first the single-character tokens (``single_char_tokens``: any text can
      still be spelled out), then the lowest ids that are neither special nor added tokens, and only
      then anything else; this holds for any vocabulary, also one whose first ids are specials and
      <unused*> slots;
    - without one: the lowest ids (in a BPE vocabulary, the byte tokens and the earliest merges).
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}] (got {size})")
    counts = Counter(int(t) for seq in sequences for t in seq if 0 <= int(t) < vocab_size)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        chosen = set(ranked)
        order: Iterable[int] = range(vocab_size)
        if tokenizer is not None:
            excluded = _special_or_added(tokenizer)
            singles = single_char_tokens(tokenizer, vocab_size)
            plain = (t for t in range(vocab_size) if t not in excluded)
            order = itertools.chain(singles, plain, range(vocab_size))
        for t in order:
            if len(ranked) == size:
                break
            if t not in chosen:
                chosen.add(t)
                ranked.append(t)
    return torch.tensor(sorted(ranked), dtype=torch.long)


def save_draft_vocab(model_dir: str | Path, ids: torch.Tensor | Sequence[int], source: str) -> Path:
    """Write DRAFT_VOCAB_FILE into a draft's directory (temp file, then rename)."""
    path = Path(model_dir) / DRAFT_VOCAB_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"ids": [int(t) for t in ids], "source": source}))
    os.replace(tmp, path)
    return path


def load_draft_vocab(path: str | Path) -> torch.Tensor | None:
    """The draft vocabulary in a draft's directory (its DRAFT_VOCAB_FILE) or in a file; None if absent."""
    path = Path(path)
    path = path / DRAFT_VOCAB_FILE if path.is_dir() else path
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["ids"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a draft vocabulary ({err}); delete it or rewrite it with "
                         "specdec.drafters.save_draft_vocab") from None
    return torch.tensor(ids, dtype=torch.long)


class Drafter:
    """Interface of a drafter; see the module docstring for the call order."""

    vocab_width: int | None = None  # logit columns of a model drafter (None: proposes token ids only)
    samples: bool = False  # True when proposals are drawn from q under sampling (else deterministic)
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states the decoder hands to observe()

    def observe(self, features: torch.Tensor | None) -> None:
        """The target's features of its last forward pass (see the module docstring); None for an empty
        prefill. Drafters without feature_layers are never called."""

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
    vocab: token ids the draft may propose (its LM head is applied to these rows only; see the module
    docstring); None = the whole vocabulary. Needs a model whose logits are head(last hidden state).
    fast: its KVModel option ("auto" or False).
    """

    def __init__(self, model: torch.nn.Module, sample: bool = True,
                 vocab: torch.Tensor | Sequence[int] | None = None, fast: str | bool = "auto"):
        self.model, self.fast = model, fast
        self.vocab_width = logits_width(model)
        self.samples = sample
        self.vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long).flatten().unique()
        if self.vocab is not None and (self.vocab.numel() == 0 or int(self.vocab.min()) < 0
                                       or int(self.vocab.max()) >= self.vocab_width):
            raise ValueError(f"draft vocabulary ids must be in [0, {self.vocab_width}) and not empty")
        self._head: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight [V', H], bias) of the subset
        self._vocab_size = self.vocab_width
        self.kv: KVModel | None = None
        self._carry = self._carry_valid = None  # [B]: last proposal, unseen by the draft's cache
        self._carry_host: list[bool] = []
        self._proposal: torch.Tensor | None = None  # [B, k] last proposal
        self._k = 0

    def begin(self, context_ids: torch.Tensor, context_mask: torch.Tensor, vocab_size: int) -> None:
        self.kv = KVModel(self.model, vocab_size, self.fast)
        self._vocab_size = vocab_size
        if self.vocab is not None:
            if int(self.vocab[-1]) >= vocab_size:
                raise ValueError(f"the draft vocabulary holds ids >= vocab_size={vocab_size}; build it from the "
                                 "target's tokenizer (ids below len(tokenizer))")
            if self._head is None:
                self._head = self._subset_head()
        self.kv.prefill(context_ids.to(self.kv.device), context_mask.to(self.kv.device))
        B = context_ids.shape[0]
        self._carry = torch.zeros(B, dtype=torch.long, device=self.kv.device)
        self._carry_valid = torch.zeros(B, dtype=torch.bool, device=self.kv.device)
        self._carry_host = [False] * B
        self._k = 0

    def _subset_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.kv.lazy_head_ok:
            raise ValueError("a draft vocabulary needs a draft whose logits are its LM head applied to the last "
                             "hidden state (no logit scaling or soft-capping); drop the vocabulary for this model")
        head = self.model.get_output_embeddings()
        ids = self.vocab.to(self.kv.device)
        bias = None if getattr(head, "bias", None) is None else head.bias.detach()[ids]
        return head.weight.detach()[ids].contiguous(), bias

    def _next_logits(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Feed tokens [B, q]; logits [B, V] (or [B, V'] over the draft vocabulary) after the last one."""
        if self._head is None:
            return self.kv.step(tokens, valid, keep=1)[:, 0]
        hidden = self.kv.step_hidden(tokens, valid)[:, -1]  # [B, H]
        return F.linear(hidden, *self._head)  # [B, V']

    def propose(self, last_tokens, k, params, generator):
        assert k >= 1, "a round with no proposal is a plain target step; do not call propose"
        kv = self.kv
        out_device = last_tokens.device  # the target's; the draft may live elsewhere
        last_tokens = last_tokens.to(kv.device)
        if any(self._carry_host):
            tokens = torch.stack([self._carry, last_tokens], dim=1)  # [B, 2]
            both = torch.stack([self._carry_valid, torch.ones_like(self._carry_valid)], dim=1)  # [B, 2]
            valid = None if all(self._carry_host) else both
            logits = self._next_logits(tokens, valid)  # [B, V]
        else:
            logits = self._next_logits(last_tokens[:, None])  # [B, V]
        self._proposal, q = self._unroll(logits, k, params, generator, out_device)  # [B, k], [B, k, V] | None
        return self._proposal.to(out_device), q

    def _unroll(self, logits, k, params, generator, out_device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k proposals from the logits after the last fed token, feeding proposals 1..k-1 to the cache."""
        kv = self.kv
        ids = None if self._head is None else self.vocab.to(kv.device)  # subset column -> token id
        use_q = self.samples and not params.greedy
        tokens, probs = [], []
        for i in range(k):
            if i > 0:
                logits = self._next_logits(tokens[-1][:, None])  # the last proposal is never fed
            if use_q:
                q = logits_to_probs(logits, params).to(out_device)  # [B, V] or [B, V']
                pick = sample(q, generator).to(kv.device)  # the generator lives with the target
                if ids is not None:  # q over the whole vocabulary: zero outside the subset
                    q = q.new_zeros(q.shape[0], self._vocab_size).index_copy_(1, ids.to(out_device), q)
                probs.append(q)
            else:
                pick = logits.argmax(-1)
            tokens.append(pick if ids is None else ids[pick])
        self._k = k
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if use_q else None)  # [B, k], [B, k, V]

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
