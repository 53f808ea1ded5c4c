"""The model's KV cache as KVModel keeps it: every attention layer grows in place and can drop any
number of trailing columns (sliding-window layers included), plus what KVModel reads off a model.

    cache = new_cache(model); windows = attention_windows(model); width = logits_width(model)
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

try:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
except ImportError:  # transformers 4.x before per-layer cache objects: plain DynamicCache
    DynamicLayer = DynamicSlidingWindowLayer = None

# Layer types whose cache KVModel keeps (and rolls back) as one growing full-length layer.
_ATTENTION_TYPES = ("full_attention", "sliding_attention")


def forward_kwargs(model: torch.nn.Module) -> tuple[str, str | None]:
    """Name of the cache argument and of the keep-only-last-logits argument of ``model.forward``."""
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    keep_arg = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
    return cache_arg, keep_arg


def logits_width(model: torch.nn.Module) -> int:
    """Number of logit columns the model produces (may exceed the tokenizer size: padded embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.vocab_size)


if DynamicLayer is not None:

    class GrowingLayer(DynamicLayer):
        """A full-attention cache layer whose keys/values are views into buffers with spare columns, so
        a step writes its new columns in place; DynamicLayer concatenates, copying the whole cache every
        step (about 15 MB per layer and step for 32 rows of 300 tokens in SmolLM2-135M).

        Cropping keeps the buffer (a shorter view). Anything that replaces keys/values (row selection,
        KVModel.absorb) is noticed on the next update and copied into a fresh buffer.
        """

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._bufs = None
            n, q = self.get_seq_length(), key_states.shape[-2]
            buf = self._bufs[0] if self._bufs is not None else None
            if (buf is None or n + q > buf.shape[-2] or buf.shape[:-2] != key_states.shape[:-2]
                    or (n and self.keys.data_ptr() != buf.data_ptr())):
                cap = n + q + max(128, (n + q) // 2)
                self._bufs = tuple(s.new_empty(*s.shape[:-2], cap, s.shape[-1]) for s in (key_states, value_states))
                if n:
                    self._bufs[0][..., :n, :] = self.keys
                    self._bufs[1][..., :n, :] = self.values
            kb, vb = self._bufs
            kb[..., n : n + q, :] = key_states
            vb[..., n : n + q, :] = value_states
            self.keys, self.values = kb[..., : n + q, :], vb[..., : n + q, :]
            return self.keys, self.values


def full_attention_layers(cache: DynamicCache) -> list:
    """The cache's layers if each is a full-attention DynamicLayer (transformers 5.x), else []."""
    layers = list(getattr(cache, "layers", None) or [])
    ok = DynamicLayer is not None and all(isinstance(x, DynamicLayer) and not x.is_sliding for x in layers)
    return layers if ok else []


def text_config(model: torch.nn.Module):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def attention_windows(model: torch.nn.Module) -> dict[str, int | None]:
    """Sliding windows of the model's attention layers: {layer type: window, or None for full attention};
    {} when no layer has a window (or transformers is 4.x, whose DynamicCache keeps every column anyway).

    Read from the cache transformers builds for the model, so it follows the same config rules
    (layer_types, use_sliding_window, max_window_layers). Raises NotImplementedError for layer kinds
    whose cache cannot be rolled back by dropping columns (linear attention, chunked attention, shared KV).
    """
    if DynamicLayer is None:
        return {}
    try:
        layers = DynamicCache(config=model.config).layers
    except TypeError:
        return {}
    cfg = text_config(model)
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:  # Mistral, Phi-3: every layer sliding when config.sliding_window is set
        types = ["sliding_attention" if x.is_sliding else "full_attention" for x in layers]
    kinds = {type(x) for x in layers}
    if not kinds <= {DynamicLayer, DynamicSlidingWindowLayer} or not set(types) <= set(_ATTENTION_TYPES):
        raise NotImplementedError(
            f"speculative decoding needs attention caches that can be rolled back (full or sliding-window "
            f"attention); {type(model).__name__} has layer types {sorted(set(types))} with caches "
            f"{sorted(k.__name__ for k in kinds)}"
        )
    windows = {t: (x.sliding_window if x.is_sliding else None) for t, x in zip(types, layers)}
    return windows if any(w is not None for w in windows.values()) else {}


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache for ``model`` whose full and sliding-window attention layers all keep every
    column (GrowingLayer), so that any number of trailing columns can be dropped (see the module
    docstring); other layer kinds are left as transformers builds them."""
    try:
        cache = DynamicCache(config=model.config)  # 5.x: layer types (sliding window, ...) from the config
    except TypeError:
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if DynamicLayer is not None and layers and all(type(x) in (DynamicLayer, DynamicSlidingWindowLayer)
                                                   for x in layers):
        cache.layers = [GrowingLayer() for _ in layers]
    return cache



def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
