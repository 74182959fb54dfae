"""The streamed data path (Load / Store, proto/tierkv.proto): whole block
objects in protobuf messages built and read by hand.

Both directions carry objects (128-byte header + payload, as stored), so the
receiver checks them against the checksum the sender computed instead of
encoding them again, and copies per byte are few:

- Messages are built with one ``b"".join`` of the serialized small fields,
  the key of the ``data`` field and views of the objects (protobuf accepts
  fields in any order, so ``data`` goes last). The generated serializer
  would copy the payload bytes twice more (into the message, then out).
- Received messages are read in place: ``data`` is a view of the bytes gRPC
  hands over, and only the other (small) fields go to the generated parser.
- Messages hold whole objects, as many as fit in ``chunk_bytes``, so an
  object arrives in one piece and the daemon stores it from the message
  itself; only an object larger than a message is cut, and reassembled.

`ObjectReader` turns a stream of ``data`` views into objects, `LoadReader`
rebuilds a Load answer (verified payloads, a corrupt block a miss).
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Iterable, Iterator, Sequence

import torch
import xxhash
from google.protobuf.message import DecodeError

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import HEADER_SIZE, object_size, rehead, require, verify
from cache_service.blocks.objects import header as header_bytes
from cache_service.protocol.messages import as_payload
from proto import tierkv_pb2 as pb
from tiers.types import BlockHash, TierKVError

WIRE_VERSION = "tierkv-daemon/2"  # Hello's version: /2 carries whole objects in Load and Store
LOAD_DATA, STORE_DATA = 2, 3  # field numbers of `data` in LoadChunk and StoreChunk
_MAX_SIZES = 4096  # blocks announced per LoadChunk: bounds its non-data bytes
# Objects the daemon receives stay in gRPC's (immutable) message bytes; the
# tensors over them are only read (checked, copied into the store). torch
# warns about tensors over read-only memory once per process: not our case.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


class FramingError(TierKVError):
    """A streamed message or stream that breaks the framing rules."""


# ---------------------------------------------------------------- protobuf wire format
def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FramingError("malformed varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return value, pos


def _split(raw: bytes, field: int) -> tuple[bytes, memoryview]:
    """(every other field, still serialized; a view of bytes field `field`,
    the last one as protobuf has it) of a serialized message."""
    buf = memoryview(raw)
    pos, data, rest = 0, buf[:0], []
    while pos < len(buf):
        start = pos
        tag, pos = _read_varint(buf, pos)
        kind = tag & 7
        if kind == 0:
            pos = _read_varint(buf, pos)[1]
        elif kind == 2:
            n, pos = _read_varint(buf, pos)
            if tag >> 3 == field:
                data, start = buf[pos: pos + n], pos + n
            pos += n
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise FramingError(f"unexpected wire type {kind}")
        if pos > len(buf):
            raise FramingError("truncated message")
        if start < pos:
            rest.append(buf[start:pos])
    return b"".join(rest), data


def _message(head: bytes, field: int, parts: Sequence) -> bytes:
    """`head` (serialized fields) then bytes field `field` holding `parts`: one copy."""
    n = sum(len(p) for p in parts)
    return b"".join([head, _varint(field << 3 | 2), _varint(n), *parts]) if n else head


# ---------------------------------------------------------------- messages
def _cut(pieces: Sequence, size: int) -> Iterator[list[memoryview]]:
    """The concatenation of `pieces` as lists of views of `size` bytes (the last may be shorter)."""
    out, room = [], size
    for p in pieces:
        v = memoryview(p)
        while len(v):
            out.append(v[:room])
            v, room = v[room:], room - len(out[-1])
            if not room:
                yield out
                out, room = [], size
    if out:
        yield out


def _frames(objects: Iterable[list | None], obj_bytes: int, chunk_bytes: int) -> Iterator[tuple[list[bool], list]]:
    """(blocks first announced in a message, hit or not; the pieces it carries)
    per message. `objects` gives each block's pieces, None for a load miss.
    A message holds whole objects, as many as fit in chunk_bytes; an object
    larger than that is cut across messages of its own. So a message that
    announces blocks only comes once the objects announced before are whole."""
    hits: list[bool] = []
    parts: list = []
    used = 0
    for pieces in objects:
        hit = pieces is not None
        if (hit and used and used + obj_bytes > chunk_bytes) or len(hits) >= _MAX_SIZES:
            yield hits, parts
            hits, parts, used = [], [], 0
        hits.append(hit)
        if hit and obj_bytes <= chunk_bytes:
            parts += pieces
            used += obj_bytes
        elif hit:
            for k, cut in enumerate(_cut(pieces, chunk_bytes)):
                yield (hits if k == 0 else []), cut
            hits = []
    if hits or parts:
        yield hits, parts


def load_messages(objects: Iterable[list | None], payload_bytes: int, chunk_bytes: int) -> Iterator[bytes]:
    """Serialized LoadChunk messages for blocks in request order; `objects`
    gives each block's object pieces (`object_pieces`), None for a miss."""
    for hits, parts in _frames(objects, HEADER_SIZE + payload_bytes, chunk_bytes):
        sizes = [payload_bytes if hit else 0 for hit in hits]
        yield _message(pb.LoadChunk(sizes=sizes).SerializeToString() if sizes else b"", LOAD_DATA, parts)


