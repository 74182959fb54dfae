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
client sends them over the daemon's same-host socket when Attach names one
(AttachReply.socket_path; cache_service/server/socket_server.py), else through gRPC.

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
from pathlib import Path

import torch
import xxhash

from tiers.arena import can_count_users, storage_users

SHM_DIR = Path("/dev/shm")
MAGIC = b"TKVSHM1\0"
NONCE_BYTES = 16
DATA_OFFSET = 4096  # payloads start page-aligned after the header
ALIGN = 64  # offsets into the data area
SEGMENT_NAME = re.compile(r"^tierkv-[A-Za-z0-9_.-]{1,100}$")


def host_id() -> str:
    """Stable for one boot of one kernel: equal ids => worth trying to attach."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_bytes()
    except OSError:
        raw = socket.gethostname().encode()
    return xxhash.xxh3_64_hexdigest(raw.strip())


def map_fd(fd: int, size: int) -> mmap.mmap:
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
            self._mm = map_fd(fd, size)
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
