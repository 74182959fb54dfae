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

Decoding checks every field against what the caller asked for (padding and reserved fields: zero); any
mismatch raises CorruptBlockError, which the store turns into a quarantined miss."""
from __future__ import annotations

import struct
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch
import xxhash

from cache_service.blocks.keys import KV_DTYPES, Namespace
from tiers.host_copy import copy_hashed, in_halves, row_sums
from tiers.types import BlockHash, CorruptBlockError


MAGIC = b"TKVB"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_FIXED = struct.Struct("<4sHH16s16sIIIIBBHIQQ")
_TAIL = struct.Struct("<Q")
_PADDED = _FIXED.size + _TAIL.size  # zeros from here to HEADER_SIZE
_HASH_FIELD = slice(24, 40)  # where a header holds its block hash
_CSUM_FIELD = slice(72, 80)  # where it holds its payload checksum
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


def checksums(payloads: Sequence[torch.Tensor]) -> list[int]:
    """`checksum` of each tensor; a large batch on two threads (xxhash lets other threads run meanwhile)."""
    views = [_as_bytes(p) for p in payloads]
    return in_halves(lambda a, b: [xxhash.xxh3_64_intdigest(v) for v in views[a:b]], [len(v) for v in views])


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
    if flat.device.type == "cpu" and out.device.type == "cpu":  # numpy's copies: a few us, not torch's dispatch
        dst = obj.numpy()
        dst[HEADER_SIZE:] = flat.numpy()
        dst[:HEADER_SIZE] = np.frombuffer(header(ns, h, xxhash.xxh3_64_intdigest(dst[HEADER_SIZE:])), np.uint8)
        return obj
    obj[HEADER_SIZE:].copy_(flat)
    hdr = header(ns, h, checksum(obj[HEADER_SIZE:]))
    obj[:HEADER_SIZE].copy_(torch.frombuffer(bytearray(hdr), dtype=torch.uint8))
    return obj


def _claims(heads: torch.Tensor, ns: Namespace, hashes: Sequence[BlockHash]) -> list[int | None]:
    """Per ``[n, HEADER_SIZE]`` header: the payload checksum it claims when it
    is exactly block hashes[i]'s header under `ns`, else None (`decode`'s
    header checks as a few byte comparisons over all rows at once)."""
    assert heads.dim() == 2 and tuple(heads.shape) == (len(hashes), HEADER_SIZE) and heads.dtype == torch.uint8
    if not hashes:
        return []
    want = _template(ns).expand(len(hashes), HEADER_SIZE).clone()
    want[:, _HASH_FIELD] = _hash_rows(hashes)
    fixed = torch.cat([heads[:, :72], heads[:, _PADDED:]], 1)
    same = (fixed == torch.cat([want[:, :72], want[:, _PADDED:]], 1)).all(1).tolist()
    raw = heads[:, :_PADDED].numpy().tobytes()
    out: list[int | None] = []
    for k, ok in zip(range(0, len(raw), _PADDED), same):
        fixed_bytes = raw[k: k + _FIXED.size]
        ok = ok and _TAIL.unpack_from(raw, k + _FIXED.size)[0] == xxhash.xxh3_64_intdigest(fixed_bytes)
        out.append(int.from_bytes(fixed_bytes[72:80], "little") if ok else None)
    return out


def _claim(obj: torch.Tensor, ns: Namespace, h: BlockHash) -> int | None:
    """`_claims` of one 1-D object, None too when it is not exactly the namespace's size."""
    if obj.dtype != torch.uint8 or obj.dim() != 1 or obj.numel() != object_size(ns) or obj.device.type != "cpu":
        return None
    return _claims(obj[:HEADER_SIZE].view(1, -1), ns, [h])[0]


@lru_cache(maxsize=256)
def _template(ns: Namespace) -> torch.Tensor:
    """A header of `ns` as a [1, HEADER_SIZE] tensor: the bytes every object under ns shares
    (all but the block hash, the payload checksum and the header checksum)."""
    return torch.frombuffer(bytearray(header(ns, BlockHash(bytes(16)), 0)), dtype=torch.uint8).view(1, -1)


def encode_rows(rows: torch.Tensor, ns: Namespace, hashes: Sequence[BlockHash],
                payloads: Sequence[torch.Tensor]) -> None:
    """`encode_into` for many blocks: row i of ``[n, object_size]`` uint8 CPU
    `rows` becomes block i's object (each payload copied and hashed in one
    pass, `tiers.host_copy.copy_hashed`)."""
    assert rows.dim() == 2 and rows.dtype == torch.uint8 and tuple(rows.shape) == (len(hashes), object_size(ns))
    encode_objects(rows, range(len(hashes)), ns, hashes, payloads)


