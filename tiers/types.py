"""Shared types of tierkv: the block key and the error hierarchy.

Every layer (tiers, store, connectors, engine) may import this module; it
imports nothing of ours.
"""
from __future__ import annotations

from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""16 bytes (xxh3_128, see docs/hash-spec.md). The same bytes are the lmdb
key, the S3 object name (hex) and the Redis key."""

HASH_BYTES = 16


class TierKVError(Exception):
    """Base of every error tierkv raises at a public boundary."""


class ConfigError(TierKVError, ValueError):
    """A configuration key or value is wrong; the message names it."""


class CorruptBlockError(TierKVError):
    """A stored object failed verification (header, layout or checksum)."""


class CapacityError(TierKVError):
    """A tier cannot hold an object (too large, or full of pinned blocks)."""


class TierUnavailableError(TierKVError):
    """A tier's backing service (disk, S3, Redis) cannot be reached."""
