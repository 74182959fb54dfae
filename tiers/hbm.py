"""Device-memory tier: the fixed-slot pool of `tiers.cpu.SlotPool` on a torch
device (a GPU's HBM in production; any device, "cpu" in tests)."""
from __future__ import annotations

import torch

from tiers.cpu import SlotPool


def _device(device: str | torch.device | None) -> torch.device:
    """`device`, or the current GPU (else the CPU), with its index fixed now: a pool allocated
    later, or a copy made from another thread (whose current GPU is GPU 0), lands on this GPU."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


class HbmTier(SlotPool):
    """Slot pool in device memory. `get_many` returns tensors on `device`;
    `get_into` copies into buffers on any device."""

    name = "hbm"

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(capacity_bytes, slot_bytes, device=_device(device), pin=False)