def encode_objects(rows: torch.Tensor, slots: Sequence[int], ns: Namespace, hashes: Sequence[BlockHash],
                   payloads: Sequence[torch.Tensor]) -> None:
    """`encode_rows` into chosen rows: block i's object into ``rows[slots[i]]``
    of a ``[num_rows, >= object_size]`` uint8 CPU tensor (a shared pool)."""
    encode_flats(rows, slots, ns, hashes, payload_bytes(ns, payloads))


def payload_bytes(ns: Namespace, payloads: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each payload's bytes as a flat uint8 array (a view where it can be); ValueError for a wrong size."""
    return [_flat(ns, p).numpy() for p in payloads]


def encode_flats(rows: torch.Tensor, slots: Sequence[int], ns: Namespace, hashes: Sequence[BlockHash],
                 flats: Sequence[np.ndarray]) -> None:
    """`encode_objects` from `payload_bytes`."""
    assert len(slots) == len(hashes) == len(flats) and rows.dtype == torch.uint8 and rows.dim() == 2
    size = object_size(ns)
    assert rows.shape[1] >= size and rows.stride(1) == 1
    if not flats:
        return
    table = rows.numpy()
    sums = copy_hashed([table[s, HEADER_SIZE:size] for s in slots], flats)
    rehead(rows, ns, hashes, sums, at=slots)


def _hash_rows(hashes: Sequence[BlockHash]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8).view(-1, 16)


def _flat(ns: Namespace, payload: torch.Tensor) -> torch.Tensor:
    flat = payload.detach().cpu().contiguous().view(-1).view(torch.uint8)
    if flat.numel() != ns.payload_bytes:
        raise ValueError(f"payload has {flat.numel()} bytes, namespace expects {ns.payload_bytes}")
    return flat


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
    (magic, version, hsize, fp, bh, layers, heads, hdim, btok, dcode, ccode, r1, r2, plen, csum) = fields
    if magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_SIZE or r1 or r2 or raw[_PADDED:].strip(b"\0"):
        raise CorruptBlockError(f"bad magic/version/padding ({magic!r}, v{version})")  # padding zero, as in verify
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
    payload = payload.clone() if payload.data_ptr() % dtype.itemsize else payload  # an odd offset: no wider view
    return payload.view(dtype).view(ns.block_shape)


# ---------------------------------------------------------------- verification
# One API for every object read from a tier or received over a wire or from
# another process: `verify` (a checksum per object, None for a bad one),
# `require` (the checksums, or CorruptBlockError with `diagnose`'s reason) and
# `rehead` (a tenant's keys: same payload, new header). Objects come as
# ``[n, object_size]`` uint8 CPU rows, as a sequence of 1-D tensors (read
# from a tier: any size, a wrong one fails) or as memoryviews of object_size
# bytes (streamed objects, where a few torch calls per block would cost more
# than the check).
Objects = torch.Tensor | Sequence[torch.Tensor] | Sequence[memoryview]


def verify(objs: Objects, ns: Namespace, hashes: Sequence[BlockHash],
           sums: Sequence[int | None] | None = None, payload: bool = True) -> list[int | None]:
    """Per object: its payload checksum when its header is exactly block
    hashes[i]'s under `ns` and its payload hashes to that checksum, else
    None. `sums`: the payloads' checksums, if the caller has them already
    (hashed as it copied them, or where they lie). Without `payload` only
    the headers are checked (the checksum they claim). Rows may be headers
    alone, ``[n, HEADER_SIZE]``, when no payload is to be hashed here."""
    assert len(objs) == len(hashes)
    if isinstance(objs, torch.Tensor):
        heads_only = not payload or sums is not None
        assert objs.dim() == 2 and objs.shape[1] in ((HEADER_SIZE, object_size(ns)) if heads_only else
                                                     (object_size(ns),))
        claims = _claims(objs[:, :HEADER_SIZE], ns, hashes)
        payloads = list(objs[:, HEADER_SIZE:].unbind(0)) if payload and sums is None else None
    elif objs and not isinstance(objs[0], torch.Tensor):
        assert sums is None
        return [_verify_view(o, ns, h, payload) for o, h in zip(objs, hashes)]
    else:
        claims = [_claim(o, ns, h) for o, h in zip(objs, hashes)]
        payloads = [o[HEADER_SIZE:] for o in objs] if payload and sums is None else None
    if not payload:
        return claims
    if sums is None:  # hash only the payloads whose headers passed
        sound = [j for j, c in enumerate(claims) if c is not None]
        sums = [None] * len(claims)
        for j, s in zip(sound, checksums([payloads[j] for j in sound])):
            sums[j] = s
    return [c if c is not None and c == s else None for c, s in zip(claims, sums)]


def _verify_view(obj: memoryview, ns: Namespace, h: BlockHash, payload: bool = True) -> int | None:
    """`verify` of one view: the canonical header for its payload's (or its
    claimed) checksum, compared whole."""
    if len(obj) != object_size(ns):
        return None
    if payload:
        csum = xxhash.xxh3_64_intdigest(obj[HEADER_SIZE:])
    else:
        csum = int.from_bytes(obj[_CSUM_FIELD], "little")
    return csum if obj[:HEADER_SIZE] == header(ns, h, csum) else None


def intact(h: BlockHash, obj: memoryview) -> bool:
    """Whether `obj` is a whole object of block `h` by its own header (its namespace unknown here): magic,
    version, zero padding, header checksum, hash, length, payload checksum. What a disk rebuilding its index keeps."""
    if len(obj) < HEADER_SIZE:
        return False
    head = bytes(obj[:HEADER_SIZE])
    fields = _FIXED.unpack_from(head)
    magic, version, hsize, bh, plen, csum = fields[0], fields[1], fields[2], fields[4], fields[13], fields[14]
    return (magic == MAGIC and version == FORMAT_VERSION and hsize == HEADER_SIZE and bh == h
            and not fields[11] and not fields[12] and not head[_PADDED:].strip(b"\0")
            and _TAIL.unpack_from(head, _FIXED.size)[0] == xxhash.xxh3_64_intdigest(head[:_FIXED.size])
            and len(obj) == HEADER_SIZE + plen and xxhash.xxh3_64_intdigest(obj[HEADER_SIZE:]) == csum)


def require(objs: Objects, ns: Namespace, hashes: Sequence[BlockHash],
            sums: Sequence[int] | None = None, payload: bool = True) -> list[int]:
    """`verify`'s checksums when every object passes; else CorruptBlockError
    saying what is wrong with the first bad one (`diagnose`)."""
    got = verify(objs, ns, hashes, sums, payload)
    bad = next((i for i, c in enumerate(got) if c is None), None)
    if bad is not None:
        raise diagnose(objs[bad], ns, hashes[bad], payload)
    return got


def diagnose(obj: torch.Tensor | memoryview, ns: Namespace, h: BlockHash, payload: bool = True) -> CorruptBlockError:
    """What `decode` finds wrong with an object that failed `verify` (a sound one: a canonical-header error)."""
    if not isinstance(obj, torch.Tensor):
        obj = torch.frombuffer(bytearray(obj), dtype=torch.uint8)
    try:
        decode(obj, ns, h, verify_payload=payload)
    except CorruptBlockError as e:
        return e
    return CorruptBlockError("header is not canonical (reserved bytes set)")


def rehead(rows: Objects, ns: Namespace, keys: Sequence[BlockHash], sums: Sequence[int],
           at: Sequence[int] | None = None) -> None:
    """Head object i of `rows` (or row at[i]: a shared pool's slots) as block
    keys[i] under `ns` with payload checksum sums[i]: the payloads stay, only
    the headers are written (a tenant's keys, a freshly filled slot)."""
    if not len(keys):
        return
    if not isinstance(rows, torch.Tensor):  # writable views
        for i, (k, c) in enumerate(zip(keys, sums)):
            rows[at[i] if at is not None else i][:HEADER_SIZE] = header(ns, k, c)
        return
    heads = torch.from_numpy(_heads(ns, keys, sums))
    if at is None:
        rows[:, :HEADER_SIZE].copy_(heads)
    else:
        rows[:, :HEADER_SIZE].index_copy_(0, torch.tensor(list(at), dtype=torch.long), heads)


def _heads(ns: Namespace, keys: Sequence[BlockHash], sums: Sequence[int]) -> np.ndarray:
    """`header(ns, keys[i], sums[i])` of each i as rows of one [n, HEADER_SIZE]
    array: the namespace's template with the hash and checksum fields set,
    then each row's header checksum (one `header` call per block costs more)."""
    heads = np.repeat(_template(ns).numpy(), len(keys), axis=0)
    heads[:, _HASH_FIELD] = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16)
    heads[:, _CSUM_FIELD] = np.array(sums, dtype="<u8").view(np.uint8).reshape(-1, 8)
    tails = row_sums(np.ascontiguousarray(heads[:, :_FIXED.size]))
    heads[:, _FIXED.size:_FIXED.size + _TAIL.size] = np.array(tails, dtype="<u8").view(np.uint8).reshape(-1, 8)
    return heads


def adopt(rows: torch.Tensor, sent_ns: Namespace, sent: Sequence[BlockHash], ns: Namespace,
          keys: Sequence[BlockHash], sums: Sequence[int] | None = None) -> list[int]:
    """`require` of objects a client encoded under its own (namespace,
    hashes), then `rehead` for the store's (ns, keys) when those differ.
    Their payload checksums."""
    got = require(rows, sent_ns, sent, sums)
    if (sent_ns, list(sent)) != (ns, list(keys)):
        rehead(rows, ns, keys, got)
    return got
