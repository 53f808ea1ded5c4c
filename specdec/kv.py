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

import torch
from transformers import DynamicCache

from .cache import (  # noqa: F401 (logits_width, model_device: kv's public names)
    attention_windows, forward_kwargs, full_attention_layers, logits_width, model_device, new_cache, text_config,
)
from .lean import lean_forward_ok, lean_hidden
from .small_rows import plain_kernels_suffice, small_rows_kernels

class KVModel:
    """A causal LM plus its KV cache, per-row positions and a [B, L] mask of the cached columns."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None, fast: str | bool = "auto"):
        """fast: "auto" uses the CPU fast paths where they apply (the lean forward when it reproduces the
        model's logits, the small-rows kernels on CPU; both the same math); False uses neither."""
        if fast not in ("auto", False):
            raise ValueError(f"fast must be 'auto' or False (got {fast!r})")
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
        self.small_rows = fast == "auto" and self.device.type == "cpu"
        self._cache_arg, self._keep_arg = forward_kwargs(model)
        body = getattr(model, "base_model", None)
        self._body_cache_arg = forward_kwargs(body)[0] if body is not None else self._cache_arg
        self._lazy_ok: bool | None = None
        self.lean = fast == "auto" and lean_forward_ok(model)  # the lean forward (masked columns included)
        self.windows = attention_windows(model)  # {layer type: sliding window | None}; {} = no window
        # Models with per-layer types take one mask per type (a dict); Mistral-style ones a single mask.
        self._mask_per_type = getattr(text_config(model), "layer_types", None) is not None
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
        layers_a, layers_b = full_attention_layers(self.cache), full_attention_layers(other.cache)
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
        layers = full_attention_layers(self.cache)
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
