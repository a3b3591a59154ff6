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
