"""Training examples from generated records, padded batches, on-policy samples, and α_TF on held-out records.

    from distill.batches import to_examples, collate, holdout_reference, measure_alpha
    exs = to_examples(load_generated("runs/x"), max_seq_len=512, with_topk=False)
    ref = holdout_reference(target, exs[:16], batch_size=8, vocab=len(tok), device="cpu")  # target once
    num, den = measure_alpha(draft, ref)                       # α_TF = num / den, draft only

A record (prompt p of P tokens, response r of T tokens, r ending in EOS when finish_reason=eos) becomes
the input p + r[:-1]; the positions P−1 … P+T−2 are trained, their labels are r and, with top-k,
their teacher rows are the record's topk rows in order. Positions are counted row-major over the
padded [B, L] batch, which is also the order the losses see them in.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from distill.losses import TopKTeacher, VocabSubset, chunked_overlap, log_probs

REFERENCE_K = 1024  # target probabilities kept per held-out position for α_TF (exact up to the tail beyond)


@dataclass
class Example:
    id: str
    prompt_ids: list[int]
    response_ids: list[int]
    topk_ids: Optional[np.ndarray] = None  # [T, k] int
    topk_logits: Optional[np.ndarray] = None  # [T, k] float


def _nested(col) -> tuple[np.ndarray, np.ndarray]:
    """A pyarrow list<fixed_size_list<k>> column -> (row offsets [R+1], values [sum T, k])."""
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy()
    inner = arr.values  # fixed-size lists
    k = inner.type.list_size
    vals = inner.values.to_numpy(zero_copy_only=False).reshape(-1, k)
    base = offsets[0]
    return offsets - base, vals[base:offsets[-1]]


def to_examples(records: Any, max_seq_len: int, with_topk: bool = False) -> list[Example]:
    """Generated records (a datasets.Dataset in the generate format) -> Examples that fit max_seq_len.

    Too long: the prompt is cut from the left (keeping ≥ 1 token), then the response from the right.
    Records with an empty response carry no training signal and are dropped.
    """
    if getattr(records, "_indices", None) is not None:  # a selected/shuffled view: materialise its rows
        records = records.flatten_indices()
    table = records.data.table if hasattr(records, "data") else records
    ids = table.column("id").to_pylist()
    prompts = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    if with_topk:
        off_i, top_ids = _nested(table.column("topk_ids"))
        off_l, top_logits = _nested(table.column("topk_logits"))
    out = []
    for i, (rid, p, r) in enumerate(zip(ids, prompts, responses)):
        if not r:
            continue
        ti = tl = None
        if with_topk:
            ti, tl = top_ids[off_i[i]:off_i[i + 1]], top_logits[off_l[i]:off_l[i + 1]]
        if len(p) + len(r) - 1 > max_seq_len:
            p = p[-max(1, max_seq_len - (len(r) - 1)):]
            keep = max_seq_len - len(p) + 1
            r = r[:keep]
            if with_topk:
                ti, tl = ti[:keep], tl[:keep]
        out.append(Example(rid, list(p), list(r), ti, tl))
    return out


def split_holdout(examples: list[Example], n: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, holdout): n records chosen by a seeded shuffle (fixed for a run), the rest in order."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def collate(exs: list[Example], pad_id: int, device: Any = "cpu", with_topk: bool = False) -> dict:
    """Right-padded batch: input_ids, attention_mask [B, L]; positions (bool), labels [B, L]; topk rows [N, k]."""
    seqs = [e.prompt_ids + e.response_ids[:-1] for e in exs]
    L = max(len(s) for s in seqs)
    B = len(exs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, L), dtype=torch.bool)
    labels = torch.full((B, L), -100, dtype=torch.long)
    for b, (e, s) in enumerate(zip(exs, seqs)):
        P, T = len(e.prompt_ids), len(e.response_ids)
        input_ids[b, : len(s)] = torch.tensor(s)
        attention_mask[b, : len(s)] = 1
        positions[b, P - 1 : P - 1 + T] = True
        labels[b, P - 1 : P - 1 + T] = torch.tensor(e.response_ids)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "positions": positions, "labels": labels}
    if with_topk:
        batch["topk_ids"] = torch.from_numpy(np.concatenate([e.topk_ids for e in exs]).astype(np.int64))
        batch["topk_logits"] = torch.from_numpy(np.concatenate([e.topk_logits for e in exs]).astype(np.float32))
    return {k: v.to(device) for k, v in batch.items()}


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder stack returning normed hidden states, LM head) of an HF causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    return base.get_decoder(), base.get_output_embeddings()


class LogitScale:
    """Multiply a causal LM's logits by s through its final norm: the norm's affine output (weight, and
    bias if any) is scaled, which scales the logits exactly when the LM head is linear and bias-free.
    `ok` is False where the model has no such norm or the scaling is not exact (checked numerically,
    e.g. Gemma's (1 + w) norm or logit soft-capping)."""

    def __init__(self, model: torch.nn.Module):
        norm = getattr(decoder_and_head(model)[0], "norm", None)
        self.params = [p for p in (getattr(norm, "weight", None), getattr(norm, "bias", None)) if p is not None]
        self.orig = [p.detach().clone() for p in self.params]
        self.ok = bool(self.params) and self._exact(model)

    @torch.no_grad()
    def set(self, s: float) -> None:
        """Logits become s × those of the model as it was when this object was made."""
        for p, o in zip(self.params, self.orig):
            p.copy_(o * s)

    @torch.no_grad()
    def _exact(self, model: torch.nn.Module) -> bool:
        ids = torch.arange(1, 9, device=self.params[0].device).unsqueeze(0)
        was_training = model.training
        model.eval()
        ref = model(input_ids=ids).logits.float()
        self.set(2.0)
        got = model(input_ids=ids).logits.float()
        self.set(1.0)
        model.train(was_training)
        return bool(torch.allclose(got, 2 * ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max())))


