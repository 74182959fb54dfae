"""Device-memory tier: the fixed-slot pool of `tiers.cpu.SlotPool` on a torch
device (a GPU's HBM in production; any device, "cpu" in tests)."""
from __future__ import annotations

import torch

from tiers.cpu import SlotPool


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class HbmTier(SlotPool):
    """Slot pool in device memory. `get_many` returns tensors on `device`;
    `get_into` copies into buffers on any device."""

    name = "hbm"

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(capacity_bytes, slot_bytes, device=device or _default_device(), pin=False)
