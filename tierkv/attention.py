"""Attention kernels over tiered KV: query-blocked causal prefill and decode steps.

Shapes follow one sequence (batch 1): queries ``(q_heads, t, head_dim)``, keys and values
``(kv_heads, n, head_dim)``; GQA groups the ``q_heads`` as ``(kv_heads, q_heads // kv_heads)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels

MASS_BLOCK_BYTES = 64 << 20  # fp32 scores of one query block when the probabilities are kept


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     block: int = 512, column_mass: bool = False, expand_gqa: bool | None = None):
    """Exact causal attention of ``t`` new queries over ``n >= t`` keys, one query block at a time.

    Query ``i`` sits at position ``n - t + i`` and sees keys ``[0, n - t + i]``. Peak memory is at
    most one block's scores, ``(q_heads, block, n)``, not ``(q_heads, t, n)``.

    Parameters
    ----------
    q : Tensor, shape (q_heads, t, head_dim)
    k, v : Tensor, shape (kv_heads, n, head_dim)
    column_mass : also return the attention mass each key received, summed over queries and the
        query heads of its GQA group: Tensor, shape (kv_heads, n) (H2O's accumulated attention).
    expand_gqa : repeat each block's keys and values for the query heads of their GQA group
        before SDPA instead of passing ``enable_gqa``. None (the default) does so on CUDA: there,
        SDPA with ``enable_gqa`` and a mask falls back to its math kernel, which materialises the
        block's scores; measured on an H100 (torch 2.11) for one SmolLM2 layer (9 query heads,
        3 kv heads), the peak allocation was 244 / 421 / 1,671 MB at 4K / 8K / 32K tokens, and
        41 / 81 / 318 MB with the keys repeated (same outputs up to 2e-6). On a CPU, SDPA's
        own kernel does not materialise them (one 8K layer: 50 MB more peak RSS, where one
        block's scores are 151 MB), and a repeat would only cost a copy.

    A CPU attends a whole prompt over no past (``n == t``, no ``column_mass``) in one causal
    SDPA call instead: its kernel skips the blocks above the diagonal and needs no mask. One 8K
    SmolLM2 layer on the 2-core machine: 543 ms against 662 in 512-query blocks (the outputs
    equal), ~3.5 s of an 8K prompt's 38 s through ``TieredCache``.

    With ``column_mass`` the probabilities are materialised, so blocks hold at most
    ``MASS_BLOCK_BYTES`` of scores: one 32K-token SmolLM2 layer with 512-query blocks raised
    the peak RSS by 1.9 GB.

    Returns
    -------
    out : Tensor, shape (q_heads, t, head_dim); mass : Tensor or None.
    """
    heads, t, dim = q.shape
    kv_heads, n, _ = k.shape
    past = n - t
    if past == 0 and not column_mass and not q.is_cuda:
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                             is_causal=True, scale=scaling,
                                             enable_gqa=kv_heads != heads)[0]
        return out, None
    if expand_gqa is None:
        expand_gqa = q.is_cuda
    repeat = heads // kv_heads if expand_gqa and heads != kv_heads else 1
    out = torch.empty_like(q)
    mass = torch.zeros(kv_heads, n, dtype=torch.float32, device=q.device) if column_mass else None
    if column_mass:
        block = max(1, min(block, MASS_BLOCK_BYTES // (4 * heads * n)))
    for b0 in range(0, t, block):
        b1 = min(t, b0 + block)
        stop = past + b1
        rows = torch.arange(past + b0, stop, device=q.device).unsqueeze(1)
        allowed = torch.arange(stop, device=q.device).unsqueeze(0) <= rows  # (bt, stop)
        qb, kb, vb = q[:, b0:b1], k[:, :stop], v[:, :stop]
        if mass is None:
            if repeat > 1:
                kb, vb = kb.repeat_interleave(repeat, 0), vb.repeat_interleave(repeat, 0)
            out[:, b0:b1] = F.scaled_dot_product_attention(
                qb.unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0), attn_mask=allowed,
                scale=scaling, enable_gqa=kb.shape[0] != heads)[0]
            continue
        probs = _probs(qb, kb, scaling, allowed)  # (kv, g, bt, stop)
        mass[:, :stop] += probs.sum(dim=(1, 2))
        out[:, b0:b1] = _weighted(probs, vb).reshape(heads, b1 - b0, dim)
    return out, mass


def attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                        peak: bool = False, queries: int | None = None,
                        block_bytes: int = MASS_BLOCK_BYTES):
    """``causal_attention`` of a few new queries (a question to a saved document) and, from the
    same probabilities, ``recent_query_mass`` of all of them: one pass over the keys where the
    two took two. One kv head and one block of queries at a time: at most ``block_bytes`` of
    fp32 scores (``group * block * n``; the whole question at once for SmolLM2 up to 256 queries
    over 21K keys), twice that as the softmax makes the probabilities beside them. A 256-token
    question over 128K keys, 4 query heads on 1 kv head (peak RSS growth, 2026-11-29): 154 MB,
    where one block of all the queries took 1,068 MB. SmolLM2's shapes over 7.6K keys on the
    2-core CPU (2026-11-29): 5.5 against 9.7 ms for 18 queries, 10.5 against 16.0 for 32
    (outputs within 2e-7, masses equal).

    q : Tensor, shape (q_heads, t, head_dim); k, v : Tensor, shape (kv_heads, n >= t, head_dim).
    Returns out, shape (q_heads, t, head_dim), and the mass (of the last ``queries`` queries
    when given, else of all), shape (n,), fp32; with ``peak`` also each key's largest weight
    over the query heads and all the queries, shape (n,), fp32 (what a filter layer chooses
    by, ``omnikv``).
    """
    heads, t, dim = q.shape
    kv_heads, n, _ = k.shape
    out = torch.empty_like(q)
    mass = torch.zeros(n, dtype=torch.float32, device=q.device)
    top = torch.zeros_like(mass) if peak else None
    last = t - min(t, queries or t)
    block = max(1, block_bytes // (4 * (heads // kv_heads) * n))
    for b0 in range(0, t, block):
        b1 = min(t, b0 + block)
        stop = n - t + b1  # the block's queries are the last ``b1 - b0`` of these keys
        for h, heads_of, probs in _causal_probs_by_kv_head(q[:, b0:b1], k[:, :stop], scaling):
            if b1 > last:
                mass[:stop] += probs[:, :, max(0, last - b0):].sum(dim=(0, 1, 2))
            if peak:
                torch.maximum(top[:stop], probs.amax(dim=(0, 1, 2)), out=top[:stop])
            out[heads_of, b0:b1] = _weighted(probs, v[h:h + 1, :stop]).reshape(-1, b1 - b0, dim)
            del probs  # before the next kv head's are made
    return (out, mass, top) if peak else (out, mass)


def recent_query_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, queries: int) -> torch.Tensor:
    """Attention mass each of ``n`` keys gets from the last ``queries`` of ``t`` new queries
    (query ``i`` at position ``n - t + i`` sees keys up to it), summed over those queries and all
    query heads, each (head, query) row summing to one: Tensor (n,), fp32 (SnapKV's observation
    window). One kv head at a time: at most ``group * queries * n`` scores at once.

    q : Tensor, shape (q_heads, t, head_dim); k : Tensor, shape (kv_heads, n, head_dim).
    """
    recent = q[:, q.shape[1] - min(queries, q.shape[1]):]
    mass = torch.zeros(k.shape[1], dtype=torch.float32, device=q.device)
    for _, _, probs in _causal_probs_by_kv_head(recent, k, scaling):
        mass += probs.sum(dim=(0, 1, 2))
    return mass


def _causal_probs_by_kv_head(q: torch.Tensor, k: torch.Tensor, scaling: float):
    """For each kv head ``h``: ``(h, its query heads' slice, probabilities)``, those of the
    ``t`` queries ``q`` (q_heads, t, head_dim), the last ``t`` of the ``n`` positions, each
    seeing the keys up to its own: shape (1, group, t, n), fp32."""
    heads, t, _ = q.shape
    kv_heads, n, _ = k.shape
    group = heads // kv_heads
    rows = torch.arange(n - t, n, device=q.device).unsqueeze(1)
    allowed = torch.arange(n, device=q.device).unsqueeze(0) <= rows  # (t, n)
    for h in range(kv_heads):
        heads_of = slice(h * group, (h + 1) * group)
        yield h, heads_of, _probs(q[heads_of], k[h:h + 1], scaling, allowed)


def _probs(q: torch.Tensor, k: torch.Tensor, scaling: float, allowed=None, bias=None) -> torch.Tensor:
    """Softmax probabilities in fp32, shape (kv_heads, group, t, n).

    The query heads of a GQA group are stacked as rows of one matrix product per kv head: a
    product broadcasting the keys over the group copies them once per query head (8 ms, not 0.7,
    for 9 query heads over 3.3K keys on a 2-core CPU)."""
    kv_heads, n = k.shape[0], k.shape[1]
    group, t = q.shape[0] // kv_heads, q.shape[1]
    qg = q.reshape(kv_heads, group * t, q.shape[2]).float()
    scores = torch.bmm(qg, k.float().transpose(1, 2)).mul_(scaling).view(kv_heads, group, t, n)
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))  # its own tensor: no second copy
    return torch.softmax(scores, dim=-1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """A decode step's attention: ``t`` query tokens over ``n >= t`` keys, the last ``t`` of
    which are their own (query ``i`` sees keys ``[0, n - t + i]``); one token sees all.

    On a CPU one token takes the C kernel where it runs (``DecodeAccumulator``), reading the
    keys and values where they lie, head rows apart included (no copy of a block's window
    slice). A decode step's attention over ~1K tokens of SmolLM2 (9 query heads, 3 kv heads,
    fp32), one thread, 2-core machine, 2026-11-27: 109-112 us against SDPA's 181-233 us in one
    measurement, 100 against 86 in another; ``bench.decode``'s ``tierkv`` case (25 such calls
    a step), one process: 114.3 against 119.3 ms a token, then 102.6 against 102.9. Several
    tokens (a pass verifying drafted ones) go through one masked SDPA call.

    q : Tensor, shape (q_heads, t, head_dim); k, v : Tensor, shape (kv_heads, n, head_dim).
    Returns Tensor, shape (q_heads, t, head_dim).
    """
    if q.dim() != 3 or 0 in q.shape or k.dim() != 3 or k.shape[0] < 1 or q.shape[1] > k.shape[1] \
            and q.shape[1] > 1:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} and keys {tuple(k.shape)}: expected "
                         "(q_heads, t, head_dim) and (kv_heads, n >= t, head_dim), none empty")
    t = q.shape[1]
    if t == 1 and q.is_cpu and k.shape[1] and _kernel_takes(q.shape[0], k, v):
        acc = DecodeAccumulator(q[:, 0], scaling, native=True)
        acc.add(k, v)
        return acc.result().to(q.dtype)
    mask = None if t == 1 else _own_tokens(t, k.shape[1], q.device)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask,
                                          scale=scaling, enable_gqa=q.shape[0] != k.shape[0])[0]


def scored_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                            allowed: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """Decode attention that also returns the probabilities (for filter layers and H2O); ``t``
    query tokens see the keys as in ``decode_attention``.

    allowed : bool Tensor broadcastable to (kv_heads, group, 1, n), or None for all keys.
    bias : float Tensor broadcastable to (kv_heads, group, 1, n) added to the scores (e.g. the
        log of a compensation token's count), or None.

    Returns
    -------
    out : Tensor, shape (q_heads, t, head_dim); probs : Tensor, shape (kv_heads, group * t, n),
    fp32 (query head ``h``'s token ``i`` in row ``(h % group) * t + i``; 0 where not seen): a
    key's largest or summed weight over the rows is over the heads and the tokens.
    """
    t, n = q.shape[1], k.shape[1]
    if t > 1:
        if t > n:
            raise ValueError(f"scored_decode_attention: {t} query tokens over {n} keys: the last "
                             "t keys are the queries' own")
        own = _own_tokens(t, n, q.device)
        allowed = own if allowed is None else allowed & own
    probs = _probs(q, k, scaling, allowed, bias)
    return _weighted(probs, v).reshape(q.shape), probs.flatten(1, 2)


def _own_tokens(t: int, n: int, device) -> torch.Tensor:
    """Which of ``n`` keys each of the last ``t`` positions sees: BoolTensor (t, n)."""
    return torch.ones(t, n, dtype=torch.bool, device=device).tril(n - t)


def _weighted(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``probs`` (kv_heads, group, t, n) times ``v`` (kv_heads, n, head_dim): (kv_heads, group * t,
    head_dim), one matrix product per kv head (no copy of ``v`` per query head)."""
    kv_heads, group, t, n = probs.shape
    return torch.bmm(probs.reshape(kv_heads, group * t, n).to(v.dtype), v)


class DecodeAccumulator:
    """Decode attention of one query token over keys and values that arrive in parts (tiers,
    fetch batches), merged by log-sum-exp: once every part is added, ``result()`` is the
    attention over all of them together, without concatenating them.

    On a CPU, parts go through the C kernel ``tierkv.kernels.decode_attend`` where it runs
    (``tierkv.kernels``: AVX2, head_dim a multiple of 8, up to 8 query heads a kv head): it reads
    fp16, bf16 or fp32 keys and values once, converting each row in registers, and keeps the
    running softmax state in place (``bench.scale``'s 4 layers x 32 query heads x 128 dims over
    81 records of 64 fp16 tokens: 12 ms against 25 with torch, one thread). Otherwise each part
    is attended once in fp32 with torch; fp16 / bf16 parts are converted first (on a CPU, fp16
    matrix products are several times slower than converting and multiplying in fp32). Both give
    the same attention up to fp32 rounding.

    Parameters
    ----------
    q : Tensor, shape (..., q_heads, head_dim); leading dims (e.g. layers) batch independent
        attentions.
    scaling : the softmax scale.
    native : use the C kernel for CPU parts: None (default) when it is built, True requires it
        (ValueError when it is not built), False never.
    """

    def __init__(self, q: torch.Tensor, scaling: float, native: bool | None = None):
        if native not in (None, True, False):
            raise ValueError(f"native={native!r}: expected None, True or False")
        if native and kernels.decode_attend is None:
            raise ValueError("native=True: tierkv._native's kernels are not built (reinstall "
                             "tierkv with a C compiler) or this CPU lacks AVX2, FMA or F16C")
        if q.dim() < 2 or 0 in q.shape:
            raise ValueError(f"q {tuple(q.shape)}: expected (..., q_heads, head_dim), none empty")
        self._q = (q.float() * scaling).contiguous()
        # the running state lives on q's device: the kernel takes it where that is the CPU
        self._native = (native is not False and kernels.decode_attend is not None
                        and self._q.is_cpu)
        self._top = self._sum = self._out = None

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Attend to one part: ``k``, ``v`` of shape (..., kv_heads, n, head_dim), n >= 1, with
        q's leading dims; q_heads = kv_heads * g (query head ``h`` reads kv head ``h // g``)."""
        self._check(k, v)
        if self._native and _kernel_takes(self._q.shape[-2], k, v):
            self._add_native(k, v)
            return
        *lead, kv_heads, _, dim = k.shape
        qg = self._q.reshape(*lead, kv_heads, -1, dim)
        scores = qg @ k.float().transpose(-1, -2)  # (..., kv_heads, g, n)
        top = scores.amax(dim=-1, keepdim=True)
        if self._top is not None:
            top = torch.maximum(top, self._top)
        probs = scores.sub_(top).exp_()
        out, total = probs @ v.float(), probs.sum(dim=-1, keepdim=True)
        if self._top is not None:
            decay = (self._top - top).exp_()
            out.add_(self._out * decay)
            total.add_(self._sum * decay)
        self._top, self._sum, self._out = top, total, out

    def result(self) -> torch.Tensor:
        """The attention output, shape (..., q_heads, 1, head_dim), fp32."""
        if self._out is None:
            raise ValueError("DecodeAccumulator.result: no part was added")
        return (self._out / self._sum).reshape(*self._q.shape[:-1], 1, self._q.shape[-1])

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        lead, (q_heads, dim) = self._q.shape[:-2], self._q.shape[-2:]
        if k.dim() != self._q.dim() + 1 or k.shape[:-3] != lead or k.shape[-1] != dim:
            raise ValueError(f"keys {tuple(k.shape)}: expected (*{tuple(lead)}, kv_heads, n, {dim}) "
                             f"for q {tuple(self._q.shape)}")
        kv_heads, n = k.shape[-3], k.shape[-2]
        if n < 1 or kv_heads < 1 or q_heads % kv_heads:
            raise ValueError(f"keys {tuple(k.shape)}: need n >= 1 and kv_heads dividing "
                             f"q_heads={q_heads}")
        if v.shape[:-1] != k.shape[:-1]:
            raise ValueError(f"values {tuple(v.shape)} do not match keys {tuple(k.shape)}")
        if self._top is not None and self._top.shape[-3] != kv_heads:
            raise ValueError(f"keys {tuple(k.shape)}: {kv_heads} kv heads, the parts before had "
                             f"{self._top.shape[-3]}")

    def _add_native(self, k: torch.Tensor, v: torch.Tensor) -> None:
        *lead, kv_heads, n, dim = k.shape
        g = self._q.shape[-2] // kv_heads
        if self._top is None:
            self._top = torch.full((*lead, kv_heads, g, 1), float("-inf"))
            self._sum = torch.zeros(*lead, kv_heads, g, 1)
            self._out = torch.zeros(*lead, kv_heads, g, dim)
        else:  # torch's path made these (contiguous results), maybe in another shape's add
            self._top, self._sum, self._out = (s.contiguous() for s in
                                               (self._top, self._sum, self._out))
        stride = _row_stride(k, v)
        if stride is None:
            k, v = k.contiguous(), v.contiguous()
            stride = n
        rows = k.numel() // (n * dim)  # every (leading index, kv head)
        kernels.decode_attend(self._q.data_ptr(), k.data_ptr(), v.data_ptr(), self._top.data_ptr(),
                              self._sum.data_ptr(), self._out.data_ptr(), rows, g, n, dim,
                              kernels.KINDS[k.dtype], stride)


def _kernel_takes(q_heads: int, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C kernel, built for this CPU, takes keys ``k`` and values ``v`` (...,
    kv_heads, n, head_dim) for ``q_heads`` query heads: CPU tensors of one shape and dtype, in
    the groups and head_dims it reads."""
    return (kernels.decode_attend is not None and k.is_cpu and v.is_cpu and k.dtype is v.dtype
            and v.shape == k.shape and q_heads % k.shape[-3] == 0
            and kernels.fits(q_heads // k.shape[-3], k.shape[-1], k.dtype))


def _row_stride(k: torch.Tensor, v: torch.Tensor) -> int | None:
    """Tokens from one (leading index, kv head) row of ``k`` and ``v`` (..., n, head_dim) to
    the next, when each row's tokens are contiguous and every row is that far from the one
    before in both (a window's tokens in a block with room left after them); else None."""
    if k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1]:
        return None
    dims = [(size, step) for size, step in zip(k.shape[:-2], k.stride()[:-2]) if size > 1]
    if not dims:
        return k.shape[-2]
    row = expected = dims[-1][1]
    for size, step in reversed(dims):
        if step != expected:
            return None
        expected = step * size
    if row % k.shape[-1] or row < k.shape[-2] * k.shape[-1]:
        return None
    return row // k.shape[-1]
