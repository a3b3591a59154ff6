"""Min/max key summaries of chunks and their upper-bound score (LKA, from LeoAM and Quest).

A chunk's summary is the per-head, per-dimension minimum and maximum of its keys (post-RoPE, as
stored). For a query ``q`` and every key ``k`` of the chunk,
``q . k <= sum_d max(q_d * kmin_d, q_d * kmax_d)``, so a chunk can be ranked without reading it.

The bound is computed as ``q+ . kmax + q- . kmin`` (``q+``, ``q-``: the positive and negative
parts of ``q``), two matrix products straight from the summaries, with no elementwise pass over
them but the one that gives ``max(|kmin|, |kmax|)`` for the slack below. On a CPU the C kernel
``tierkv.kernels.bound_scores`` (where it runs) computes the same sums in one pass over the summaries, each
fp16 / bf16 row converted in registers (4,096 chunks x 8 KV heads x 128 dims of fp16: 3.2 ms
against 7.6 with torch, one thread); it sums in another order, which the slack covers as well.

Everything is computed in fp32: fp16 and bf16 keys convert to fp32 exactly, so ``kmin``/``kmax``
are exact. The bound's two d-term sums (each ``d`` contributes to one of them) and anyone's fp32
dot product ``q . k`` each carry a rounding error of at most
``gamma_(d+1) * sum_d |q_d| max(|kmin_d|, |kmax_d|)`` with ``gamma_d = d u / (1 - d u)``,
``u = 2**-24``; the bound adds ``4 gamma_(d+4)`` times that scale, which covers both and the
slack's own rounding, so it stays an upper bound of the *computed* ``q . k`` as well as of the
exact one.
"""
from __future__ import annotations

import math

import torch

from . import kernels

_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_UNIT_ROUNDOFF = 2.0 ** -24
_SCORE_BLOCK = 512  # chunks scored at once by ``bound_scores``


def _check_keys(keys: torch.Tensor) -> None:
    if not isinstance(keys, torch.Tensor) or keys.dim() != 3:
        raise ValueError(f"keys: expected a tensor (kv_heads, n, head_dim), got "
                         f"{tuple(keys.shape) if isinstance(keys, torch.Tensor) else type(keys)}")
    if keys.dtype not in _KEY_DTYPES:
        raise ValueError(f"keys dtype {keys.dtype}: must be float16, bfloat16 or float32")
    if keys.shape[1] == 0:
        raise ValueError("keys: a chunk needs at least one token")


