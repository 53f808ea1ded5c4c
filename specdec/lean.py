"""A lean forward for Llama-style models (Llama, Qwen2): the same math as transformers' forward without
its per-call machinery, checked against it once per model (``lean_forward_ok``); KVModel's ``fast``
option turns it on. Mechanism: docs/decoder.md, "CPU fast paths".
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from .cache import forward_kwargs, model_device, new_cache

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
        cache_arg = forward_kwargs(model)[0]
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
