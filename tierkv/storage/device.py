"""The device tier: blocks in GPU memory, or in CPU memory under its own budget without CUDA."""
from __future__ import annotations

import torch

from .memory import MemoryTier


class DeviceTier(MemoryTier):
    """Blocks on ``device`` within ``budget`` bytes (int or "64MB").

    Parameters
    ----------
    budget : bytes of KV this tier may hold; a put beyond it raises TierFullError.
    device : where blocks live, e.g. ``torch.device("cuda:0")`` or ``torch.device("cpu")``.
    """

    name = "device"

    def __init__(self, budget: int | str, device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device}: CUDA is not available on this machine")
        super().__init__(budget, device)
        self._ready: dict = {}  # CUDA: key -> event after the copy that stored the block

    def _store(self, key, block):
        nbytes = super()._store(key, block)
        if self.device.type == "cuda":
            # The copy is only enqueued on the current (often a side) stream; a reader on
            # another stream must wait for it (``_load``).
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._ready[key] = event
        return nbytes

    def _load(self, key):
        block = super()._load(key)
        event = self._ready.get(key)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for tensor in block:  # not reused by the allocator before this stream's reads
                tensor.record_stream(stream)
        return block

    def _drop(self, key):
        self._ready.pop(key, None)
        super()._drop(key)

    def _close(self):
        self._ready.clear()
        super()._close()
