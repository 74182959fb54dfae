"""Typed configuration: TOML file + ``TIERKV_*`` environment + overrides.

Built once at the entry point (CLI, daemon, ``connect(url)``); nothing below
reads an untyped dict. Example ``tierkv.toml``::

    [store]
    queue_depth = 1024          # per lower tier; when full, queue_full = "wait" (or "skip")
    promote_after_hits = 2      # local lower-tier hits before a block is copied up (S3: the first; 0: never)
    tenant_pin_bytes = "4GiB"   # a tenant's session pins at most, and its block pins; past it its oldest yield

    [tiers.cpu]
    capacity = "4GiB"
    policy = "lru"

    [tiers.disk]
    path = "/var/cache/tierkv"
    capacity = "100GiB"
    write = "through"           # or "back" (written when evicted from above)

    [directory]                 # optional: cross-node index and shared sessions
    url = "redis://10.0.0.5:6379/0"   # or cluster = "10.0.0.5:7000,10.0.0.6:7000"
    node_id = "gpu-node-3"      # default: hostname + a digest of the disk path
    heartbeat_ttl_s = 15

    [server]                    # `tierkv serve` only; its flags override these
    listen = "0.0.0.0:7600"
    token_file = "/etc/tierkv/tokens"   # "<token> <tenant>" per line; without one, no auth at all
    metrics_port = 9600         # or "off" (the default)
    data_port = "off"           # the TCP data path; default 0: any free port

Environment variables address the same keys with ``__`` between levels
(``TIERKV_TIERS__CPU__CAPACITY=8GiB``; ``TIERKV_STORE_QUEUE_FULL`` is an error).
"""
from __future__ import annotations

import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping

from tiers.cache_root import default_cache_dir
from tiers.types import ConfigError

TIER_ORDER = ("hbm", "cpu", "disk", "s3")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MiB = 1 << 20


def parse_size(value: int | str, key: str = "size") -> int:
    """Bytes from an int or a string like "4GiB", "512 MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    n = value if isinstance(value, int) else None
    if n is None:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: cannot parse size {value!r} (use e.g. 4GiB, 512MiB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{key}: size must be positive, got {value!r}")
    return n


def _check_duration(key: str, value: float) -> None:
    """A positive, finite number of seconds (TOML allows nan and inf)."""
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a positive finite number of seconds, got {value}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")


@dataclass(slots=True)
class TierConfig:
    """Settings every tier has."""

    capacity: int = 0
    policy: str = "lru"
    write: str = "back"

    def __post_init__(self) -> None:
        self.capacity = parse_size(self.capacity, "capacity") if self.capacity else 0
        _check_choice("write", self.write, ("back", "through"))
        from cache_service.store.eviction import POLICIES, TIER_POLICIES

        _check_choice("policy", self.policy, POLICIES + TIER_POLICIES)


@dataclass(slots=True)
class HbmConfig(TierConfig):
    device: str = ""
    slot_bytes: int = 0


@dataclass(slots=True)
class CpuConfig(TierConfig):
    pin: str = "auto"
    slot_bytes: int = 0
    prefault: bool = False  # touch the pool's pages in the background at start (daemons)
    # the pool in a memfd same-host clients write into (cache_service/server/pool.py); auto: yes under `tierkv serve`
    shared: str = "auto"

    def __post_init__(self) -> None:
        TierConfig.__post_init__(self)
        _check_choice("pin", self.pin, ("auto", "yes", "no"))
        _check_choice("shared", self.shared, ("auto", "yes", "no"))
        if self.shared == "yes" and self.pin == "yes":
            raise ConfigError("tiers.cpu: a shared pool is not page-locked (pin = \"auto\" or \"no\")")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.capacity > ram:  # allocated at the first block: every store would fail then
            raise ConfigError(f"tiers.cpu.capacity {self.capacity} B exceeds this machine's memory ({ram} B)")


@dataclass(slots=True)
class DiskConfig(TierConfig):
    path: str = ""
    fsync: bool = True
    write: str = "through"
    policy: str = "sampled"  # LRU from the index's own access times: opens in O(1), no RAM per block

    def __post_init__(self) -> None:
        TierConfig.__post_init__(self)
        self.path = self.path or str(default_cache_dir() / "store")


@dataclass(slots=True)
class S3Config(TierConfig):
    """S3 (or compatible). Empty endpoint: AWS; empty keys: boto3's credential chain (AWS_* env, profile, role)."""

    bucket: str = ""
    prefix: str = "tierkv"
    endpoint: str = ""
    region: str = "us-east-1"
    access_key: str = ""
    secret_key: str = ""
    addressing_style: str = "path"
    max_concurrency: int = 8
    multipart_threshold: int = 8 * 2**20
    connect_timeout: float = 2.0
    read_timeout: float = 10.0
    retries: int = 2
    write: str = "through"
    # the upload journal (cache_service/store/journal.py): its size bound (0: none) and its
    # directory (default: journal.lmdb beside the disk tier's index, else under the cache root)
    journal_bytes: int = 1 << 30
    journal_path: str = ""

    def __post_init__(self) -> None:
        TierConfig.__post_init__(self)
        if self.journal_bytes and self.journal_bytes < 1 << 20:
            raise ConfigError(f"journal_bytes must be 0 (no journal) or at least 1MiB, got {self.journal_bytes}")
        if not self.capacity:
            raise ConfigError("capacity is required")
        if not self.bucket:
            raise ConfigError("bucket is required")
        _check_choice("addressing_style", self.addressing_style, ("path", "virtual", "auto"))
        for name in ("connect_timeout", "read_timeout"):
            _check_duration(name, getattr(self, name))
        if self.max_concurrency < 1 or self.retries < 0:
            raise ConfigError(f"max_concurrency must be at least 1 and retries at least 0, "
                              f"got {self.max_concurrency} and {self.retries}")


