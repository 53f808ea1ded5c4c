"""A causal LM together with its KV cache, for a batch whose rows advance at different speeds.

    kv = KVModel(model, vocab_size=None)
    kv.prefill(input_ids, attention_mask)          # [B, S] left-padded prompt, encoded once
    logits = kv.step(tokens, keep=k + 1)           # [B, q] new tokens -> [B, k+1, V] logits
    kv.rollback(q, keep, keep_host)                # row b keeps only the first keep[b] of the last q

How rows stay consistent: every row shares one cache length (a DynamicCache is a rectangle), and
a row that keeps fewer tokens than another gets *holes*: cache columns masked out of attention
for that row through the 2D attention mask. Positions are counted per row over unmasked columns
only, so rotary embeddings see each row as a contiguous sequence, exactly as without the holes.
Columns that are holes for every row are cropped off the end, so a batch of one never has any
hole and runs without a mask. Finished rows leave the batch (``select_rows``).

Sliding-window layers (Mistral, Gemma 2/3, Qwen2/3 with use_sliding_window, Phi-3) keep every past
column here, like full-attention layers: transformers' sliding-window cache keeps only the last
window - 1 columns and cannot give back the ones a rejected draft token pushed out. The window is
applied by the attention mask instead: the model's own mask when no row has holes (columns are then
positions), else a 4D mask built here that counts the window in each row's real tokens. The cost is
memory: such a layer's cache grows with the sequence like a full-attention layer's.

Works with transformers 4.46+ (``past_key_values=``) and 5.x (``cache=``).
"""
from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache

try:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
except ImportError:  # transformers 4.x before per-layer cache objects: plain DynamicCache
    DynamicLayer = DynamicSlidingWindowLayer = None

# Layer types whose cache KVModel keeps (and rolls back) as one growing full-length layer.
_ATTENTION_TYPES = ("full_attention", "sliding_attention")


def _forward_kwargs(model: torch.nn.Module) -> tuple[str, str | None]:
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


def _full_attention_layers(cache: DynamicCache) -> list:
    """The cache's layers if each is a full-attention DynamicLayer (transformers 5.x), else []."""
    layers = list(getattr(cache, "layers", None) or [])
    ok = DynamicLayer is not None and all(isinstance(x, DynamicLayer) and not x.is_sliding for x in layers)
    return layers if ok else []


def _text_config(model: torch.nn.Module):
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
    cfg = _text_config(model)
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


# -- multi-token steps on CPU: faster kernels for a few rows ---------------------------------------
# A verify pass feeds γ+1 tokens per row. CPU BLAS serves one row (gemv) near memory bandwidth but a
# handful of rows (sgemm) through a path that repacks the weight on every call, so verifying 5 tokens
# can cost well over a decoding step where the weights' memory traffic says ~1×. Two remedies, same math:
# - from PACKED_MIN_ROWS rows, MKL's prepacked GEMM: each weight is packed once per row count and
#   kept (a copy of the weights per row count in use; rebuilt when a weight changes in place);
# - below that, the transposed product (W @ xᵀ)ᵀ where it is faster, timed once per
#   (weight shape, rows, threads) on the real weight.
# Packing is faster at 5 rows and slower at 2, hence the threshold; mechanism: docs/decoder.md, "CPU fast
# paths"; timings: docs/measurements.md.
SMALL_ROWS = 16  # inputs of 2..SMALL_ROWS rows are candidates
PACKED_MIN_ROWS = 4
_CHOICE: dict[tuple, bool] = {}  # (out, in, rows, threads, dtype) -> use the transposed product
_plain_linear_forward = torch.nn.Linear.forward


_PACKING = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, dict]" = weakref.WeakKeyDictionary()


def _packed_weight(layer: torch.nn.Linear, rows: int) -> torch.Tensor:
    """layer.weight packed by MKL for `rows`-row inputs, kept while the layer lives (keyed by the
    weight's storage and in-place version, so an updated weight is packed again)."""
    w = layer.weight
    key = (rows, w.data_ptr(), w._version)
    cache = _PACKED.setdefault(layer, {})
    packed = cache.get(key)
    if packed is None:
        for k in [k for k in cache if k[0] == rows]:
            del cache[k]
        packed = cache[key] = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
    return packed


