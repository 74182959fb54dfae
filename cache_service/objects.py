"""Block objects: a fixed little-endian header followed by the payload.

Layout (offsets in bytes, all little-endian; HEADER_SIZE = 128 so the payload
is 64-byte aligned):

    0   4s  magic b"TKVB"
    4   H   format version (1)
    6   H   header size (128)
    8   16s namespace fingerprint
    24  16s block hash
    40  I   num_layers      44 I kv_heads     48 I head_dim    52 I block_tokens
    56  B   dtype code      57 B codec code   58 H reserved (0)
    60  I   reserved (0)
    64  Q   payload length
    72  Q   xxh3_64 of the payload
    80  Q   xxh3_64 of bytes [0, 80)
    88  ... zero padding up to 128

Decoding checks every field against what the caller asked for; any mismatch
raises CorruptBlockError, which the store turns into a quarantined miss.
"""
from __future__ import annotations

import struct
from functools import lru_cache

import torch
import xxhash

from cache_service.keys import KV_DTYPES, Namespace
from tiers.types import BlockHash, CorruptBlockError

MAGIC = b"TKVB"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_FIXED = struct.Struct("<4sHH16s16sIIIIBBHIQQ")
_TAIL = struct.Struct("<Q")
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(KV_DTYPES)}
_CODEC_CODES = {"raw": 0}
assert _FIXED.size == 80


def object_size(ns: Namespace) -> int:
    """Bytes of one encoded block object under namespace `ns`."""
    return HEADER_SIZE + ns.payload_bytes


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor."""
    assert t.device.type == "cpu" and t.is_contiguous(), "payload must be contiguous on CPU"
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def checksum(payload: torch.Tensor) -> int:
    """xxh3_64 of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(_as_bytes(payload))


def header(ns: Namespace, h: BlockHash, csum: int) -> bytes:
    """The HEADER_SIZE header bytes of block `h` under `ns` whose payload has checksum `csum`."""
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, HEADER_SIZE, ns.fingerprint(), h,
        ns.num_layers, ns.kv_heads, ns.head_dim, ns.block_tokens,
        _DTYPE_CODES[ns.kv_dtype], _CODEC_CODES[ns.codec], 0, 0, ns.payload_bytes, csum,
    )
    tail = _TAIL.pack(xxhash.xxh3_64_intdigest(fixed))
    return (fixed + tail).ljust(HEADER_SIZE, b"\0")


def encode_into(out: torch.Tensor, ns: Namespace, h: BlockHash, payload: torch.Tensor) -> torch.Tensor:
    """Write header + payload into `out` (1-D uint8, >= object_size bytes).

    `payload` must hold ns.payload_bytes bytes in the canonical layout
    [layers, 2, block_tokens, kv_heads, head_dim]. Returns the used prefix of `out`.
    """
    size = object_size(ns)
    assert out.dtype == torch.uint8 and out.dim() == 1 and out.numel() >= size
    flat = payload.contiguous().view(-1).view(torch.uint8)
    if flat.numel() != ns.payload_bytes:
        raise ValueError(f"payload has {flat.numel()} bytes, namespace expects {ns.payload_bytes}")
    obj = out[:size]
    obj[HEADER_SIZE:].copy_(flat)
    hdr = header(ns, h, checksum(obj[HEADER_SIZE:]))
    obj[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(hdr), dtype=torch.uint8))
    return obj


@lru_cache(maxsize=256)
def _fixed_parts(ns: Namespace) -> tuple[bytes, bytes]:
    """Header bytes [0, 24) and [40, 72): the same in every object under `ns`."""
    raw = header(ns, BlockHash(bytes(16)), 0)
    return raw[:24], raw[40:72]


_PADDING = bytes(HEADER_SIZE - _FIXED.size - _TAIL.size)


