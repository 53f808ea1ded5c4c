"""Faster CPU kernels for Linear layers fed a few rows (a verify pass, a draft's catch-up): MKL's
prepacked GEMM from PACKED_MIN_ROWS rows, the transposed product below that where it is faster. The
same math as nn.Linear; on only inside ``small_rows_kernels()`` (KVModel's ``fast`` option).

Mechanism: docs/decoder.md, "CPU fast paths"; timings: docs/measurements.md.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F

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
