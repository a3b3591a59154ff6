"""The host tier: blocks in (pinned, when CUDA is present) CPU memory."""
from __future__ import annotations

import torch

from .memory import MemoryTier


class HostTier(MemoryTier):
    """Copies of blocks in CPU memory within ``budget`` bytes (int or "256MB").

    Parameters
    ----------
    budget : bytes of KV this tier may hold; a put beyond it raises TierFullError.
    pin : page-lock the memory for fast, asynchronous copies to the GPU. ``None`` pins exactly
        when CUDA is available; ``True`` without CUDA is an error.
    """

    name = "host"

    def __init__(self, budget: int | str, pin: bool | None = None):
        if pin is None:
            pin = torch.cuda.is_available()
        if not isinstance(pin, bool):
            raise ValueError(f"pin={pin!r}: expected True, False or None")
        if pin and not torch.cuda.is_available():
            raise ValueError("pin=True: pinned memory needs CUDA, which is not available")
        super().__init__(budget, torch.device("cpu"), pin)