@dataclass
class Reference:
    """The target's side of α_TF on fixed records: padded batches and top-K exact log-probs per position."""

    batches: list[dict] = field(default_factory=list)
    teachers: list[TopKTeacher] = field(default_factory=list)
    tail_mass: float = 0.0  # mean target probability outside the kept top-K (the most α_TF can be off by)


@torch.no_grad()
def holdout_reference(target: torch.nn.Module, exs: list[Example], batch_size: int, vocab: int, device: Any,
                      chunk_size: int = 512, k: int = REFERENCE_K) -> Reference:
    """Run the target once over exs; keep its top-k log-probs (normalised over the full vocabulary)."""
    ref = Reference()
    decoder, head = decoder_and_head(target)
    tails, n = 0.0, 0
    for s in range(0, len(exs), batch_size):
        b = collate(exs[s:s + batch_size], 0, device)
        hidden = decoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
        h = hidden[b["positions"]]  # [N, H]
        ids, vals = [], []
        for c in range(0, h.shape[0], chunk_size):
            lp = log_probs(head(h[c:c + chunk_size])[:, :vocab])  # [C, V]
            top = lp.topk(min(k, vocab), dim=-1)
            ids.append(top.indices.int())
            vals.append(top.values)
        ids_t, vals_t = torch.cat(ids), torch.cat(vals)
        tails += float((1 - vals_t.exp().sum(-1)).clamp(min=0).sum())
        n += h.shape[0]
        ref.batches.append(b)
        ref.teachers.append(TopKTeacher(ids_t, vals_t, normalized=True))
    ref.tail_mass = tails / max(n, 1)
    return ref


@torch.no_grad()
def measure_alpha(draft: torch.nn.Module, ref: Reference, device: Any = None, chunk_size: int = 512,
                  vocab: Optional[int] = None, subset: Optional[VocabSubset] = None) -> tuple[float, float]:
    """(Σ over held-out positions of Σ_x min(p, q), positions): α_TF's numerator and denominator.
    With a subset, q is the draft's softmax over it (zero elsewhere), as a draft vocabulary decodes."""
    was_training = draft.training
    draft.eval()
    decoder, head = decoder_and_head(draft)
    if subset is not None:
        head, vocab = subset.project(head), subset.size + 1
    num, den = 0.0, 0.0
    for b, teacher in zip(ref.batches, ref.teachers):
        if subset is not None:
            teacher = subset.restrict(teacher)[0]  # a normalised reference: p outside the subset is lost
        hidden = decoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
        s, c = chunked_overlap(hidden.float(), head, b["positions"], teacher, chunk_size, vocab)
        num, den = num + float(s), den + float(c)
    draft.train(was_training)
    return num, den


def teacher_forced_acceptance_on(target: torch.nn.Module, draft: torch.nn.Module, exs: list[Example], vocab: int,
                                 batch_size: int = 8, device: Any = "cpu") -> float:
    """α_TF of draft against target on target-generated examples (one call; no decoding)."""
    num, den = measure_alpha(draft, holdout_reference(target, exs, batch_size, vocab, device), device, vocab=vocab)
    return num / den if den else float("nan")


@torch.no_grad()
def sample_on_policy(model: torch.nn.Module, exs: list[Example], max_new_tokens: int, tok: Any, device: Any,
                     subset: Optional[VocabSubset] = None) -> list[Example]:
    """The same prompts with continuations the draft samples itself (temperature 1, ending at EOS inclusive);
    with a subset, from its softmax over the subset's ids (as a draft vocabulary decodes)."""
    was_training = model.training
    model.eval()
    L = max(len(e.prompt_ids) for e in exs)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (L - len(e.prompt_ids)) + e.prompt_ids for e in exs], device=device)
    mask = torch.tensor([[0] * (L - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in exs], device=device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tok.eos_token_id,
                         logits_processor=[_OnlySubset(subset)] if subset is not None else None)
    model.train(was_training)
    res = []
    for e, row in zip(exs, out[:, L:].tolist()):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        res.append(Example(e.id + "#on-policy", e.prompt_ids, row or [tok.eos_token_id]))
    return res


class _OnlySubset:
    """A generate() logits processor that leaves only a subset's ids sampleable."""

    def __init__(self, subset: VocabSubset):
        self.subset = subset

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -math.inf)
        ids = self.subset.ids.to(scores.device)
        return out.index_copy_(1, ids, scores.index_select(1, ids))