def store_messages(head: bytes, objects: Iterable[list], obj_bytes: int, chunk_bytes: int) -> Iterator[bytes]:
    """Serialized StoreChunk messages: `head` (the serialized ns and hashes)
    leads the first, the objects' pieces (`encode_pieces`) follow."""
    first = True
    for _, parts in _frames(objects, obj_bytes, chunk_bytes):
        yield _message(head if first else b"", STORE_DATA, parts)
        first = False
    if first:  # no blocks: the head alone
        yield head


def parse_load_chunk(raw: bytes) -> tuple[list[int], memoryview]:
    """(sizes, data) of a serialized LoadChunk, `data` a view of `raw`."""
    rest, data = _split(raw, LOAD_DATA)
    return list(pb.LoadChunk.FromString(rest).sizes), data


class StoreMessage:
    """A received StoreChunk: `head` (every field but data), `data` (a view of
    the message) or, for bytes that do not parse, `error`. The daemon's
    deserializer never raises: gRPC would answer INTERNAL, not INVALID_ARGUMENT."""

    __slots__ = ("head", "data", "error")

    def __init__(self, raw: bytes) -> None:
        self.head, self.data, self.error = pb.StoreChunk(), memoryview(b""), ""
        try:
            rest, self.data = _split(raw, STORE_DATA)
            self.head.ParseFromString(rest)
        except (FramingError, DecodeError) as e:
            self.error = str(e) or type(e).__name__


