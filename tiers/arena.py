"""Read buffers a tier reuses once nobody holds what it handed out.

Fresh memory costs a page fault per 4 KiB on its first touch: ~0.4 ms per
MB on these VMs, several times that next to a busy engine's threads. A tier
that reads every batch into new memory pays it on every load; an `Arena`
hands out rows of one allocation and reuses it for the next batch when no
view of it is alive any more (the views hold its storage), else starts a
new one and lets the old one go with its last user.
"""
from __future__ import annotations

import threading

import torch

# how many tensors share a storage: torch has no public call for it; without it nothing is reused
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def can_count_users() -> bool:
    return _USE_COUNT is not None


def storage_users(t: torch.Tensor) -> int:
    """Tensors (`t` included) holding `t`'s storage; needs `_USE_COUNT`."""
    storage = t.untyped_storage()
    return _USE_COUNT(storage._cdata) - 1  # minus `storage` itself


class Arena:
    """Rows of one reusable host allocation (thread-safe). Batches over
    `max_bytes` get memory of their own, so one huge read is not kept."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()

    def rows(self, n: int, size: int) -> list[torch.Tensor]:
        """n uint8 rows of `size` bytes, spaced evenly in one allocation."""
        return list(self.matrix(n, size).unbind(0))

    def matrix(self, n: int, size: int) -> torch.Tensor:
        """The same rows as one [n, size] uint8 tensor."""
        need = n * size
        with self._lock:  # the check and the views that make it busy happen together
            buf = self._buf
            if buf is None or buf.numel() < need or not can_count_users() or storage_users(buf) > 1:
                buf = torch.empty(need, dtype=torch.uint8)
                if need <= self.max_bytes and can_count_users():
                    self._buf = buf
            return buf[:need].view(n, size)

    def release(self) -> None:
        """Let the reusable allocation go (its last user frees it); the next batch starts a new one."""
        with self._lock:
            self._buf = None

    @property
    def holding(self) -> bool:
        return self._buf is not None
