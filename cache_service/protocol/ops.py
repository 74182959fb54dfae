"""The op table of tierkv's framed sockets (protocol/frames.py): the daemon's
same-host socket (server/socket_server.py), its TCP data path
(server/data_path.py) and the vLLM scheduler's lookups
(connectors/vllm/lookup.py). The numeric codes are the wire's: never renumber.

Per op: the request and reply body types (protobuf classes, or `LookupBody`
for the struct-coded lookups) and, for the calls the daemon's servicer also
serves over gRPC, the servicer method name."""
from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

from proto import tierkv_pb2 as pb
from tiers.types import HASH_BYTES, BlockHash


class LookupBody:
    """The LOOKUP bodies, struct-coded (no protobuf needed by the scheduler):
    request = n 16-byte hashes back to back, reply = <u32 held blocks>."""

    REPLY = struct.Struct("<I")

    @staticmethod
    def request(hashes) -> bytes:
        return b"".join(hashes)

    @staticmethod
    def hashes(body: bytes) -> list[BlockHash]:
        if len(body) % HASH_BYTES:
            raise ValueError(f"lookup body of {len(body)} bytes is not a whole number of hashes")
        return [BlockHash(body[i:i + HASH_BYTES]) for i in range(0, len(body), HASH_BYTES)]

    @classmethod
    def reply(cls, held: int) -> bytes:
        return cls.REPLY.pack(held)

    @classmethod
    def held(cls, body: bytes) -> int:
        return cls.REPLY.unpack(body)[0]


class Op(IntEnum):
    """Every op of the framed sockets (the u8 after a request frame's length)."""

    HELLO = 0  # bearer token (utf-8, empty with auth off) -> empty; always the first frame
    LOAD_SHM = 1
    STORE_SHM = 2
    LOAD = 3  # the TCP data path: raw objects follow the reply
    STORE = 4  # the TCP data path: raw objects follow the request
    MAP_POOL = 5  # the pool's memfd travels with the reply (SCM_RIGHTS)
    RESERVE = 6
    COMMIT = 7
    LOOKUP = 8  # the vLLM scheduler asks the worker that owns an embedded store
    HOLD = 9  # pool slots of held blocks, kept from reuse until LET_GO: read in place
    LET_GO = 10
    PIN_SESSION = 11  # the vLLM scheduler's session hints, acted on by the worker that owns an embedded store
    PREFETCH = 12


class Spec(NamedTuple):
    method: str  # the servicer's method (and metrics) name
    request: type
    reply: type


SPECS: dict[Op, Spec] = {
    Op.HELLO: Spec("Hello", bytes, bytes),
    Op.LOAD_SHM: Spec("LoadShm", pb.ShmRequest, pb.LoadShmReply),
    Op.STORE_SHM: Spec("StoreShm", pb.ShmRequest, pb.StoreReply),
    Op.LOAD: Spec("Load", pb.LoadRequest, pb.LoadShmReply),
    Op.STORE: Spec("Store", pb.StoreChunk, pb.StoreReply),
    Op.MAP_POOL: Spec("MapPool", pb.PoolRequest, pb.PoolReply),
    Op.RESERVE: Spec("Reserve", pb.BlocksRequest, pb.ReserveReply),
    Op.COMMIT: Spec("Commit", pb.CommitRequest, pb.CommitReply),
    Op.LOOKUP: Spec("Lookup", LookupBody, LookupBody),
    Op.HOLD: Spec("Hold", pb.BlocksRequest, pb.HoldReply),
    Op.LET_GO: Spec("LetGo", pb.LetGoRequest, pb.LetGoReply),
    Op.PIN_SESSION: Spec("PinSession", pb.PinSessionRequest, pb.PinSessionReply),
    Op.PREFETCH: Spec("Prefetch", pb.PrefetchRequest, pb.PrefetchReply),
}
BY_METHOD: dict[str, Op] = {spec.method: op for op, spec in SPECS.items()}
