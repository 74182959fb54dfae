"""The daemon's RPC boundary: every servicer method is wrapped by `rpc`.

The wrapper resolves the caller's tenant from its token, times the call,
turns every exception into a gRPC status with a clear message (never a
crash, never a stack trace to the client) and counts the outcome. Methods
it wraps take ``(self, request, context, tenant)``; ``tenant`` is None with
auth off. The servicer must have ``auth`` (`Authenticator`) and ``metrics``
(`Metrics`) attributes.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc

from cache_service.sessions.manifests import SessionError
from cache_service.protocol.messages import MALFORMED, RequestError, invalid, parse
from tiers.types import CapacityError, ConfigError, TierKVError, TierUnavailableError

log = logging.getLogger("tierkv.server")
OK = grpc.StatusCode.OK


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed call answers with."""
    if isinstance(exc, RequestError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.RpcError):  # raised by a request iterator when the client went away
        return grpc.StatusCode.CANCELLED, "the client cancelled the call"
    if isinstance(exc, (SessionError, ConfigError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, TierUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TierKVError):
        return grpc.StatusCode.INTERNAL, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log"


def _report(method: str, tenant: str | None, exc: BaseException, code: grpc.StatusCode, msg: str) -> None:
    fields = {"method": method, "tenant": tenant or "-", "code": code.name, "error": msg}
    if code is grpc.StatusCode.INTERNAL:
        log.error("rpc failed", exc_info=exc, extra={"fields": fields})
    else:
        log.info("rpc refused", extra={"fields": fields})


def rpc(fn):
    """Wrap a servicer method (plain or generator) with auth, status mapping and metrics."""
    method = fn.__name__

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def streaming(self, request, context):
            t0, tenant, code, msg = time.perf_counter(), None, OK, ""
            _track(self, +1)
            try:
                tenant = self.auth.tenant_of(context.invocation_metadata())
                yield from fn(self, _parsed(request, method), context, tenant)
            except GeneratorExit:  # the client stopped reading: nothing to answer
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:
                code, msg = status_of(e)
                _report(method, tenant, e, code, msg)
            finally:
                _track(self, -1)
                self.metrics.observe(method, tenant, code, time.perf_counter() - t0)
            if code is not OK:
                context.abort(code, msg)
        return streaming

    @functools.wraps(fn)
    def unary(self, request, context):
        reply, code, msg = _guarded(self, method, lambda: self.auth.tenant_of(context.invocation_metadata()),
                                    lambda tenant: fn(self, _parsed(request, method), context, tenant))
        if code is not OK:
            context.abort(code, msg)
        return reply
    return unary


def _parsed(request, method: str):
    """The request, unless its bytes did not parse (`messages.lenient`)."""
    if request is MALFORMED:
        raise invalid(f"{method}: malformed request")
    return request


def call_as(servicer, method: str, request_type, body: bytes, tenant: str | None):
    """Run unary servicer method `method` on a serialized `request_type` for
    a caller already authenticated as `tenant`, outside gRPC (the same-host
    socket, cache_service/server/socket_server.py): the same status mapping, metrics
    and in-flight count as `rpc`. Returns (reply or None, code, message)."""
    def run(tenant: str | None):
        return getattr(type(servicer), method).__wrapped__(servicer, parse(request_type, body, method), None, tenant)
    return run_as(servicer, method, tenant, run)


def run_as(servicer, method: str, tenant: str | None, fn):
    """`call_as` for any callable: (fn(tenant), OK, "") or (None, code, message)."""
    return _guarded(servicer, method, lambda: tenant, fn)


def _guarded(servicer, method: str, tenant_of, body):
    """(reply, OK, "") of body(tenant_of()), or (None, code, message) of what it raised; counted and timed."""
    t0, tenant, code, msg = time.perf_counter(), None, OK, ""
    _track(servicer, +1)
    try:
        tenant = tenant_of()
        return body(tenant), code, msg
    except Exception as e:
        code, msg = status_of(e)
        _report(method, tenant, e, code, msg)
        return None, code, msg
    finally:
        _track(servicer, -1)
        servicer.metrics.observe(method, tenant, code, time.perf_counter() - t0)


def _track(servicer, delta: int) -> None:
    """Count RPCs in flight on the servicer (daemon stats, drain tests)."""
    with servicer.in_flight_lock:
        servicer.in_flight += delta
