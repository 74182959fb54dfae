"""A same-host client's side of the daemon's pool (its server side:
cache_service/server/pool.py): the pool mapped from the memfd the daemon
passes over the socket, and the replies of a pipelined pool store."""
from __future__ import annotations

import mmap
import os
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from cache_service.blocks.keys import Namespace
from cache_service.protocol.messages import ns_to_pb
from cache_service.protocol.ops import Op
from cache_service.protocol.socket_client import SocketClient
from proto import tierkv_pb2 as pb
from tiers.types import BlockHash, TierKVError

NO_ROOM = -2  # a Reserve answer: store this block another way
ns_pb = lru_cache(maxsize=64)(ns_to_pb)  # a namespace's message, built once (requests copy it)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python names it from 3.13 on


class ProtocolError(TierKVError):
    """The daemon answered something this client does not understand."""


@dataclass(slots=True)
class PoolMap:
    """This process's mapping of the daemon's pool."""

    rows: torch.Tensor  # [num_slots, slot_bytes]
    slot_bytes: int
    mm: mmap.mmap
    stride: int
    fresh: list[bool]  # per slot: not yet written through this mapping

    def prepare(self, slots: Sequence[int]) -> None:
        """Map the pages of slots this process has not written yet in one call
        per slot (MADV_POPULATE_WRITE), not one page fault per 4 KiB page in
        the middle of the copy (a fault costs microseconds in a VM)."""
        for s in slots:
            if self.fresh[s]:
                self.fresh[s] = False
                try:
                    self.mm.madvise(_POPULATE_WRITE, s * self.stride, self.slot_bytes)
                except OSError:  # before Linux 5.14: the copy faults the pages in
                    pass


class PoolReplies:
    """The calls of one pipelined pool store, posted on the same-host socket and
    answered in order: Reserve replies are kept per chunk, Commit replies
    summed."""

    def __init__(self, sock: SocketClient, num_slots: int) -> None:
        self.socket, self.num_slots = sock, num_slots
        self.pending: deque[tuple[str, int]] = deque()  # (call, its Reserve chunk or its Commit's block count)
        self.reserved: list[list[int]] = []
        self.stored = 0
        self.spare: list[int] = []  # spare slots a Commit was granted
        self.asked = False  # a Commit of this store asked for spares already

    def reserve(self, ns: Namespace, hashes: list[BlockHash]) -> None:
        self.socket.post(Op.RESERVE, pb.BlocksRequest(ns=ns_pb(ns), hashes=hashes))
        self.pending.append(("Reserve", len(hashes)))

    def commit(self, ns: Namespace, hashes: list[BlockHash], slots: list[int], spare: int = 0) -> None:
        self.socket.post(Op.COMMIT, pb.CommitRequest(ns=ns_pb(ns), hashes=hashes, slots=slots, spare=max(0, spare)))
        self.pending.append(("Commit", len(hashes)))
        self.asked = True

    def slots(self, k: int) -> list[int]:
        """The slots chunk k got (waiting for the replies before it)."""
        while len(self.reserved) <= k:
            self._next()
        return self.reserved[k]

    def finish(self) -> int:
        while self.pending:
            self._next()
        return self.stored

    def _next(self) -> None:
        name, n = self.pending.popleft()
        if name == "Commit":
            reply = self.socket.answer(Op.COMMIT)
            self.stored += reply.stored
            self.spare += checked_slots(name, list(reply.spare), len(reply.spare), 0, self.num_slots)
            return
        slots = list(self.socket.answer(Op.RESERVE).slots)
        self.reserved.append(checked_slots(name, slots, n, NO_ROOM, self.num_slots))



def checked_slots(name: str, slots: list[int], n: int, lowest: int, num_slots: int) -> list[int]:
    if len(slots) != n or any(not lowest <= s < num_slots for s in slots):
        raise ProtocolError(f"daemon answered {name} of {n} blocks with slots {slots[:8]}...")
    return slots


def map_pool(fd: int, reply: pb.PoolReply) -> PoolMap:
    """Map the daemon's pool (fd: its memfd, closed here) as [num_slots, slot_bytes] rows."""
    try:
        size = reply.num_slots * reply.slot_stride
        if not reply.num_slots or reply.slot_bytes > reply.slot_stride or reply.slot_stride % mmap.PAGESIZE \
                or os.fstat(fd).st_size < size:  # a short file would be SIGBUS, not an error
            raise ProtocolError(f"daemon announced a pool of {reply.num_slots} slots of {reply.slot_bytes} "
                                f"bytes, {reply.slot_stride} apart, in a {os.fstat(fd).st_size}-byte file")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except OSError as e:
        raise ProtocolError(f"cannot map the daemon's pool: {e}") from None
    finally:
        os.close(fd)
    rows = torch.frombuffer(mm, dtype=torch.uint8).view(reply.num_slots, reply.slot_stride)
    return PoolMap(rows[:, :reply.slot_bytes], reply.slot_bytes, mm, reply.slot_stride, [True] * reply.num_slots)