def _transposed(weight: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    return (weight @ x2d.t()).t()


def _faster_transposed(weight: torch.Tensor, x2d: torch.Tensor, reps: int = 5) -> bool:
    def best(fn) -> float:
        fn()  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: _transposed(weight, x2d)) < 0.9 * best(lambda: F.linear(x2d, weight))


def _small_rows_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // max(x.shape[-1], 1)
    w = self.weight
    if 1 < rows <= SMALL_ROWS and x.device.type == "cpu" and w.dim() == 2 and not torch.is_grad_enabled():
        x2d = x.reshape(rows, x.shape[-1])
        if _PACKING and rows >= PACKED_MIN_ROWS and w.dtype == torch.float32:
            y = torch.ops.mkl._mkl_linear(x2d.contiguous(), _packed_weight(self, rows), w, self.bias, rows)
            return y.reshape(*x.shape[:-1], w.shape[0])
        key = (*w.shape, rows, torch.get_num_threads(), w.dtype)
        use = _CHOICE.get(key)
        if use is None:
            use = _CHOICE[key] = _faster_transposed(w, x2d)
        if use:
            y = _transposed(w, x2d)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], w.shape[0])
    return _plain_linear_forward(self, x)


def plain_kernels_suffice(rows: int) -> bool:
    """Whether small_rows_kernels gains nothing at this row count: below the packed GEMM's threshold,
    and every weight timed at it chose the plain kernel (the wrapper alone then costs ~3% of a
    2-token step: ~200 Linear calls, a few µs each)."""
    if _PACKING and rows >= PACKED_MIN_ROWS:
        return False
    threads = torch.get_num_threads()
    timed = [use for (_, _, r, t, _), use in _CHOICE.items() if r == rows and t == threads]
    return bool(timed) and not any(timed)


@contextlib.contextmanager
def small_rows_kernels(enabled: bool = True) -> Iterator[None]:
    """Within this context, nn.Linear layers on 2..SMALL_ROWS CPU rows use the faster of two kernels."""
    if not enabled or torch.nn.Linear.forward is not _plain_linear_forward:
        yield
        return
    torch.nn.Linear.forward = _small_rows_linear_forward
    try:
        yield
    finally:
        torch.nn.Linear.forward = _plain_linear_forward


# -- a lean forward for Llama-style models ----------------------------------------------------------
# The same math as transformers' Llama/Qwen2 forward (its own modules: norms, rotary embedding,
# projections, MLP; SDPA with grouped KV heads), without the per-call machinery around it (mask
# builders, output records, kwargs plumbing); masked cache columns (left padding, a row's rejected
# tokens) become a boolean SDPA mask. Whether a model qualifies is checked once by comparing both
# forwards on a short two-row input, one row left-padded.
# On SmolLM2-135M the logits are bit-identical and every step is faster (docs/measurements.md).
_LEAN_TYPES = ("llama", "qwen2")
_LEAN_OK: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


# On CPU the lean forward runs q_proj, k_proj and v_proj as one Linear (a stacked copy of the three
# weights, 12% of SmolLM2-135M's parameters) and applies rotary embeddings to q and k at once: fewer,
# larger kernels, the same logits, slightly faster steps (docs/measurements.md). Stacking gate_proj and
# up_proj as well made steps slower, so the MLP keeps its own Linears.
_QKV: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _fused_qkv(attn: torch.nn.Module) -> torch.nn.Linear | None:
    """One Linear computing q_proj, k_proj and v_proj at once (their weights stacked), kept while the
    attention module lives and rebuilt when a weight or bias changes; None off CPU, with autograd on
    (the copy carries no gradient to the three weights) or if their biases are mixed."""
    if attn.q_proj.weight.device.type != "cpu" or torch.is_grad_enabled():
        return None
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    key = tuple((t.data_ptr(), t._version) if t is not None else None for p in parts for t in (p.weight, p.bias))
    hit = _QKV.get(attn)
    if hit is not None and hit[0] == key:
        return hit[1]
    biases = [p.bias for p in parts]
    if len({b is None for b in biases}) > 1:  # mixed
        fused = None
    else:
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors: packed kernels key on _version
            w = torch.cat([p.weight for p in parts])
            fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=biases[0] is not None, device=w.device,
                                    dtype=w.dtype).requires_grad_(False)
            fused.weight.copy_(w)
            if fused.bias is not None:
                fused.bias.copy_(torch.cat(biases))
    _QKV[attn] = (key, fused)
    return fused


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


