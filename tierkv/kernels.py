"""tierkv's C kernels over tensors (``tierkv._native``, sources in ``native/``): decode attention
(``decode_attend``, used by ``attention.DecodeAccumulator``; ``decode_attend_parts``, over parts
read where they lie, used by ``scattered.attend_parts``), LKA chunk bounds (``bound_scores``,
used by ``summary.bound_scores``) and a filter layer's choice of leaves (``fill_units``, used by
``OmniKV._fill``).

The first three read fp16, bf16 or fp32 rows once and convert them in registers, on x86-64 CPUs
with AVX2, FMA and F16C, for head_dim a multiple of ``DIM_STEP`` and up to ``MAX_GROUP`` query
heads a kv head; ``fill_units`` is plain C. Where the extension is not built, or (the first
three) this CPU lacks those instructions, they are ``None`` and their callers take torch's path
(a portable scalar C loop was 4x slower than torch's vectorised attention). Their arguments are
addresses: callers check shapes, dtypes and contiguity.
"""
from __future__ import annotations

import torch

KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernels' ``kind``
MAX_GROUP = 8  # query heads a kv head (native/simd.h: their accumulators stay in registers)
DIM_STEP = 8   # head_dim a multiple of this (one AVX2 register of fp32)

try:
    from ._native import fill_units
except ImportError:
    fill_units = None
try:
    from ._native import bound_scores, decode_attend, decode_attend_parts, kernels_ready
except ImportError:  # not built (no compiler), or built from an older source
    bound_scores = decode_attend = decode_attend_parts = None
else:
    if not kernels_ready():
        bound_scores = decode_attend = decode_attend_parts = None


def fits(group: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernels take ``group`` query heads a kv head of ``head_dim`` dims of ``dtype``
    (CPU tensors, where the kernels exist)."""
    return 1 <= group <= MAX_GROUP and head_dim % DIM_STEP == 0 and dtype in KINDS