def _check_bounds(bounds: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(bounds, torch.Tensor) or bounds.dim() != 1 or bounds.numel() < 2:
        raise ValueError("bounds: expected a 1-D LongTensor (m+1,) with m >= 1")
    bounds = bounds.to(torch.long)
    if bounds[0] != 0 or bounds[-1] != n or bool((bounds[1:] <= bounds[:-1]).any()):
        raise ValueError(f"bounds must increase strictly from 0 to {n}, "
                         f"got {bounds.tolist()[:8]}...")
    return bounds


def summarize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of one chunk.

    Parameters
    ----------
    keys : Tensor, shape (kv_heads, n, head_dim), fp16/bf16/fp32, post-RoPE.

    Returns
    -------
    kmin, kmax : Tensor, shape (kv_heads, head_dim), fp32.
    """
    _check_keys(keys)
    # min and max are exact in the keys' own dtype: converting the results, not the keys, needs
    # no chunk-sized temporary (one per chunk fragments the heap of a long write loop)
    return keys.amin(dim=1).float(), keys.amax(dim=1).float()


def segment_minmax(kmin: torch.Tensor, kmax: torch.Tensor, bounds: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Min of ``kmin`` and max of ``kmax`` over consecutive segments of the first axis.

    Parameters
    ----------
    kmin, kmax : Tensor, shape (n, ...), fp32.
    bounds : LongTensor, shape (m+1,), strictly increasing from 0 to n.

    Returns
    -------
    Tensor, Tensor, shape (m, ...): segment ``i`` reduces rows ``[bounds[i], bounds[i+1])``.
    """
    n = kmin.shape[0]
    bounds = _check_bounds(bounds, n)
    m = bounds.numel() - 1
    starts, sizes = bounds[:-1], bounds.diff()
    lo, hi = kmin[starts], kmax[starts]  # each segment's first row; only the others reduce
    if m < n:  # (a tree merges a few leaves at a time: most segments are one row)
        segment = torch.repeat_interleave(torch.arange(m), sizes)
        rest = torch.ones(n, dtype=torch.bool)
        rest[starts] = False
        index = segment[rest].view(-1, *([1] * (kmin.dim() - 1))).expand(-1, *kmin.shape[1:])
        lo.scatter_reduce_(0, index, kmin[rest], "amin")
        hi.scatter_reduce_(0, index, kmax[rest], "amax")
    return lo, hi


def summarize_segments(keys: torch.Tensor, bounds: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of consecutive chunks of one key tensor, without a loop over chunks.

    Parameters
    ----------
    keys : Tensor, shape (kv_heads, n, head_dim), fp16/bf16/fp32, post-RoPE.
    bounds : LongTensor, shape (m+1,), chunk ``i`` is tokens ``[bounds[i], bounds[i+1])``.

    Returns
    -------
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim), fp32.
    """
    _check_keys(keys)
    k = keys.float().transpose(0, 1)  # (n, kv_heads, head_dim)
    return segment_minmax(k, k, bounds)


def merge_summaries(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of the union of chunks: elementwise min / max over the first axis.

    Parameters
    ----------
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim).

    Returns
    -------
    Tensor, Tensor, shape (kv_heads, head_dim).
    """
    if kmin.shape != kmax.shape or kmin.dim() != 3 or kmin.shape[0] == 0:
        raise ValueError(f"kmin {tuple(kmin.shape)} / kmax {tuple(kmax.shape)}: expected equal "
                         "non-empty shapes (m, kv_heads, head_dim)")
    return kmin.amin(dim=0), kmax.amax(dim=0)


def _gamma(head_dim: int) -> float:
    terms = head_dim + 4  # the d-term dot products, centre/radius rounding, the final additions
    return terms * _UNIT_ROUNDOFF / (1 - terms * _UNIT_ROUNDOFF)


def _group_product(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(kv_heads, g, d) x (m, kv_heads, d) -> (m, kv_heads, g), one batched matmul."""
    return torch.bmm(q, k.permute(1, 2, 0)).permute(2, 0, 1)


def _grouped_query(query: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    m, kv_heads, head_dim = kmin.shape
    if query.dim() != 2 or query.shape[1] != head_dim or query.shape[0] % kv_heads:
        raise ValueError(f"query {tuple(query.shape)}: expected (kv_heads * g, {head_dim}) "
                         f"with kv_heads={kv_heads}")
    return query.float().view(kv_heads, -1, head_dim)


def bound_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of ``q . k`` over each chunk's keys, per query head.

    Parameters
    ----------
    query : Tensor, shape (q_heads, head_dim), post-RoPE; q_heads = kv_heads * g (GQA: query
        head ``h`` reads kv head ``h // g``).
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim).

    Returns
    -------
    Tensor, shape (m, kv_heads, g), fp32: ``sum_d max(q_d kmin_d, q_d kmax_d)``, computed as
    ``q+ . kmax + q- . kmin``, plus the fp32 rounding slack
    ``4 gamma * |q| . max(|kmin|, |kmax|)`` (module docstring).
    """
    q = _grouped_query(query, kmin)
    alpha = 4 * _gamma(q.shape[-1])
    m = kmin.shape[0]
    if kernels.bound_scores is not None and _native_fits(q, kmin, kmax):
        out = torch.empty(m, q.shape[0], q.shape[1])
        q, kmin, kmax = q.contiguous(), kmin.contiguous(), kmax.contiguous()
        kernels.bound_scores(q.data_ptr(), kmin.data_ptr(), kmax.data_ptr(), out.data_ptr(), m,
                             q.shape[0], q.shape[1], q.shape[2], kernels.KINDS[kmin.dtype], alpha)
        return out
    pos, neg, mag = q.clamp(min=0), q.clamp(max=0), q.abs()
    out = torch.empty(m, q.shape[0], q.shape[1], device=q.device)
    # A block of chunks at a time: its fp32 copies of the summaries stay in the cache, and fp16
    # summaries (half the memory, exact for fp16 keys) cost no more to score than fp32 ones.
    for b0 in range(0, m, _SCORE_BLOCK):
        b1 = min(m, b0 + _SCORE_BLOCK)
        lo, hi = kmin[b0:b1].float(), kmax[b0:b1].float()
        bound = _group_product(pos, hi).add_(_group_product(neg, lo))
        out[b0:b1] = bound.add_(_group_product(mag, _magnitude(lo, hi)), alpha=alpha)
    return out


def _native_fits(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> bool:
    """The C kernel takes CPU summaries of one dtype and shape, (m, kv_heads, head_dim), within
    its limits (``tierkv.kernels.fits``)."""
    return (q.is_cpu and kmin.is_cpu and kmax.is_cpu and kmin.dtype == kmax.dtype
            and kmin.shape == kmax.shape and kmin.dim() == 3
            and kmin.shape[1:] == (q.shape[0], q.shape[2])
            and kernels.fits(q.shape[1], q.shape[2], kmin.dtype))


def _magnitude(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``max(|lo|, |hi|)`` elementwise for ``lo <= hi``, as ``max(hi, -lo)``: one new tensor."""
    out = lo.neg()
    return torch.maximum(out, hi, out=out)


def rounding_margin(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """How far fp32 rounding may push a chunk's layer-level score below a sub-chunk's, (m,).

    In exact arithmetic a union's bound is never below a part's; computed bounds may differ by
    up to this much, so pruning keeps a node when ``score + margin >= threshold``.
    """
    q = _grouped_query(query, kmin)
    kabs = _magnitude(kmin.float(), kmax.float())
    return 8 * _gamma(q.shape[-1]) * _group_product(q.abs(), kabs).amax(dim=(1, 2))


def chunk_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-kv-head and layer-level bound scores of chunks.

    Parameters
    ----------
    query : Tensor, shape (q_heads, head_dim).
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim).

    Returns
    -------
    per_head : Tensor, shape (m, kv_heads): max over the GQA group's query heads.
    per_layer : Tensor, shape (m,): max over all heads.
    """
    per_head = bound_scores(query, kmin, kmax).amax(dim=2)
    return per_head, per_head.amax(dim=1)


def criticality(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, sizes: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
    """Quest's chunk criticality, estimated per query head and compared across heads.

    Every query head estimates a chunk's attention mass from its bound of the largest logit,
    ``scale * bound - log(size)`` (for equal-size chunks: Quest's ranking by the bound; a large
    chunk pays for the tokens it brings, as in ``select.select_by_query``). Each head's estimates
    are then standardised over the chunks (mean 0, standard deviation 1) and a chunk scores its
    best over all query heads. The bounds of one head are offset by a slack that differs from
    head to head by several times (it grows with the spread of the keys in the dimensions the
    query weighs), so on raw bounds the loosest heads take the budget and a retrieval head's
    chunk, whose own bound stands far above that head's other chunks, ranks low. Standardising
    keeps every head's own ranking; for equal-size chunks it is unchanged when a head's query
    is scaled.

    Parameters
    ----------
    query : Tensor, shape (q_heads, head_dim).
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim).
    sizes : LongTensor, shape (m,), tokens per chunk.
    scale : the attention's logit scale, ``head_dim ** -0.5`` by default.

    Returns
    -------
    Tensor, shape (m,), fp32: higher is more critical.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    estimate = bound_scores(query, kmin, kmax).flatten(1) * scale - sizes.float().log()[:, None]
    centred = estimate - estimate.mean(dim=0)
    spread = centred.square().mean(dim=0).sqrt().clamp(min=torch.finfo(torch.float32).eps)
    return (centred / spread).amax(dim=1)


def attention_shares(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """Estimated attention each chunk receives, from its min/max box, as a log.

    A query head's logit for a chunk is estimated at the centre of the chunk's box,
    ``scale * q . (kmin + kmax) / 2``, and a softmax over the chunks turns that head's logits
    into shares of its attention (a chunk counts as one key at its centre: weighting by its
    size ranked worse on SmolLM2); a chunk's estimate is its mean share over the query heads,
    as attention mass is measured (mean over heads). The upper bound (``bound_scores``) is a
    poor estimate of mass: it exceeds the centre's logit by ``|q| . (kmax - kmin) / 2``, which
    grows with the spread of the chunk's keys, so wide chunks and loose heads outrank the
    chunks the attention actually reads (on SmolLM2, ``bench.selection``); per-head shares
    also stop one head's logit scale from deciding for all heads.

    Parameters
    ----------
    query : Tensor, shape (q_heads, head_dim), post-RoPE.
    kmin, kmax : Tensor, shape (m, kv_heads, head_dim).
    scale : the attention's logit scale, ``head_dim ** -0.5`` by default.

    Returns
    -------
    Tensor, shape (m,), fp32: ``log`` of the mean over query heads of each head's share.
    """
    shares = head_shares(query, kmin, kmax, scale)
    return shares.logsumexp(dim=1) - math.log(shares.shape[1])


def head_shares(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                scale: float | None = None) -> torch.Tensor:
    """Each query head's estimated attention share of each chunk, as a log: the softmax over the
    chunks of the logit at the centre of each chunk's box (see ``attention_shares``).

    query : Tensor, shape (q_heads, head_dim); kmin, kmax : Tensor, shape (m, kv_heads, head_dim).
    Returns Tensor, shape (m, q_heads), fp32 (query head ``h`` reads kv head ``h // g``).
    """
    q = _grouped_query(query, kmin)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    centre = (kmin.float() + kmax.float()) * (scale / 2)
    return _group_product(q, centre).flatten(1).log_softmax(dim=0)