# Feature taps (specdec.features.FeatureTaps): model -> an object whose record(i, h) receives the residual
# stream entering decoder layer i; the lean forward calls no layer module, so forward hooks cannot see it.
FEATURE_TAPS: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def lean_hidden(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor, cache, keep: int,
                cols: torch.Tensor | None = None):
    """Final hidden states [B, keep, H] of the last `keep` of tokens [B, q], appending to `cache`.

    cols [B, past + q] bool marks the cache columns (old and new) each row may attend to; None means
    all of them. A masked new token still attends to itself, so its (unused) output stays finite.
    """
    from transformers.models.llama.modeling_llama import rotate_half

    body = model.model
    h = body.embed_tokens(tokens)  # [B, q, H]
    B, q, _ = h.shape
    cos, sin = body.rotary_emb(h, position_ids)  # [B, q, D]
    cos, sin = cos[:, None], sin[:, None]
    past = cache.get_seq_length()
    mask = None
    if cols is not None or (q > 1 and past > 0):
        mask = torch.ones(q, past + q, dtype=torch.bool, device=h.device).tril(past)  # causal
    if cols is not None:  # [B, 1, q, past + q]: causal, without the masked columns, diagonal always kept
        diag = torch.zeros_like(mask)
        diag[:, past:] = torch.eye(q, dtype=torch.bool, device=h.device)
        mask = ((cols[:, None, :] & mask) | diag)[:, None]
    taps = FEATURE_TAPS.get(model)
    for i, layer in enumerate(body.layers):
        if taps is not None:
            taps.record(i, h)
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, h)
        qkv = _fused_qkv(attn)
        if qkv is not None:  # [B, heads + 2 kv heads, q, D]; rotary on the q and k heads at once
            heads = attn.q_proj.weight.shape[0] // attn.head_dim
            kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
            y = qkv(x).view(B, q, -1, attn.head_dim).transpose(1, 2)
            qk = y[:, : heads + kv_heads]
            qk = qk * cos + rotate_half(qk) * sin
            qs, ks, vs = qk[:, :heads], qk[:, heads:], y[:, heads + kv_heads :]
        else:
            shape = (B, q, -1, attn.head_dim)
            qs = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, q, D]
            ks = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv heads, q, D]
            vs = attn.v_proj(x).view(shape).transpose(1, 2)
            qs, ks = qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin
        ks, vs = cache.update(ks, vs, i)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None and q > 1,
                                           scale=attn.scaling, enable_gqa=ks.shape[1] != qs.shape[1])
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, q, -1))
        x = _rms_norm(layer.post_attention_layernorm, h)
        h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    return _rms_norm(body.norm, h[:, -keep:])


@torch.inference_mode()
def lean_forward_ok(model: torch.nn.Module) -> bool:
    """Whether lean_hidden + the LM head reproduce model(...).logits (checked once per model)."""
    ok = _LEAN_OK.get(model)
    if ok is None:
        ok = _LEAN_OK[model] = _check_lean(model)
    return ok


