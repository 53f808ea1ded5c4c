"""Exact greedy replay: every counter of a greedy speculative run, without running the decoder.

    from specdec.replay import replay, model_proposals, lookup_proposals
    y = autoregressive_generate(target, [prompt], max_new_tokens=128).tokens[0]   # the target's answer
    m = replay(y, model_proposals(draft_argmax(draft, prompt, y)[0]), gamma=2, max_new_tokens=128, stop={eos})
    m.acceptance_rate, m.tokens_per_target_call, m.target_calls                    # as decoding would count

Why it is exact: under greedy decoding every accepted prefix equals the target's own greedy answer y,
so the tokens a drafter proposes in a round depend only on the prompt and y[:e] (e = tokens emitted
before the round). ``replay`` walks the rounds of ``SpeculativeDecoder.generate`` at batch 1 — the
same γ policy, the same budget rule (k = min(γ, budget left − 1)), the same stop rule — asking a
``Proposals`` function for each round's block, and records the same ``SpecMetrics`` counters.

For a model drafter one teacher-forced pass over prompt + y gives every proposal that can matter:
the j-th proposal of a round is only tested when proposals 1..j−1 were accepted, i.e. equal y, and
then it is the draft's argmax after prompt + y[:e+j−1]. Proposals after the first miss are never
tested, so any token will do there. The one way replay and decoding can differ is a float tie: a
draft (or target) argmax whose top-2 logit gap is within rounding of zero, where the cached
incremental forward and the teacher-forced one may pick different tokens (``draft_argmax`` returns
the gaps so a caller can tell).
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

import torch

from .decoder import GammaPolicy, _emit
from .drafters import PromptLookupDrafter
from .metrics import SpecMetrics

Proposals = Callable[[int, int], Sequence[int]]  # (tokens emitted e, k) -> up to k proposed tokens


def replay(y: Sequence[int], proposals: Proposals, gamma: int, max_new_tokens: int, stop: Collection[int],
           gamma_policy: str = "constant", gamma_min: int = 1, gamma_max: int | None = None) -> SpecMetrics:
    """The counters of greedy speculative decoding of one prompt whose target answer is ``y``.

    y: the target's greedy answer, ending with a stop token or exactly ``max_new_tokens`` long.
    proposals(e, k): the block the drafter proposes after e emitted tokens when asked for k (it may
    return fewer; none makes the round a plain target step, as for prompt lookup without a match).
    """
    y = list(y)
    stops = set(stop)
    if not y or not (y[-1] in stops or len(y) == max_new_tokens) or any(t in stops for t in y[:-1]):
        raise ValueError(f"y must be a greedy answer: ending with a stop token or {max_new_tokens} tokens long, "
                         f"with no stop token before its end (got {len(y)} tokens)")
    policy = GammaPolicy(gamma, gamma_policy, gamma_min, gamma_max)
    m = SpecMetrics(batch_size=1, gamma=gamma, gamma_policy=gamma_policy)
    out: list[int] = []
    while True:
        e = len(out)
        k = min(policy.gamma, max_new_tokens - e - 1)
        block = [int(t) for t in proposals(e, k)][:k] if k > 0 else []
        k = len(block)
        n = 0
        while n < k and e + n < len(y) and block[n] == y[e + n]:
            n += 1
        # the target's token after the accepted prefix; past the end only when y's stop token was accepted
        emitted = block[:n] + y[e + n : e + n + 1]
        kept, reason = _emit(out, emitted, stops, max_new_tokens)
        m.target_calls += 1
        m.draft_calls += k
        m.record(k, min(n, kept), n < k and kept == n + 1, kept)
        if reason:
            return m
        policy.update(k, [n])


@torch.inference_mode()
def draft_argmax(model: torch.nn.Module, prompt: Sequence[int], y: Sequence[int], vocab_size: int | None = None,
                 vocab: torch.Tensor | None = None) -> tuple[list[int], list[float]]:
    """(pred, gap): pred[i] = the draft's argmax after prompt + y[:i], gap[i] = its top-1 − top-2 logit.

    One teacher-forced forward pass. vocab_size: compare only the first vocab_size logits (padded
    embedding rows); vocab: a draft vocabulary (token ids), as ``ModelDrafter(vocab=...)`` decodes.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(y)], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(y)].float()  # [len(y), V]
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    if vocab is not None:
        vocab = vocab.to(device)
        logits = logits[:, vocab]
    top = logits.topk(min(2, logits.shape[-1]), dim=-1)
    pred = top.indices[:, 0] if vocab is None else vocab[top.indices[:, 0]]
    gap = top.values[:, 0] - top.values[:, -1] if logits.shape[-1] > 1 else torch.full_like(top.values[:, 0], 1e9)
    return pred.tolist(), gap.tolist()


def model_proposals(pred: Sequence[int]) -> Proposals:
    """Proposals of a model drafter from its teacher-forced argmax ``pred`` (see ``draft_argmax``)."""
    def propose(e: int, k: int) -> list[int]:
        return list(pred[e : e + k]) + [-1] * max(0, e + k - len(pred))  # past y's end: never tested
    return propose


def lookup_proposals(prompt: Sequence[int], y: Sequence[int], drafter: PromptLookupDrafter | None = None) -> Proposals:
    """Proposals of prompt lookup: its block for the context prompt + y[:e]."""
    drafter = drafter or PromptLookupDrafter()
    context = list(prompt) + list(y)
    n = len(prompt)
    return lambda e, k: drafter.lookup(context[: n + e], k)


def near_ties(gap: Sequence[float], tie_gap: float) -> list[int]:
    """Positions whose top-2 logit gap is below ``tie_gap``: where float rounding can flip an argmax."""
    return [i for i, g in enumerate(gap) if g < tie_gap]


def hybrid_proposals(prompt: Sequence[int], y: Sequence[int], model: Sequence[int] | Proposals,
                     drafter: PromptLookupDrafter | None = None) -> Proposals:
    """Proposals of specdec.hybrid.HybridDrafter: prompt lookup's block where it finds a match, else the
    model's: its teacher-forced argmax ``pred``, or any Proposals (a feature head's, for HybridHeadDrafter)."""
    look = lookup_proposals(prompt, y, drafter)
    other = model if callable(model) else model_proposals(model)
    return lambda e, k: look(e, k) or other(e, k)
