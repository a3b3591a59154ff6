"""The last stage: one layer group's records, concatenated on the device.

On CUDA the host-resident parts are packed into a pinned staging buffer, copied up on a side
stream in one transfer, and an event is recorded per group; the consumer's stream waits on that
event only. Without CUDA it is a plain ``torch.cat``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from tierkv.storage.base import KVBlock


@dataclass
class Delivery:
    """A group's block on the device and, on CUDA, the event that marks it ready."""

    block: KVBlock
    event: "torch.cuda.Event | None" = None


class StagingPool:
    """Reusable pinned host buffers (bytes), at most ``keep`` of them kept between uses."""

    def __init__(self, keep: int):
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self._keep:]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class Transfer:
    """Concatenate a group's parts along the token axis into one block on ``device``.

    Parameters
    ----------
    device : torch.device of the result; CUDA requires ``torch.cuda.is_available()``.
    buffers : pinned staging buffers kept for reuse (CUDA only).
    """

    def __init__(self, device: torch.device, buffers: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise ValueError(f"device={self.device}: CUDA is not available on this machine")
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device}: only 'cpu' and 'cuda' devices are supported")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pool = StagingPool(buffers) if self.cuda else None

    def mark_ready(self) -> "torch.cuda.Event | None":
        """Record, on the consumer's stream, the point the side stream must wait for (CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def assemble(self, parts: list[KVBlock], after: "torch.cuda.Event | None",
                 then: Callable[[KVBlock], None], spare: int = 0) -> Delivery:
        """One block of every part's tokens, in order, then ``spare`` uninitialised tokens;
        keys/values (layers, heads, sum + spare, dim).

        ``then(block)`` runs once the block is assembled, on the side stream on CUDA (before
        the group's event), so device work it enqueues is ordered before the consumer's use.
        """
        if not self.cuda:
            block = _packed(parts, spare, torch.device("cpu"))
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.clear()

    def _assemble_cuda(self, parts: list[KVBlock], after, then, spare: int) -> Delivery:
        layers, heads, _, dim = parts[0].keys.shape
        dtype = parts[0].keys.dtype
        offsets = _offsets(parts)
        shape = (2, layers, heads, offsets[-1] + spare, dim)
        on_host = {i for i, p in enumerate(parts) if p.keys.device.type == "cpu"}
        staging = None
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            out = torch.empty(shape, dtype=dtype, device=self.device)
            if on_host:
                nbytes = out.numel() * out.element_size()
                staging = self._pool.take(nbytes)
                packed = staging[:nbytes].view(dtype).view(shape)
                for i in on_host:
                    _place(packed, parts[i], offsets[i], offsets[i + 1])
                out.copy_(packed, non_blocking=True)
            for i, part in enumerate(parts):
                if i not in on_host:
                    _place(out, part, offsets[i], offsets[i + 1])
            block = KVBlock(out[0], out[1])
            then(block)
            event = torch.cuda.Event()
            event.record(self._stream)
        if staging is not None:
            event.synchronize()  # the pinned buffer is reusable once the copy has landed
            self._pool.give(staging)
        return Delivery(block, event)


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
