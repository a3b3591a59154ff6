"""Attention over a fetch's records where they lie, on a CPU: no packed copy of them.

On a CPU the device tier is host memory, so packing a layer group's records into one block
(``pipeline.transfer``) copies bytes attention could read in place: at 8K tokens of SmolLM2 a
``tierkv`` decode step packed ~45 MB, 17 MB of it on the decoding thread (layers 0 and 1 and
the filter layers, whose fetch is known only from their query) and the rest on the fetch
threads, beside the step's own compute on the same two cores. A group fetched for a policy that
reads parts (``Policy.reads_parts``) is delivered ``Scattered`` (its records as the tiers hold
them) with the table of their addresses, made where the parts are gathered (``scattered``:
on a fetch thread for a group fetched ahead, not on the decoding thread), and each layer
attends its parts and its recent window in one call of ``kernels.decode_attend_parts`` (each
kv head's scores over every part merged once, the next parts' keys prefetched: they lie
apart).

Measured on the 2-core CPU, ``bench.decode``'s 8K ``tierkv`` case (device 5 % / host 20 % of
the KV), one cache decoding alternate blocks of 8 steps packed and in place (the first step of
each block left out), 2026-11-28, ms a token (CPU ms a step):

=====================================  =============  =============  =============
run                                    packed         decoding       every fetch
                                                      thread's only  in place
=====================================  =============  =============  =============
24 rounds                              115.8          111.7          -
12 rounds                              113.3 (124.7)  114.3 (125.1)  111.7 (117.9)
16 rounds                              112.1 (122.5)  108.5 (119.0)  107.1 (113.3)
=====================================  =============  =============  =============

The filter layers' attention functions took 15-16 ms a step against 16-19 packed. The gain is a
few percent, below what one run resolves, but it went the same way in five runs of six, and the
CPU time fell by 5-9 ms a step, so every fetch reads in place. The kernel alone attends 100
records of 8 tokens as fast as a packed block when they are cached (147 against 126 us) and
~1.6x slower when they are not; the records a step reads are mostly last step's. With
``fetch_ahead`` on top (the preselected candidates looked up while the layers before compute,
nothing to copy now), the filter layers took 10.3 ms but the selecting layers waited longer
(20.7 against 13.7): 111.0 ms a token, not kept.

The kernel call is the whole of a layer's attention: it scales the query, keeps the softmax
state and normalises the output (and the probabilities a filter layer scores with) itself, so a
layer costs Python one call and two allocations. Made with torch beside the kernel, those took
~150 us a layer inside a decode step against ~280 us for the kernel; one cache decoding
alternate blocks of 8 steps each way (12 rounds, 2026-11-28): 94.9 against 101.2 ms a token
(median 93.0 against 98.9), 101.7 against 108.9 CPU ms a step.
Making the table (and counting the bytes) of ~100 parts took ~0.9 ms a group inside a step on
the decoding thread, ~5 ms a step; made with the delivery instead, one cache alternating the
two (12 rounds, twice, 2026-11-28): 101.8 against 110.9 and 90.4 against 91.9 ms a token
(medians 97.2 against 110.5, 85.4 against 90.0).

Tried first on 2026-11-27, when decode attention ran SDPA on two threads over a packed block
against the kernel on one thread in place: the copy stage's time fell by three quarters and the
stall from 0.31-0.32 of the step to 0.24, but the steps were no faster (168.2 against 172.6 ms,
then 174.7 against 168.8). Not kept then; since, the packed path runs the kernel on one thread
too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernels
from .attention import decode_attention, scored_decode_attention
from .storage.base import KVBlock

FIELDS = 7  # a table row: k, v addresses; k, v layer strides; k, v head strides (bytes); tokens


class Scattered(NamedTuple):
    """A layer group's fetched records as they are held, in plan order (a CPU delivery that
    is not packed): each KVBlock (layers, kv_heads, tokens, head_dim), contiguous, and
    ``table``, their addresses (int64 (parts, FIELDS)). Made by ``scattered``."""

    parts: tuple[KVBlock, ...]
    table: torch.Tensor
    tokens: int
    nbytes: int


def scattered(parts) -> Scattered:
    """``parts`` (alike KVBlocks) delivered where they lie, with the table of their addresses:
    made once, where the parts are gathered (on a fetch thread, for a group fetched ahead), for
    every layer of the group. A part that is not contiguous (a view into a larger block) is
    copied first; the tiers hold contiguous copies, so a fetch's parts are read in place."""
    parts = tuple(parts)
    if not parts:
        raise ValueError("scattered: no parts")
    dtype = parts[0].keys.dtype
    rows = [(k.data_ptr(), v.data_ptr(), k.shape[2], k.is_contiguous() and v.is_contiguous(),
             k.numel(), v.numel(), k.dtype is dtype and v.dtype is dtype) for k, v in parts]
    if not all(row[3] for row in rows):
        parts = tuple(p if row[3] else KVBlock(p.keys.contiguous(), p.values.contiguous())
                      for p, row in zip(parts, rows))
        rows = [(k.data_ptr(), v.data_ptr()) + row[2:] for (k, v), row in zip(parts, rows)]
    layers, heads, _, dim = parts[0].keys.shape
    at = torch.tensor(rows, dtype=torch.long)
    lengths = at[:, 2]
    if not bool(((at[:, 4] == lengths * (layers * heads * dim)) & (at[:, 5] == at[:, 4])
                 & (at[:, 6] == 1)).all()):  # the kernel reads every part as the first
        raise ValueError(f"scattered: parts must all be {layers} layers x {heads} kv heads x "
                         f"head_dim {dim}, {dtype}, keys and values alike")
    row_bytes = dim * parts[0].keys.element_size()
    table = torch.empty(len(rows), FIELDS, dtype=torch.long)
    table[:, :2] = at[:, :2]
    table[:, 2:4] = (lengths * (heads * row_bytes)).unsqueeze(1)
    table[:, 4:6] = (lengths * row_bytes).unsqueeze(1)
    table[:, 6] = lengths
    tokens = int(lengths.sum())
    return Scattered(parts, table, tokens, 2 * layers * heads * row_bytes * tokens)


