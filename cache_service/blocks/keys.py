"""Block keys: the namespace fingerprint and chained block hashes.

The normative text is docs/hash-spec.md; this module is its reference
implementation. No ``hash()``, no pickle: keys are identical across
processes, Python versions and machines.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Sequence

import numpy as np
import xxhash

from tiers.types import HASH_BYTES, BlockHash, ConfigError

SPEC_VERSION = 1
KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}
CODECS = ("raw",)

try:  # optional C loop over libxxhash; same digests, ~50x less Python overhead
    from cache_service.blocks import _hashchain  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _hashchain = None


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV bytes of one layout incompatible with another."""

    model_id: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int = 16
    model_revision: str = ""
    tp_rank: int = 0
    tp_world: int = 1
    codec: str = "raw"
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ConfigError("namespace.model_id must not be empty")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"namespace.kv_dtype {self.kv_dtype!r} not in {sorted(KV_DTYPES)}")
        for name in ("num_layers", "kv_heads", "head_dim", "block_tokens", "tp_world"):
            if type(getattr(self, name)) is not int or getattr(self, name) <= 0:  # not a bool, not 2.0
                raise ConfigError(f"namespace.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("model_id", "kv_dtype", "model_revision", "codec", "tenant_salt"):
            value = getattr(self, name)  # the canonical form is one "key=value" line per field
            if not isinstance(value, str) or "\n" in value or "\r" in value:
                raise ConfigError(f"namespace.{name} must be a one-line string, got {value!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_world:
            raise ConfigError(f"namespace.tp_rank {self.tp_rank} outside [0, {self.tp_world})")
        if self.codec not in CODECS:
            raise ConfigError(f"namespace.codec {self.codec!r} not in {CODECS}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Canonical payload shape: [layers, 2, block_tokens, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        n = self.num_layers * 2 * self.block_tokens * self.kv_heads * self.head_dim
        return n * KV_DTYPES[self.kv_dtype]

    def canonical(self) -> bytes:
        """The byte string the fingerprint hashes (docs/hash-spec.md)."""
        lines = [f"tierkv-namespace\nspec_version={SPEC_VERSION}"]
        lines += [f"{f.name}={getattr(self, f.name)}" for f in fields(self)]
        return "\n".join(lines).encode("utf-8")

    def fingerprint(self) -> bytes:
        """16-byte xxh3_128 of `canonical()`; h_{-1} of every chain."""
        return _fingerprint(self)

    def with_tenant(self, tenant: str) -> "Namespace":
        return replace(self, tenant_salt=tenant)


@lru_cache(maxsize=256)
def _fingerprint(ns: Namespace) -> bytes:
    return xxhash.xxh3_128_digest(ns.canonical())


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes (the hashed form)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "biu":  # a float id would be truncated into another token's
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def chain_hashes(
    parent: bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    extras: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`, chained from `parent`.

    ``h_i = xxh3_128(h_{i-1} || tokens_i as <i4 || extra_i)``; a trailing
    partial block is not hashed. `extras`, when given, holds one byte string
    per full block (LoRA id, multimodal hash, ...).
    """
    assert len(parent) == HASH_BYTES, "parent must be a 16-byte hash"
    if _hashchain is not None and extras is None and isinstance(token_ids, (list, tuple)):
        try:  # the common case (a list of ints) without building an array first
            return _hashchain.chain_list(parent, token_ids, block_tokens)
        except OverflowError:
            raise ValueError("token ids must fit in int32") from None
        except TypeError:
            pass  # not plain ints (numpy scalars, nested lists): the general path checks
    buf = token_bytes(token_ids)
    step = block_tokens * 4
    n = len(buf) // step
    if extras is not None and len(extras) < n:
        raise ValueError(f"need {n} extras, got {len(extras)}")
    if extras is None or not any(extras[:n]):
        if _hashchain is not None:
            out = _hashchain.chain(parent, buf[: n * step], step)
            return [BlockHash(out[i : i + HASH_BYTES]) for i in range(0, len(out), HASH_BYTES)]
        extras = None
    digest = xxhash.xxh3_128_digest
    hashes: list[BlockHash] = []
    h = parent
    for i in range(n):
        extra = extras[i] if extras is not None else b""
        h = digest(h + buf[i * step : (i + 1) * step] + extra)
        hashes.append(BlockHash(h))
    return hashes


def prefix_hashes(ns: Namespace, token_ids: Sequence[int] | np.ndarray, salt: bytes = b"") -> list[BlockHash]:
    """Block hashes of the full blocks of a prompt under namespace `ns`; a
    `salt` (a request's cache salt, digested) starts the chain elsewhere, so
    only requests with the same salt share blocks (the namespace stays one)."""
    root = xxhash.xxh3_128_digest(ns.fingerprint() + salt) if salt else ns.fingerprint()
    return chain_hashes(root, token_ids, ns.block_tokens)


@lru_cache(maxsize=1024)
def _tenant_salt(tenant: str) -> bytes:
    return xxhash.xxh3_128_digest(b"tierkv-tenant\n" + tenant.encode("utf-8"))


def tenant_keys(tenant: str | None, hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """Store keys of `hashes` for an authenticated tenant: xxh3_128(salt(tenant)
    || h). With auth off (None) keys are the client's hashes, so a daemon and
    an embedded ``local://`` store over the same directory share blocks."""
    if not tenant:
        return list(hashes)
    salt = _tenant_salt(tenant)
    digest = xxhash.xxh3_128_digest
    return [BlockHash(digest(salt + h)) for h in hashes]
