"""Same-host fast path: payloads move through shared memory, not the socket.

The *client* owns the memory. It creates a segment file in /dev/shm (mode
0600, random name), writes a magic and 16 random bytes (the nonce) at its
start and asks the daemon to `Attach` it by name and nonce. The daemon maps
the file, checks the nonce and remembers the mapping under an attachment id
bound to the caller's tenant; the client then unlinks the file, so nothing
leaks if either side dies. Both calls address block i at ``offset + i *
object_size(ns)`` as a whole block object (header + payload, see
cache_service/blocks/objects.py): LoadShm has the daemon copy each hit's object
there from its pool slot (one copy, verified in place); for StoreShm the
client encodes objects there and the daemon checks each in full (the client
is not trusted) before copying it once into its pool. A client hands out
loaded payloads as views of the segment and reuses that stretch only once
the caller has dropped them (`Segment.stretch`).

Why not a slab the daemon offers to every client: that slab would have to be
mappable by all tenants, so one tenant could read another's blocks in
flight. A client segment is readable only by its creator and the daemon, and
an attachment is usable only by the tenant that made it.

The calls themselves (LoadShm, StoreShm) carry only hashes and offsets; a
client rings them on the daemon's doorbell socket when Attach names one
(cache_service/server/socket_server.py), else through gRPC.

Whether the path works is proven, not guessed: the daemon advertises a host
id (the kernel boot id) and a client on the same host tries to attach; a
daemon that cannot open or verify the segment (another host, another
/dev/shm namespace) refuses, and the client streams bytes instead.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import xxhash

from cache_service.protocol.messages import RequestError
from tiers.arena import can_count_users, storage_users

SHM_DIR = Path("/dev/shm")
MAGIC = b"TKVSHM1\0"
NONCE_BYTES = 16
DATA_OFFSET = 4096  # payloads start page-aligned after the header
ALIGN = 64  # offsets into the data area
_NAME = re.compile(r"^tierkv-[A-Za-z0-9_.-]{1,100}$")


def host_id() -> str:
    """Stable for one boot of one kernel: equal ids => worth trying to attach."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_bytes()
    except OSError:
        raw = socket.gethostname().encode()
    return xxhash.xxh3_64_hexdigest(raw.strip())


def _map(fd: int, size: int) -> mmap.mmap:
    # populate: fault the pages in once here, not on every first touch of a copy
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class Segment:
    """A shared-memory file created by this process (the client side)."""

    def __init__(self, data_bytes: int, directory: Path = SHM_DIR) -> None:
        assert data_bytes > 0
        self.name = f"tierkv-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = Path(directory) / self.name
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.data_bytes = data_bytes
        size = DATA_OFFSET + data_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = _map(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._mm[: len(MAGIC) + NONCE_BYTES] = MAGIC + self.nonce
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)[DATA_OFFSET:]
        self._loans: list[tuple[int, int, torch.Tensor]] = []  # (offset, bytes, our handle) of lent stretches

    def stretch(self, nbytes: int, lend: bool = False) -> tuple[int, torch.Tensor] | None:
        """(offset, uint8 tensor) of `nbytes` of the data area that no lent
        tensor still uses, or None if there is no such room now.

        With `lend` the stretch is the caller's to hand out: it stays
        reserved while any view of the returned tensor is alive (tracked by
        the use count of its storage), so a later call never overwrites
        bytes a caller still reads. Not thread-safe (the client locks).
        """
        self._loans = [loan for loan in self._loans if storage_users(loan[2]) > 1]
        for off in [0] + [-(-(o + n) // ALIGN) * ALIGN for o, n, _ in self._loans]:
            if off + nbytes <= self.data_bytes and all(off + nbytes <= o or o + n <= off for o, n, _ in self._loans):
                if not lend or not can_count_users():
                    return (off, self.data[off: off + nbytes]) if not lend else None
                t = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=DATA_OFFSET + off)
                self._loans.append((off, nbytes, t))
                return off, t
        return None

    def unlink(self) -> None:
        """Remove the name; the memory lives on while some process maps it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.data = None  # the tensor exports the buffer; drop it before closing
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view; the GC unmaps it later
            pass


@dataclass(slots=True)
class Mapping:
    """A client segment as the daemon mapped it."""

    tenant: str | None
    data: torch.Tensor  # uint8 view of the usable bytes
    used_s: float = field(default_factory=time.monotonic)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the data area; INVALID_ARGUMENT if
        outside or misaligned (payloads are viewed in their dtype in place)."""
        if offset % ALIGN:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"offset {offset} is not a multiple of {ALIGN}")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.data.numel():
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"bytes [{offset}, {offset + nbytes}) do not fit the "
                               f"{self.data.numel()}-byte shared-memory segment")
        return self.data[offset: offset + nbytes]


class Attachments:
    """The daemon's mapped client segments, by attachment id."""

    def __init__(self, directory: Path = SHM_DIR, max_count: int = 64, max_bytes: int = 4 << 30,
                 idle_s: float = 600.0) -> None:
        self.dir = Path(directory)
        self.max_count, self.max_bytes, self.idle_s = max_count, max_bytes, idle_s
        self._maps: dict[str, Mapping] = {}
        self._lock = threading.Lock()

    def attach(self, name: str, nonce: bytes, tenant: str | None) -> tuple[str, int]:
        """Map segment `name` after checking its nonce; returns (id, data bytes)."""
        if not _NAME.match(name or ""):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"segment name {name!r} is not tierkv-<id>")
        self.reap()
        with self._lock:
            if len(self._maps) >= self.max_count:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{self.max_count} segments attached already; detach one first")
        mm = self._open(name)
        if mm[: len(MAGIC)] != MAGIC or not secrets.compare_digest(mm[len(MAGIC): len(MAGIC) + NONCE_BYTES], nonce):
            mm.close()
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"segment {name}: nonce does not match")
        data = torch.frombuffer(mm, dtype=torch.uint8)[DATA_OFFSET:]
        del mm  # the tensor keeps the mapping alive; the last user unmaps it
        aid = secrets.token_hex(12)
        with self._lock:
            self._maps[aid] = Mapping(tenant, data)
        return aid, data.numel()

    def _open(self, name: str) -> mmap.mmap:
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
            return _map(fd, st.st_size)
        finally:
            os.close(fd)

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
