"""Conversions between the daemon's protobuf messages and tierkv's types.

Shared by the server (`cache_service/server/servicer.py`) and the client
(`connectors/grpc/client.py`), so both sides agree on one encoding. Every
check that turns a malformed request into a gRPC status lives here, as a
`RequestError` carrying the status code.
"""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Sequence

import grpc
import torch

from cache_service.blocks.keys import Namespace
from cache_service.sessions.manifests import Session
from proto import tierkv_pb2 as pb
from tiers.types import HASH_BYTES, BlockHash, ConfigError, TierKVError

MAX_NAME = 256  # characters of a namespace string field
MAX_DIM = 1 << 16  # any one namespace dimension


class RequestError(TierKVError):
    """A request the daemon refuses; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


MALFORMED = object()  # a request whose bytes did not parse (`lenient`)


def lenient(request_type):
    """A gRPC request deserializer giving MALFORMED for bytes that do not
    parse, so the servicer refuses the call by status (INVALID_ARGUMENT,
    counted), where gRPC answers INTERNAL and logs a traceback per call."""
    def parse_or_mark(body: bytes):
        try:
            return request_type.FromString(body)
        except Exception:  # protobuf's DecodeError
            return MALFORMED
    return parse_or_mark


def parse(request_type, body: bytes, method: str):
    """A request parsed from its bytes; INVALID_ARGUMENT when they are malformed."""
    try:
        return request_type.FromString(body)
    except Exception:  # protobuf's DecodeError
        raise invalid(f"{method}: malformed request") from None


# ---------------------------------------------------------------- namespace
_NS_FIELDS = tuple(f.name for f in fields(Namespace))


def ns_to_pb(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(**{name: getattr(ns, name) for name in _NS_FIELDS})


def ns_from_pb(msg: pb.Namespace) -> Namespace:
    """A validated Namespace; INVALID_ARGUMENT names the bad field."""
    values = {name: getattr(msg, name) for name in _NS_FIELDS}
    for name, v in values.items():
        if isinstance(v, str) and len(v) > MAX_NAME:
            raise invalid(f"namespace.{name} is longer than {MAX_NAME} characters")
        if isinstance(v, int) and v > MAX_DIM:
            raise invalid(f"namespace.{name} = {v} is larger than {MAX_DIM}")
    values["codec"] = values["codec"] or "raw"  # proto3 default: ""
    values["tp_world"] = values["tp_world"] or 1
    try:
        return Namespace(**values)
    except ConfigError as e:
        raise invalid(f"unknown namespace layout: {e}") from None


def require_ns(msg) -> Namespace:
    if not msg.HasField("ns"):
        raise invalid("request has no namespace (field ns)")
    return ns_from_pb(msg.ns)


# ---------------------------------------------------------------- hashes
def hashes_from_pb(raw: Sequence[bytes], max_blocks: int) -> list[BlockHash]:
    """Checked block hashes: each exactly 16 bytes, at most `max_blocks`."""
    if len(raw) > max_blocks:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{len(raw)} hashes in one request; the limit is {max_blocks}")
    for i, h in enumerate(raw):
        if len(h) != HASH_BYTES:
            raise invalid(f"hashes[{i}] is {len(h)} bytes; block hashes are {HASH_BYTES} bytes")
    return [BlockHash(h) for h in raw]


# ---------------------------------------------------------------- payloads
def torch_dtype(ns: Namespace) -> torch.dtype:
    return getattr(torch, ns.kv_dtype)


def check_payloads(ns: Namespace, hashes: Sequence[BlockHash], payloads: Sequence[torch.Tensor]) -> None:
    """The store's own argument checks, made before anything is sent."""
    if len(hashes) != len(payloads):
        raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
    for i, p in enumerate(payloads):
        if p.numel() * p.element_size() != ns.payload_bytes:
            raise ValueError(f"payload {i} has {p.numel() * p.element_size()} bytes, "
                             f"namespace expects {ns.payload_bytes}")


def as_payload(buf: torch.Tensor, ns: Namespace) -> torch.Tensor:
    """A uint8 buffer of ns.payload_bytes as the canonical payload view."""
    return buf.view(torch_dtype(ns)).view(ns.block_shape)


# ---------------------------------------------------------------- sessions
def session_to_pb(s: Session) -> pb.Session:
    return pb.Session(session_id=s.session_id, tenant=s.tenant, model_id=s.model_id, namespace=s.namespace,
                      messages_json=json.dumps(s.messages), token_ids=s.token_ids, updated_s=s.updated_s)


def session_from_pb(msg: pb.Session) -> Session:
    try:
        messages = json.loads(msg.messages_json) if msg.messages_json else []
    except (ValueError, RecursionError) as e:  # nested past the parser's depth: as malformed as bad JSON
        raise invalid(f"session.messages_json is not JSON: {e}") from None
    if msg.namespace and (len(msg.namespace) != 32 or not _is_hex(msg.namespace)):
        raise invalid("session.namespace must be empty or a namespace fingerprint (32 hex digits)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise invalid("session.messages_json must be a JSON list of objects")
    if any(not -(2**31) <= t < 2**31 for t in msg.token_ids):
        raise invalid("session.token_ids must fit in int32")
    return Session(session_id=msg.session_id, tenant=msg.tenant, model_id=msg.model_id, namespace=msg.namespace,
                   messages=messages, token_ids=list(msg.token_ids), updated_s=msg.updated_s)


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- stats
def stats_to_pb(stats: dict[str, dict[str, int]], daemon: dict[str, int]) -> pb.StatsReply:
    reply = pb.StatsReply(tier_order=list(stats), daemon=daemon)
    for name, counters in stats.items():
        reply.tiers[name].counters.update({k: int(v) for k, v in counters.items()})
    return reply


def stats_from_pb(reply: pb.StatsReply) -> dict[str, dict[str, int]]:
    """TieredStore.stats() shape, tiers in hierarchy order."""
    return {name: dict(reply.tiers[name].counters) for name in reply.tier_order}