@dataclass(slots=True)
class TiersConfig:
    """Which tiers exist (None = not configured), top to bottom."""

    hbm: HbmConfig | None = None
    cpu: CpuConfig | None = field(default_factory=lambda: CpuConfig(capacity=2**30))
    disk: DiskConfig | None = None
    s3: S3Config | None = None

    def __post_init__(self) -> None:
        for name in ("hbm", "cpu", "disk"):
            t = getattr(self, name)
            if t is not None and not t.capacity:
                raise ConfigError(f"tiers.{name}.capacity is required")
        if self.cpu is None and self.disk is None and self.hbm is None:
            raise ConfigError("tiers: configure at least one tier")


@dataclass(slots=True)
class StoreConfig:
    """Background-write behaviour of the TieredStore."""

    queue_depth: int = 1024
    queue_full: str = "wait"
    promote_after_hits: int = 2  # a block read once from a lower tier stays there (one-shot reads copy nothing)
    flush_timeout_s: float = 30.0
    # a tenant's session-pinned bytes at most (session hints, cache_service/store/pins.py); past it its oldest pin yields
    tenant_pin_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        self.tenant_pin_bytes = parse_size(self.tenant_pin_bytes, "store.tenant_pin_bytes")
        if self.queue_depth <= 0:
            raise ConfigError(f"store.queue_depth must be positive, got {self.queue_depth}")
        _check_choice("store.queue_full", self.queue_full, ("wait", "skip"))
        if self.promote_after_hits < 0:
            raise ConfigError(f"store.promote_after_hits must be >= 0, got {self.promote_after_hits}")
        _check_duration("store.flush_timeout_s", self.flush_timeout_s)


@dataclass(slots=True)
class DirectoryConfig:
    """The Redis directory (cache_service/directory/redis_directory.py): one Redis (`url`) or a Redis
    Cluster (`cluster`, comma-separated host:port startup nodes)."""

    url: str = ""
    cluster: str = ""
    node_id: str = ""  # empty: hostname + digest of the disk tier's path
    endpoint: str = ""  # how peers reach this node (e.g. its daemon's grpc://), informational
    prefix: str = ""  # key prefix; empty: derived from the S3 bucket and prefix, else "tierkv"
    heartbeat_ttl_s: float = 15.0
    block_ttl_s: float = 7 * 86400.0
    socket_timeout_s: float = 0.5
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.cluster):
            raise ConfigError("directory: set exactly one of url and cluster")
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"directory.url {self.url!r} must start with redis://, rediss:// or unix://")
        for node in filter(None, self.cluster.split(",")):
            host, _, port = node.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ConfigError(f"directory.cluster: {node!r} is not host:port (a port of 1-65535)")
        if self.cluster and not self.cluster_nodes():
            raise ConfigError(f"directory.cluster {self.cluster!r} names no node")
        for name in ("heartbeat_ttl_s", "block_ttl_s", "socket_timeout_s", "max_backoff_s"):
            _check_duration(f"directory.{name}", getattr(self, name))

    def cluster_nodes(self) -> list[tuple[str, int]]:
        return [(h, int(p)) for h, _, p in (n.strip().rpartition(":") for n in self.cluster.split(",") if n.strip())]


