"""The target's hidden states at chosen layers, recorded while it runs (what a feature head reads).

    with FeatureTaps(target, layers=(2, 15, 27)) as taps:
        target(input_ids=ids)                     # or any KVModel step / prefill of this target
        feats = taps.take()                       # [B, q, 3·H]: the last forward's states, layer order

Layer id j records the residual stream *entering* decoder layer j (the output of layer j - 1), as
vLLM's EAGLE-3 capture does. Both forwards are covered: the model's own (a forward pre-hook on each
chosen decoder layer) and kv.py's lean forward (which calls no layer module; it reports through
lean.FEATURE_TAPS).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .lean import FEATURE_TAPS


class FeatureTaps:
    """Records, per forward pass, the hidden states entering `layers` of `model`'s decoder."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int]):
        self.model, self.layers = model, tuple(sorted(int(j) for j in layers))
        blocks = model.get_decoder().layers
        bad = [j for j in self.layers if not 0 <= j < len(blocks)]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist: the model has {len(blocks)} decoder layers")
        self._got: dict[int, torch.Tensor] = {}
        self._hooks = [blocks[j].register_forward_pre_hook(self._hook(j), with_kwargs=True) for j in self.layers]
        FEATURE_TAPS[model] = self

    def _hook(self, j: int):
        def pre(module, args, kwargs):
            self.record(j, args[0] if args else kwargs["hidden_states"])

        return pre

    def record(self, i: int, h: torch.Tensor) -> None:
        if i in self.layers:
            self._got[i] = h

    def take(self) -> torch.Tensor:
        """The states of the last forward, concatenated in layer order: [B, q, n·H]; then forgotten."""
        missing = [j for j in self.layers if j not in self._got]
        if missing:
            raise RuntimeError(f"no hidden states were recorded for layers {missing}: run a forward pass first")
        feats = torch.cat([self._got[j] for j in self.layers], dim=-1)
        self._got = {}
        return feats

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if FEATURE_TAPS.get(self.model) is self:
            del FEATURE_TAPS[self.model]

    def __enter__(self) -> "FeatureTaps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