def _check_lean(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if (getattr(cfg, "model_type", None) not in _LEAN_TYPES or layers is None or not hasattr(model, "lm_head")
            or any(getattr(cfg, k, None) for k in ("use_sliding_window", "final_logit_softcapping"))
            or getattr(cfg, "pretraining_tp", 1) != 1
            or any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or []))
            or any(hasattr(layer.self_attn, "q_norm") for layer in layers)):
        return False
    device = model_device(model)
    try:
        # two rows, one left-padded (a masked column): 3 tokens, then 1
        ids = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]], device=device)
        cols = torch.tensor([[False, True, True, True], [True, True, True, True]], device=device)
        pos = (cols.long().cumsum(1) - 1).clamp(min=0)
        cache_arg = _forward_kwargs(model)[0]
        for holes in (False, True):
            rows = slice(None) if holes else slice(1, 2)  # without holes: the unpadded row alone
            x, c, p = ids[rows], cols[rows], pos[rows]
            ref_cache, lean_cache = new_cache(model), new_cache(model)
            ref = [model(input_ids=x[:, :3], attention_mask=c[:, :3].long(), position_ids=p[:, :3], use_cache=True,
                         **{cache_arg: ref_cache}).logits,
                   model(input_ids=x[:, 3:], attention_mask=c.long(), position_ids=p[:, 3:], use_cache=True,
                         **{cache_arg: ref_cache}).logits]
            got = [model.lm_head(lean_hidden(model, x[:, :3], p[:, :3], lean_cache, 3, c[:, :3] if holes else None)),
                   model.lm_head(lean_hidden(model, x[:, 3:], p[:, 3:], lean_cache, 1, c if holes else None))]
            real = c[:, :3, None].expand_as(ref[0])  # padded positions' outputs are never used
            for a, b in ((ref[0][real], got[0][real]), (ref[1], got[1])):
                if not bool((a - b).abs().max() <= 1e-5 * a.abs().max().clamp(min=1)):
                    return False
    except Exception:  # another architecture under a familiar name: use the model's own forward
        return False
    return True


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class KVModel:
    """A causal LM plus its KV cache, per-row positions and a [B, L] mask of the cached columns."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None):
        self.model = model
        self.width = logits_width(model)
        self.vocab_size = vocab_size or self.width
        if self.vocab_size > self.width:
            raise ValueError(
                f"vocab_size={self.vocab_size} exceeds the model's {self.width} logit columns; "
                "pass the tokenizer's size (len(tokenizer)) or leave vocab_size unset"
            )
        self.device = model_device(model)
        # Multi-token steps (verify, the draft's catch-up) after the prompt: pick the faster small-rows kernel.
        self.small_rows = self.device.type == "cpu"
        self._cache_arg, self._keep_arg = _forward_kwargs(model)
        body = getattr(model, "base_model", None)
        self._body_cache_arg = _forward_kwargs(body)[0] if body is not None else self._cache_arg
        self._lazy_ok: bool | None = None
        self.lean = lean_forward_ok(model)  # the lean forward (masked columns included)
        self.windows = attention_windows(model)  # {layer type: sliding window | None}; {} = no window
        # Models with per-layer types take one mask per type (a dict); Mistral-style ones a single mask.
        self._mask_per_type = getattr(_text_config(model), "layer_types", None) is not None
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if self.windows and impl not in ("sdpa", "eager"):
            raise NotImplementedError(
                f"sliding-window models are decoded with 4D attention masks, which attn_implementation={impl!r} "
                "does not take; load the model with attn_implementation='sdpa' (or 'eager')"
            )
        self._additive_mask = impl == "eager"  # eager attention adds the mask to the scores
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, capacity]
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] next position per row
        self.length = 0  # cache columns in use
        self.holes = False  # any masked column? (host-side, so the no-mask fast path costs no sync)
        self.calls = 0

    # -- forward -------------------------------------------------------------------------------
    def _kwargs(self, cache_arg: str, position_ids: torch.Tensor) -> dict:
        kwargs = {cache_arg: self.cache, "use_cache": True, "position_ids": position_ids}
        if self.holes:
            q = position_ids.shape[1]
            kwargs["attention_mask"] = self._window_masks(q) if self.windows else self.mask[:, : self.length]
        return kwargs

    def _window_masks(self, q: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """4D masks [B, 1, q, L] for the last q columns of a model with sliding-window layers.

        transformers counts a window in cache columns, which a row's holes would make too short; here
        it is counted in the row's real tokens: query token i sees real token j iff j <= i and
        i - j < window (in positions), as the model sees an unbroken sequence. A query column that is
        a hole still sees itself, so its (unused) output stays finite. One mask per layer type (a dict)
        for models that have layer_types, else the sliding one alone.
        """
        L, dev = self.length, self.device
        cols = self.mask[:, :L]  # [B, L]
        pos = cols.long().cumsum(1)  # [B, L] position of each column in its row (+1), holes repeat
        idx = torch.arange(L, device=dev)
        query = idx[L - q :, None]  # [q, 1] the new columns
        causal = cols[:, None, :] & (idx[None, :] <= query)[None]  # [B, q, L]
        diag = (idx[None, :] == query)[None]  # [1, q, L]
        masks: dict[str, torch.Tensor] = {}
        for kind, window in self.windows.items():
            if kind in masks:
                continue
            m = causal if window is None else causal & (pos[:, L - q :, None] - pos[:, None, :] < window)
            m = (m | diag)[:, None]  # [B, 1, q, L]
            if self._additive_mask:
                dtype = self.model.dtype
                m = torch.zeros(m.shape, dtype=dtype, device=dev).masked_fill_(~m, torch.finfo(dtype).min)
            masks[kind] = m
        return masks if self._mask_per_type else masks["sliding_attention"]

    def _cols(self) -> torch.Tensor | None:
        return self.mask[:, : self.length] if self.holes else None

    def _kernels(self, tokens: torch.Tensor):
        """small_rows_kernels for a multi-token CPU step, unless they are known to gain nothing at its rows."""
        return small_rows_kernels(self.small_rows and tokens.shape[1] > 1 and not plain_kernels_suffice(tokens.numel()))

    def _forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        self.calls += 1
        with self._kernels(tokens):
            if self.lean:
                hidden = lean_hidden(self.model, tokens, position_ids, self.cache, max(keep, 1), self._cols())
                logits = self.model.lm_head(hidden)  # [B, keep, width]
            else:
                kwargs = self._kwargs(self._cache_arg, position_ids)
                if self._keep_arg is not None:
                    kwargs[self._keep_arg] = max(keep, 1)  # 0 would mean "all positions" to the model
                logits = self.model(input_ids=tokens, **kwargs).logits  # [B, keep or q, width]
        return logits[:, -keep:, : self.vocab_size] if keep else logits[:, :0]

    # -- lazy head: hidden states now, logits only for the positions that are needed -------------
    @property
    def lazy_head_ok(self) -> bool:
        """Whether head(body(x)) reproduces the model's logits (checked once on a 3-token input), so
        a verify pass can skip the LM head for positions after a row's first rejection."""
        if self._lazy_ok is None:
            self._lazy_ok = self._check_lazy_head()
        return self._lazy_ok

    @torch.inference_mode()
    def _check_lazy_head(self) -> bool:
        body = getattr(self.model, "base_model", None)
        if body is None or body is self.model or self.model.get_output_embeddings() is None:
            return False
        x = torch.tensor([[1, 2, 3]], device=self.device)  # no cache involved
        full = self.model(input_ids=x, use_cache=False).logits[..., : self.vocab_size].float()
        lazy = self.head(body(input_ids=x, use_cache=False).last_hidden_state).float()
        return bool((full - lazy).abs().max() <= 1e-4 * full.abs().max().clamp(min=1))

    def step_hidden(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Like step(), but returns the final hidden states [B, q, H]; apply head() where needed."""
        position_ids = self._append(tokens, valid)
        self.calls += 1
        with self._kernels(tokens):
            if self.lean:
                return lean_hidden(self.model, tokens, position_ids, self.cache, tokens.shape[1], self._cols())
            kwargs = self._kwargs(self._body_cache_arg, position_ids)
            return self.model.base_model(input_ids=tokens, **kwargs).last_hidden_state

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on hidden states [..., H] -> logits [..., V] (the first vocab_size columns)."""
        return self.model.get_output_embeddings()(hidden)[..., : self.vocab_size]

    def _reserve(self, q: int) -> None:
        need = self.length + q
        if need > self.mask.shape[1]:
            grow = torch.zeros(self.mask.shape[0], max(need, 2 * self.mask.shape[1]) - self.mask.shape[1],
                               dtype=torch.bool, device=self.device)
            self.mask = torch.cat([self.mask, grow], dim=1)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Start a new batch: encode the (left-padded) context once. [B, S] ids, [B, S] bool mask."""
        B, S = input_ids.shape
        self.cache = new_cache(self.model)
        self.mask = torch.zeros(B, S + 256, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(B, dtype=torch.long, device=self.device)
        self.length, self.holes, self.calls = 0, False, 0
        if S == 0:
            return
        self.holes = bool((~attention_mask).any())
        self.step(input_ids, attention_mask if self.holes else None, keep=0)
        self.calls = 0  # prefill is not a decoding step

    def step(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
        """Append tokens [B, q] (``valid`` [B, q] marks real tokens; None = all) -> logits [B, keep, V].

        Padding inside ``tokens`` must be on the left of each row: a row's real tokens get positions
        pos[b], pos[b]+1, ... in order.
        """
        return self._forward(tokens, self._append(tokens, valid), keep)

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Book q new columns (mask, positions); returns their position ids [B, q]."""
        q = tokens.shape[1]
        self._reserve(q)
        L = self.length
        if valid is None:
            self.mask[:, L : L + q] = True
            position_ids = self.pos[:, None] + torch.arange(q, device=self.device)  # [B, q]
            self.pos += q
        else:
            self.mask[:, L : L + q] = valid
            self.holes = True
            position_ids = (self.pos[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)  # [B, q]
            self.pos += valid.long().sum(1)
        self.length = L + q
        return position_ids

    # -- rollback ------------------------------------------------------------------------------
    def rollback(self, q: int, keep: torch.Tensor, keep_host: list[int]) -> None:
        """Row b keeps only the first keep[b] of the last q cached columns; the rest are forgotten.

        keep [B] long (device) and keep_host (the same numbers on the host). Columns no row keeps
        are cropped from the cache; the others become holes for the rows that drop them.
        """
        if q == 0:
            return
        lo_keep, hi_keep = min(keep_host), max(keep_host)
        L = self.length
        if lo_keep < hi_keep or self.holes:
            cols = self.mask[:, L - q : L]  # [B, q]
            kept = cols & (torch.arange(q, device=self.device)[None, :] < keep[:, None])  # [B, q]
            self.pos -= (cols & ~kept).long().sum(1)
            self.mask[:, L - q : L] = kept
            self.holes = self.holes or lo_keep < hi_keep
        else:
            self.pos -= q - hi_keep
        trim = q - hi_keep
        if trim > 0:
            self.cache.crop(-trim)  # negative: number of trailing columns to drop (4.46+ and 5.x)
            self.mask[:, L - trim : L] = False
            self.length = L - trim

    def absorb(self, other: "KVModel") -> None:
        """Append the rows of ``other`` (same model, its own prefill) below this batch's rows.

        The shorter of the two is left-padded with hole columns, so a batch can take in new prompts
        while its rows decode (continuous batching). Needs the full-length layer caches new_cache builds
        for full and sliding-window attention (transformers 5.x); raises NotImplementedError for others.
        """
        layers_a, layers_b = _full_attention_layers(self.cache), _full_attention_layers(other.cache)
        if not layers_a or not layers_b:
            raise NotImplementedError("absorb needs transformers 5.x full-attention (DynamicLayer) caches")
        La, Lb = self.length, other.length
        L = max(La, Lb)

        def stack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [Ba, ., La, .] + [Bb, ., Lb, .] -> [Ba+Bb, ., L, .]
            out = a.new_zeros(a.shape[0] + b.shape[0], a.shape[1], L, a.shape[3])
            out[: a.shape[0], :, L - La :] = a
            out[a.shape[0] :, :, L - Lb :] = b
            return out

        for x, y in zip(layers_a, layers_b):
            x.keys, x.values = stack(x.keys, y.keys), stack(x.values, y.values)
        Ba, Bb = self.pos.shape[0], other.pos.shape[0]
        mask = torch.zeros(Ba + Bb, L + 256, dtype=torch.bool, device=self.device)
        mask[:Ba, L - La : L] = self.mask[:, :La]
        mask[Ba:, L - Lb : L] = other.mask[:, :Lb]
        self.mask, self.pos, self.length = mask, torch.cat([self.pos, other.pos]), L
        self.holes = self.holes or other.holes or La != Lb

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch). rows [B'] long.

        Leading columns that none of the kept rows attends to are dropped in the same copy, so with
        continuous batching (absorb) the cache spans the oldest live row, not the batch's whole history:
        otherwise every absorbed row is padded to that ever-growing length, and each selection and step
        costs more the longer the stream runs.
        """
        mask = self.mask[rows]
        layers = _full_attention_layers(self.cache)
        first = 0
        if layers and all(x.is_initialized for x in layers):
            live = mask[:, : self.length].any(0)
            first = int(live.long().argmax()) if bool(live.any()) else 0
        if first:
            for x in layers:
                x.keys, x.values = x.keys[rows, :, first:], x.values[rows, :, first:]
            self.length -= first
        else:
            self.cache.batch_select_indices(rows)
        self.mask = mask[:, first:]
        self.pos = self.pos[rows]
        self.holes = self.holes and not bool(self.mask[:, : self.length].all())