def reads_in_place(shape, device: torch.device) -> bool:
    """Whether ``attend_parts`` runs for KV of ``shape`` (a KVShape) on ``device``: a CPU, the
    kernel built for this CPU, and a GQA group and head_dim it reads."""
    q_heads, kv_heads = shape.q_heads or shape.kv_heads, shape.kv_heads
    return (torch.device(device).type == "cpu" and kernels.decode_attend_parts is not None
            and q_heads % kv_heads == 0
            and kernels.fits(q_heads // kv_heads, shape.head_dim, shape.dtype))


class GroupTable(NamedTuple):
    """The addresses of a Scattered group's attended tokens: int64 (rows, FIELDS), and what
    keeps them alive."""

    table: torch.Tensor
    tokens: int
    parts: tuple[KVBlock, ...]
    keep: torch.Tensor | None


def group_table(block: Scattered, keep: torch.Tensor | None) -> GroupTable:
    """The table of ``block``'s tokens, or of those at ``keep`` (ascending indices into the
    parts' tokens in order): one row per run of adjacent kept tokens within a part."""
    parts, table = block.parts, block.table
    if keep is None:
        return GroupTable(table, block.tokens, parts, None)
    if keep.numel() and (int(keep[0]) < 0 or int(keep[-1]) >= block.tokens):
        raise ValueError(f"group_table: keep runs from {int(keep[0])} to {int(keep[-1])}, outside "
                         f"the {block.tokens} tokens of the parts")
    lengths = table[:, 6]
    row_bytes = parts[0].keys.shape[3] * parts[0].keys.element_size()
    starts = torch.cumsum(lengths, 0) - lengths
    part = torch.searchsorted(starts, keep, right=True) - 1
    new_run = torch.ones(keep.numel(), dtype=torch.bool)
    new_run[1:] = (keep.diff() != 1) | (part.diff() != 0)
    first_of_run = new_run.nonzero().flatten()
    run_len = torch.diff(first_of_run, append=torch.tensor([keep.numel()]))
    run_part = part[first_of_run]
    offset = (keep[first_of_run] - starts[run_part]) * row_bytes
    table = table[run_part]
    table[:, 0] += offset
    table[:, 1] += offset
    table[:, 6] = run_len
    return GroupTable(table, keep.numel(), parts, keep)


class LayerParts(NamedTuple):
    """What one layer of a Scattered group attends: the group's table at layer ``slot``, then
    its recent window ``window_k`` / ``window_v`` (kv_heads, w, head_dim), w >= 0."""

    group: GroupTable
    slot: int
    window_k: torch.Tensor
    window_v: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.group.tokens + self.window_k.shape[1]

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values in one tensor each (kv_heads, tokens, head_dim): a copy,
        for the work that needs them so (a tree fold)."""
        g, slot = self.group, self.slot
        k = torch.cat([p.keys[slot] for p in g.parts], dim=1)
        v = torch.cat([p.values[slot] for p in g.parts], dim=1)
        if g.keep is not None:
            k, v = k.index_select(1, g.keep), v.index_select(1, g.keep)
        return torch.cat([k, self.window_k], dim=1), torch.cat([v, self.window_v], dim=1)

    def keys_at(self, index: torch.Tensor) -> torch.Tensor:
        """The layer's keys of the fetched tokens at ``index`` (a CPU LongTensor into the
        group's tokens, the recent window not among them): (kv_heads, len(index), head_dim), a
        copy. A tree fold's split leaves are sealed tokens, so it reads them here, on the
        cache's helper thread, while the window moves on."""
        g, slot = self.group, self.slot
        k = torch.cat([p.keys[slot] for p in g.parts], dim=1)
        return k.index_select(1, index if g.keep is None else g.keep[index])


def layer_parts(step: dict, group: int, block: Scattered, keep: torch.Tensor | None, slot: int,
                window_k: torch.Tensor, window_v: torch.Tensor) -> LayerParts:
    """What layer ``slot`` of ``group`` attends: its group's table is made once a step (kept in
    ``step``, the cache's per-step dict, under ``("table", group)``) for the group's layers."""
    held = step.get(("table", group))
    if held is None or held[0] is not block or held[1] is not keep:
        held = block, keep, group_table(block, keep)
        step[("table", group)] = held
    return LayerParts(held[2], slot, window_k, window_v)


def attend_parts(q: torch.Tensor, parts: LayerParts, scaling: float, scored: bool = False):
    """Decode attention of ``q`` (q_heads, 1, head_dim) over ``parts``, read in place.

    Returns the output (q_heads, 1, head_dim) in q's dtype, and with ``scored`` the softmax
    probabilities too, (kv_heads, group, tokens) fp32, as ``attention.scored_decode_attention``.
    Several query tokens (a pass verifying drafted ones, the window's last ``t``) attend the
    parts packed into one tensor, as ``attention.decode_attention`` says.
    """
    q_heads, t, dim = q.shape
    q_dtype = q.dtype
    k = parts.window_k
    first = parts.group.parts[0].keys
    kv_heads = first.shape[1]
    v = parts.window_v
    if (first.dtype, kv_heads, first.shape[3]) != (k.dtype, k.shape[0], k.shape[2]) or \
            k.shape[2] != dim or q_heads % kv_heads or not 1 <= t <= max(1, parts.tokens) or \
            v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"attend_parts: records {tuple(first.shape)} {first.dtype}, window keys "
                         f"{tuple(k.shape)} {k.dtype}, values {tuple(v.shape)} {v.dtype} and query "
                         f"{tuple(q.shape)} do not match")
    if not 0 <= parts.slot < first.shape[0]:
        raise ValueError(f"attend_parts: layer slot {parts.slot} of records of {first.shape[0]} "
                         "layers")
    if t > 1:
        k, v = parts.packed()
        return scored_decode_attention(q, k, v, scaling) if scored else \
            decode_attention(q, k, v, scaling)
    g = q_heads // kv_heads
    if q.dtype != torch.float32 or not q.is_contiguous():
        q = q.float().contiguous()
    w = k.shape[1]
    if w and (k.stride(-1) != 1 or k.stride(-2) != dim or v.stride(-1) != 1 or v.stride(-2) != dim):
        k, v = k.contiguous(), v.contiguous()
    size = k.element_size()
    out = torch.empty(q_heads, 1, dim)
    probs = torch.empty(kv_heads, g, parts.tokens) if scored else None
    table = parts.group.table
    kernels.decode_attend_parts(q.data_ptr(), scaling, table.data_ptr(), table.shape[0], parts.slot,
                                k.data_ptr(), v.data_ptr(), k.stride(0) * size, v.stride(0) * size,
                                w, out.data_ptr(), 0 if probs is None else probs.data_ptr(),
                                parts.tokens, kv_heads, g, dim, kernels.KINDS[k.dtype])
    result = out if out.dtype == q_dtype else out.to(q_dtype)
    return (result, probs) if scored else result
