"""The last stage: one layer group's records, concatenated on the device.

On CUDA the host-resident parts are packed into a pinned staging buffer, copied up on a side
stream in one contiguous transfer (the slots of parts already on the device are overwritten by
them after it, in stream order), and an event is recorded per group; the consumer's stream waits
on that event only, and no thread waits for the copy: the staging buffer comes from PyTorch's
pinned-memory allocator, which records the copy and reuses the buffer only once the copy has
run.

On a CPU the device is host memory, and a plan that is not ``packed`` is delivered as its
records are held (``scattered.Scattered``, no copy): ``TieredCache`` asks for that where its
policy attends parts in place (``Policy.reads_parts``; ``tierkv.scattered`` has the kernel, the
measurements, and an earlier try that was not kept). Packed, it is a plain ``torch.cat``.

A group is delivered whole, not layer by layer: its first layer waits for all of its layers'
tokens. Delivering the first layer's tokens first (its own ``torch.cat``), the rest after, was
tried (2026-11-28) where the wait is longest: a filter layer's choice, known only after its
attention, fetched for the 4-12 layers after it. At 8K on the 2-core CPU those three waits took
3.5 ms of a 90 ms step (``bench.decode``'s ``tierkv`` case, device 5 % / host 20 % of the KV).
Layer by layer, the second layer still waited 1.1 ms a step for the rest, and on one cache
decoding alternate blocks of 8 steps with and without it the step was no faster (88.1 against
87.7 ms median, ``full_memory`` 104.2). Not kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tierkv.scattered import Scattered, scattered
from tierkv.storage.base import KVBlock


@dataclass
class Delivery:
    """A group's block on the device (or its parts, ``Scattered``) and, on CUDA, the event
    that marks it ready."""

    block: KVBlock | Scattered
    event: "torch.cuda.Event | None" = None


class Transfer:
    """Concatenate a group's parts along the token axis into one block on ``device``.

    Parameters
    ----------
    device : torch.device of the result; CUDA requires ``torch.cuda.is_available()``.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device}: CUDA is not available on this machine")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device}: only 'cpu' and 'cuda' devices are supported")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def mark_ready(self) -> "torch.cuda.Event | None":
        """Record, on the consumer's stream, the point the side stream must wait for (CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def assemble(self, parts: list[KVBlock], after: "torch.cuda.Event | None",
                 then: Callable[[KVBlock], None], spare: int = 0, packed: bool = True) -> Delivery:
        """One block of every part's tokens, in order, then ``spare`` uninitialised tokens;
        keys/values (layers, heads, sum + spare, dim). On a CPU with ``packed`` False, the
        parts as they are instead (``Scattered``; no copy, no room).

        ``then(block)`` runs once the block is assembled, on the side stream on CUDA (before
        the group's event), so device work it enqueues is ordered before the consumer's use.
        """
        if not self.cuda:
            block = _packed(parts, spare, torch.device("cpu")) if packed else scattered(parts)
            then(block)
            return Delivery(block)
        return self._assemble_cuda(parts, after, then, spare)

    def deliver(self, delivery: Delivery) -> KVBlock:
        """The block, safe to use on the caller's current stream."""
        if delivery.event is None:
            return delivery.block
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(delivery.event)
        for tensor in delivery.block:
            tensor.record_stream(stream)
        return delivery.block

    def _assemble_cuda(self, parts: list[KVBlock], after, then, spare: int) -> Delivery:
        layers, heads, _, dim = parts[0].keys.shape
        dtype = parts[0].keys.dtype
        offsets = _offsets(parts)
        shape = (2, layers, heads, offsets[-1] + spare, dim)
        on_host = [p.keys.device.type == "cpu" for p in parts]
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            out = torch.empty(shape, dtype=dtype, device=self.device)
            if any(on_host):
                # Pinned, from PyTorch's caching host allocator: freed when this returns, but
                # not handed out again before the copies below have run on the side stream.
                packed = torch.empty(shape, dtype=dtype, pin_memory=True)
                for i in (i for i, host in enumerate(on_host) if host):
                    _place(packed, parts[i], offsets[i], offsets[i + 1])
                # One contiguous DMA: a copy of token-axis slices would be strided, and CUDA
                # stages strided host copies through pageable temporaries.
                out.copy_(packed, non_blocking=True)
            for i, part in enumerate(parts):
                if not on_host[i]:
                    _place(out, part, offsets[i], offsets[i + 1])
            block = KVBlock(out[0], out[1])
            then(block)
            event = torch.cuda.Event()
            event.record(self._stream)
        return Delivery(block, event)


def as_caller(stream: "torch.cuda.Stream | None", inference: bool, fn, *args):
    """``fn(*args)`` on another thread as the decoding thread runs: with its CUDA ``stream``
    current (None: no CUDA), so its kernels follow that thread's on the same tensors, in its
    ``inference`` mode (``torch.inference_mode``, which is per thread: tensors made under it may
    only be updated under it), and without autograd."""
    with torch.inference_mode(inference), torch.no_grad():
        if stream is None:
            return fn(*args)
        with torch.cuda.stream(stream):
            return fn(*args)


def _packed(parts: list[KVBlock], spare: int, device: torch.device) -> KVBlock:
    """The parts concatenated into a block with ``spare`` uninitialised tokens of room (one
    ``torch.cat`` for the keys, one for the values: no Python loop over the parts)."""
    layers, heads, _, dim = parts[0].keys.shape
    room = torch.empty((layers, heads, spare, dim), dtype=parts[0].keys.dtype, device=device)
    return KVBlock(torch.cat([p.keys for p in parts] + [room], dim=2),
                   torch.cat([p.values for p in parts] + [room], dim=2))


def _offsets(parts: list[KVBlock]) -> list[int]:
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part.keys.shape[2])
    return offsets


def _place(out: torch.Tensor, part: KVBlock, start: int, end: int) -> None:
    out[0, :, :, start:end].copy_(part.keys, non_blocking=True)
    out[1, :, :, start:end].copy_(part.values, non_blocking=True)
