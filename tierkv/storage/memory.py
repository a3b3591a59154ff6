"""Tiers that hold blocks as tensors in memory: the shared part of the device and host tiers."""
from __future__ import annotations

from typing import Iterable

import torch

from ..config import parse_size
from .base import KVBlock, RecordKey, Tier


class MemoryTier(Tier):
    """Copies of blocks kept as contiguous tensors on ``device``, within ``budget`` bytes.

    ``get`` returns the stored tensors themselves (no copy): treat them as read-only.
    """

    name = "memory"

    def __init__(self, budget: int | str, device: torch.device, pin: bool = False):
        super().__init__(parse_size(budget, f"{self.name} budget"))
        self.device = torch.device(device)
        self.pin = pin
        self._blocks: dict[RecordKey, KVBlock] = {}

    def _copy(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device,
                          pin_memory=self.pin)
        return out.copy_(tensor)

    def lookup_many(self, keys: Iterable[RecordKey]) -> list[KVBlock | None]:
        """The blocks under ``keys``, None for each one absent: ``get`` for many keys under one
        acquisition of the tier's lock (a decode step's fetch asks for dozens a layer group)."""
        with self._lock:
            self._check_open()
            return [self._load(key) if key in self._sizes else None for key in keys]

    def _store(self, key: RecordKey, block: KVBlock) -> int:
        copy = KVBlock(self._copy(block.keys), self._copy(block.values))
        self._blocks[key] = copy
        return copy.nbytes

    def _load(self, key: RecordKey) -> KVBlock:
        return self._blocks[key]

    def _drop(self, key: RecordKey) -> None:
        del self._blocks[key]

    def _close(self) -> None:
        self._blocks.clear()