def claimed_checksum(obj: torch.Tensor, ns: Namespace, h: BlockHash, raw: bytes | None = None) -> int | None:
    """The payload checksum in `obj`'s header if that header (and the size) is
    exactly what an object of block `h` under `ns` has, else None: `decode`'s
    header checks as a few bytes comparisons, for the hot paths. Callers run
    `decode` for the diagnosis when it fails. `raw`: the header's bytes, when
    the caller read many headers at once (`headers`)."""
    if obj.dtype != torch.uint8 or obj.dim() != 1 or obj.numel() != object_size(ns) or obj.device.type != "cpu":
        return None
    if raw is None:
        raw = obj[:HEADER_SIZE].numpy().tobytes()
    head, layout = _fixed_parts(ns)
    if raw[:24] != head or raw[24:40] != h or raw[40:72] != layout or raw[_FIXED.size + _TAIL.size:] != _PADDING:
        return None
    if _TAIL.unpack_from(raw, _FIXED.size)[0] != xxhash.xxh3_64_intdigest(raw[: _FIXED.size]):
        return None
    return int.from_bytes(raw[72:80], "little")


def headers(rows: torch.Tensor) -> list[bytes]:
    """The header bytes of each row of ``[n, object_size]`` CPU uint8 objects,
    read in one pass (for `claimed_checksum`'s `raw`)."""
    assert rows.dim() == 2 and rows.dtype == torch.uint8 and rows.shape[1] >= HEADER_SIZE
    raw = rows[:, :HEADER_SIZE].numpy().tobytes()
    return [raw[k: k + HEADER_SIZE] for k in range(0, len(raw), HEADER_SIZE)]


def encode(ns: Namespace, h: BlockHash, payload: torch.Tensor) -> torch.Tensor:
    """A freshly allocated block object for `payload`."""
    return encode_into(torch.empty(object_size(ns), dtype=torch.uint8), ns, h, payload.cpu())


def decode(obj: torch.Tensor, ns: Namespace, h: BlockHash, verify_payload: bool = True) -> torch.Tensor:
    """The payload of `obj` as a [layers, 2, block_tokens, kv_heads, head_dim]
    view in the namespace's dtype, after checking the header against (ns, h)
    and, when `verify_payload`, the payload checksum. Raises CorruptBlockError.
    """
    if obj.dtype != torch.uint8 or obj.dim() != 1 or obj.numel() < HEADER_SIZE:
        raise CorruptBlockError(f"object too short ({obj.numel()} bytes)")
    raw = bytes(_as_bytes(obj[:HEADER_SIZE].cpu()))
    fields = _FIXED.unpack_from(raw)
    (magic, version, hsize, fp, bh, layers, heads, hdim, btok, dcode, ccode, _, _, plen, csum) = fields
    if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise CorruptBlockError(f"bad magic/version ({magic!r}, v{version})")
    if _TAIL.unpack_from(raw, _FIXED.size)[0] != xxhash.xxh3_64_intdigest(raw[: _FIXED.size]):
        raise CorruptBlockError("header checksum mismatch")
    if bh != h:
        raise CorruptBlockError(f"object holds block {bh.hex()}, expected {h.hex()}")
    if fp != ns.fingerprint():
        raise CorruptBlockError("object belongs to another namespace")
    layout = (layers, heads, hdim, btok, dcode, ccode)
    want = (ns.num_layers, ns.kv_heads, ns.head_dim, ns.block_tokens, _DTYPE_CODES[ns.kv_dtype], _CODEC_CODES[ns.codec])
    if layout != want or plen != ns.payload_bytes:
        raise CorruptBlockError(f"layout {layout}/{plen}B differs from expected {want}/{ns.payload_bytes}B")
    if obj.numel() != HEADER_SIZE + plen:
        raise CorruptBlockError(f"object is {obj.numel()} bytes, header says {HEADER_SIZE + plen}")
    payload = obj[HEADER_SIZE:]
    if verify_payload and checksum(payload.cpu()) != csum:
        raise CorruptBlockError("payload checksum mismatch")
    dtype = getattr(torch, ns.kv_dtype)
    return payload.view(dtype).view(ns.block_shape)