# ---------------------------------------------------------------- objects
# Per-block work below stays on memoryviews and xxhash: a few torch calls per
# block cost more than checking or copying a small block.
def encode_pieces(ns: Namespace, h: BlockHash, payload: torch.Tensor) -> list:
    """Block h's object as wire pieces: its header (carrying the payload's
    checksum) and a view of the payload's bytes (no copy)."""
    view = memoryview(payload.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return [header_bytes(ns, h, xxhash.xxh3_64_intdigest(view)), view]


def object_pieces(obj: memoryview, ns: Namespace, key: BlockHash, sent_ns: Namespace, h: BlockHash) -> list | None:
    """Wire pieces of a loaded object (headed for the store's (ns, key)) as the
    client asked for it, (sent_ns, h): the object itself when those agree,
    else a new header and its payload. None if its header is not canonical."""
    if (sent_ns, h) == (ns, key):
        return [obj]
    csum = verify([obj], ns, [key])[0]
    return None if csum is None else [header_bytes(sent_ns, h, csum), obj[HEADER_SIZE:]]


def admit(obj: memoryview, sent_ns: Namespace, h: BlockHash, ns: Namespace, key: BlockHash) -> torch.Tensor:
    """A received object, sent for (sent_ns, h), checked in full and headed
    for the store's (ns, key): a tensor over it when those agree (read-only
    when `obj` is), else a copy with the store's header. Raises
    CorruptBlockError saying what is wrong."""
    csum = require([obj], sent_ns, [h])[0]
    if (sent_ns, h) == (ns, key):
        return torch.frombuffer(obj, dtype=torch.uint8)
    out = torch.empty(len(obj), dtype=torch.uint8)
    view = memoryview(out.numpy())
    view[HEADER_SIZE:] = obj[HEADER_SIZE:]
    rehead([view], ns, [key], [csum])
    return out


class ObjectReader:
    """Cuts a stream of data views into objects of `size` bytes, at most as
    many as `expect`-ed. An object that lies whole in one view comes back as
    a view of it (no copy); one cut across views is reassembled in a buffer
    of its own."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.expected = 0  # objects announced and not yet whole
        self.received = 0  # bytes fed
        self._partial: memoryview | None = None
        self._filled = 0

    @property
    def idle(self) -> bool:
        """No announced object is outstanding."""
        return self.expected == 0

    def expect(self, n: int) -> None:
        self.expected += n

    def feed(self, data: memoryview) -> list[memoryview]:
        """The objects `data` completes; FramingError if it overruns them."""
        if self._filled + len(data) > self.expected * self.size:
            raise FramingError(f"{self._filled + len(data)} bytes where {self.expected} objects "
                               f"of {self.size} bytes were announced")
        self.received += len(data)
        out, pos, size = [], 0, self.size
        if self._partial is not None:  # finish the object cut at the end of the last view
            pos = min(len(data), size - self._filled)
            self._partial[self._filled: self._filled + pos] = data[:pos]
            self._filled += pos
            if self._filled == size:
                out.append(self._partial)
                self._partial, self._filled = None, 0
        while len(data) - pos >= size:
            out.append(data[pos: pos + size])
            pos += size
        if pos < len(data):
            self._partial = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
            self._filled = len(data) - pos
            self._partial[:self._filled] = data[pos:]
        self.expected -= len(out)
        return out


class LoadReader:
    """Rebuilds a Load answer from its messages (`feed` each, then `result`):
    payloads in request order, checked against their header and checksum,
    None for a miss and for a block that fails its checks (counted in
    `corrupt`). Raises FramingError for a stream that breaks the rules.

    Each payload is checked in the message, then copied once into a buffer
    of its own: the caller gets writable tensors, and block-sized buffers
    are what the allocator recycles best (one per message measured worse)."""

    def __init__(self, ns: Namespace, hashes: Sequence[BlockHash]) -> None:
        self.ns, self.hashes = ns, hashes
        self.out: list[torch.Tensor | None] = []
        self.corrupt = 0
        self._hits: deque[int] = deque()  # positions of announced hits, in arrival order
        self._objects = ObjectReader(object_size(ns))

    def feed(self, sizes: Sequence[int], data: memoryview) -> None:
        if sizes:
            self._announce(sizes)
        for obj in self._objects.feed(data):
            i = self._hits.popleft()
            if verify([obj], self.ns, [self.hashes[i]])[0] is None:
                self.corrupt += 1
                continue
            payload = torch.empty(self.ns.payload_bytes, dtype=torch.uint8)
            memoryview(payload.numpy())[:] = obj[HEADER_SIZE:]
            self.out[i] = as_payload(payload, self.ns)

    def _announce(self, sizes: Sequence[int]) -> None:
        P = self.ns.payload_bytes
        if not self._objects.idle:
            raise FramingError("blocks announced before the objects announced earlier were whole")
        if len(self.out) + len(sizes) > len(self.hashes) or any(s not in (0, P) for s in sizes):
            raise FramingError(f"sizes {list(sizes)[:8]}... announced after {len(self.out)} of "
                               f"{len(self.hashes)} blocks of {P} bytes")
        for s in sizes:
            if s:
                self._hits.append(len(self.out))
            self.out.append(None)
        self._objects.expect(sum(1 for s in sizes if s))

    def result(self) -> list[torch.Tensor | None]:
        if len(self.out) != len(self.hashes) or not self._objects.idle:
            raise FramingError(f"stream ended with {len(self.out)} of {len(self.hashes)} blocks announced and "
                               f"{self._objects.expected} objects missing")
        return self.out
