"""The daemon's side of the same-host shared-memory segments (their layout
and the client side: cache_service/protocol/segment.py): `Attachments` maps
the segments clients ask it to attach, checks their nonce and ownership, and
forgets idle ones."""
from __future__ import annotations

import mmap
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from cache_service.protocol.messages import RequestError
from cache_service.protocol.segment import ALIGN, DATA_OFFSET, MAGIC, NONCE_BYTES, SHM_DIR, SEGMENT_NAME, map_fd


@dataclass(slots=True)
class Mapping:
    """A client segment as the daemon mapped it."""

    tenant: str | None
    data: torch.Tensor  # uint8 view of the usable bytes
    fd: int = -1  # the segment's file, to see that it still backs the mapping
    used_s: float = field(default_factory=time.monotonic)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the data area; INVALID_ARGUMENT if
        outside or misaligned (payloads are viewed in their dtype in place),
        FAILED_PRECONDITION if the client cut its file short of them (pages
        past a file's end would kill the daemon with SIGBUS)."""
        if offset % ALIGN:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"offset {offset} is not a multiple of {ALIGN}")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.data.numel():
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"bytes [{offset}, {offset + nbytes}) do not fit the "
                               f"{self.data.numel()}-byte shared-memory segment")
        if self.fd >= 0 and os.fstat(self.fd).st_size < DATA_OFFSET + offset + nbytes:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the shared-memory segment was cut short under its mapping; attach a new one")
        return self.data[offset: offset + nbytes]

    def __del__(self) -> None:  # once no request uses it: a descriptor closed under a request could be reused
        if self.fd >= 0:
            os.close(self.fd)


class Attachments:
    """The daemon's mapped client segments, by attachment id: at most
    `max_count` in all, and a quarter of that per named tenant (so one
    tenant cannot take every attachment from the others)."""

    def __init__(self, directory: Path = SHM_DIR, max_count: int = 64, max_bytes: int = 4 << 30,
                 idle_s: float = 600.0) -> None:
        self.dir = Path(directory)
        self.max_count, self.max_bytes, self.idle_s = max_count, max_bytes, idle_s
        self._maps: dict[str, Mapping] = {}
        self._pending: dict[str | None, int] = {}  # attaches under way, per tenant (counted against the limits)
        self._lock = threading.Lock()

    def attach(self, name: str, nonce: bytes, tenant: str | None) -> tuple[str, int]:
        """Map segment `name` after checking its nonce; returns (id, data bytes)."""
        if not SEGMENT_NAME.fullmatch(name or ""):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"segment name {name!r} is not tierkv-<id>")
        self.reap()
        self._admit(tenant)
        try:
            mm, fd = self._open(name)
            if mm[: len(MAGIC)] != MAGIC or not secrets.compare_digest(mm[len(MAGIC): len(MAGIC) + NONCE_BYTES],
                                                                       nonce):
                mm.close()
                os.close(fd)
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"segment {name}: nonce does not match")
            data = torch.frombuffer(mm, dtype=torch.uint8)[DATA_OFFSET:]
            del mm  # the tensor keeps the mapping alive; the last user unmaps it
            aid = secrets.token_hex(12)
            with self._lock:
                self._maps[aid] = Mapping(tenant, data, fd)
            return aid, data.numel()
        finally:
            with self._lock:
                self._pending[tenant] -= 1

    def _admit(self, tenant: str | None) -> None:
        """Count an attach of `tenant` under way, if the limits leave room for it."""
        with self._lock:
            total = len(self._maps) + sum(self._pending.values())
            mine = self._pending.get(tenant, 0) + sum(m.tenant == tenant for m in self._maps.values())
            if total >= self.max_count:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{self.max_count} segments attached already; detach one first")
            if tenant is not None and mine >= max(1, self.max_count // 4):
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"tenant {tenant!r} has {mine} segments attached; detach one first")
            self._pending[tenant] = self._pending.get(tenant, 0) + 1

    def _open(self, name: str) -> tuple[mmap.mmap, int]:
        """The segment mapped, and its file kept open (`Mapping.region` checks its size)."""
        try:
            fd = os.open(self.dir / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"cannot open segment {name} ({e.strerror}); not on the daemon's host?") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not DATA_OFFSET < st.st_size <= DATA_OFFSET + self.max_bytes:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"segment {name}: not a regular file of at most {self.max_bytes} data bytes")
            return map_fd(fd, st.st_size), fd
        except BaseException:
            os.close(fd)
            raise

    def get(self, aid: str, tenant: str | None) -> Mapping:
        """The mapping of attachment `aid`; the caller must be its tenant."""
        with self._lock:
            m = self._maps.get(aid)
            if m is not None:
                m.used_s = time.monotonic()
        if m is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown attachment {aid!r:.40} (daemon restarted?)")
        if m.tenant != tenant:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, "attachment belongs to another tenant")
        return m

    def detach(self, aid: str, tenant: str | None) -> None:
        self.get(aid, tenant)
        with self._lock:
            self._maps.pop(aid, None)

    def reap(self) -> int:
        """Forget segments idle longer than idle_s (their client likely died)."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            dead = [aid for aid, m in self._maps.items() if m.used_s < cutoff]
            for aid in dead:
                del self._maps[aid]
        return len(dead)

    def counts(self) -> tuple[int, int]:
        """(attached segments, their data bytes)."""
        with self._lock:
            return len(self._maps), sum(m.data.numel() for m in self._maps.values())

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