@dataclass(slots=True)
class ServerConfig:
    """The daemon (`tierkv serve`): how it listens and what one request may ask for.
    Optional ports take "off" in TOML and env for None."""

    listen: str = "127.0.0.1:7600"
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"
    token_file: str | None = None  # None: auth off (see cache_service/server/auth.py)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    sessions_dir: str | None = None  # manifests under <dir>/sessions; None: the disk tier's path
    shm_dir: str = "/dev/shm"
    max_message_bytes: int = 8 * MiB
    chunk_bytes: int = 1 * MiB  # payload bytes per streamed message
    max_request_bytes: int = 1024 * MiB  # payload bytes per Store / StoreShm
    max_blocks: int = 65536  # hashes per request
    load_batch_bytes: int = 64 * MiB  # Load reads (and holds) this much at a time; a data-path call carries at most this
    data_port: int | None = 0  # the data path (cache_service/server/data_path.py): 0 any free port, None off; never with TLS
    workers: int = 16
    max_concurrent_rpcs: int = 256
    grace_s: float = 10.0  # SIGTERM: in-flight calls get this long to finish
    stream_idle_s: float = 30.0  # a Store/Load stream making no progress this long is cancelled (stalls.py)
    max_sessions: int = 10_000  # session manifests per tenant (cache_service/sessions/quota.py)

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen address {self.listen!r} must be HOST:PORT (a port of 0-65535)")
        for name in ("metrics_port", "data_port"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be 0-65535 (or off), got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s must not be negative, got {self.grace_s}")
        for name in ("max_message_bytes", "chunk_bytes", "max_request_bytes", "max_blocks", "load_batch_bytes",
                     "workers", "max_concurrent_rpcs", "stream_idle_s", "max_sessions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunk_bytes + 64 * 1024 > self.max_message_bytes:
            raise ConfigError(f"chunk_bytes {self.chunk_bytes} leaves no room under max_message_bytes "
                              f"{self.max_message_bytes}")


@dataclass(slots=True)
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    directory: DirectoryConfig | None = None
    server: ServerConfig = field(default_factory=ServerConfig)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert one raw value (TOML or env string) to the annotated type."""
    if is_dataclass(tp):
        return build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (value == "off" and not is_dataclass(args[0])):  # TOML has no null
            return None
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    leaf = key.rsplit(".", 1)[-1]
    if tp is int and (leaf == "capacity" or leaf.endswith("_bytes")):
        off = leaf != "capacity" and not isinstance(value, bool) and value in (0, "0")  # 0: none / automatic
        return 0 if off else parse_size(value, key)
    try:
        if tp in (int, float) and isinstance(value, bool):
            raise ValueError
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError  # 0.5 is no count: truncated, it would say 0
        if tp is str and not isinstance(value, (str, os.PathLike)):
            raise ValueError  # path = 5 is a slip, not the relative path "5"
        out = tp(value)
        if tp is float and not math.isfinite(out):
            raise ValueError
        return out
    except (TypeError, ValueError, OverflowError):
        what = {"float": "a finite number", "str": "a string", "int": "an integer"}.get(tp.__name__, tp.__name__)
        raise ConfigError(f"{key}: expected {what}, got {value!r}") from None


def build(cls: type, raw: Mapping[str, Any] | None, prefix: str = "") -> Any:
    """Instantiate dataclass `cls` from a nested mapping; unknown keys fail by name."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for k in raw:
        if k not in known:
            raise ConfigError(f"unknown config key {prefix + '.' if prefix else ''}{k} (known: {', '.join(sorted(known))})")
    kwargs = {k: _coerce(f"{prefix + '.' if prefix else ''}{k}", v, hints[k]) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if not prefix or msg.startswith(prefix) else f"{prefix}.{msg}") from None


def _env_tree(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    sections = {f.name for f in fields(Config)}
    for name, value in env.items():
        section, _, key = name[len("TIERKV_"):].partition("_")
        if not name.startswith("TIERKV_") or "__" not in name:  # other TIERKV_ variables are not config...
            if name.startswith("TIERKV_") and section.lower() in sections:  # ...but a section's name is
                raise ConfigError(f"{name}: config variables put __ between levels, e.g. TIERKV_{section}__{key}")
            continue
        path = name[len("TIERKV_"):].lower().split("__")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path[:-1])}: expected a table, but another variable sets it")
        if isinstance(node.get(path[-1]), dict):
            raise ConfigError(f"{name}: {'.'.join(path)}: expected a table, but another variable sets keys under it")
        node[path[-1]] = value
    return tree


def _merge(base: Mapping[str, Any], over: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    if not isinstance(base, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a table, got {base!r}")
    out = dict(base)
    for k, v in over.items():
        key = f"{where}.{k}" if where else k
        out[k] = _merge(out.get(k) or {}, v, key) if isinstance(v, Mapping) else v
    return out


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Config from TOML `path` (optional), then ``TIERKV_*`` env, then `overrides`."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    raw = _merge(raw, _env_tree(os.environ if env is None else env))
    raw = _merge(raw, overrides or {})
    return build(Config, raw)
