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

from cache_service.sessions import SessionError
from cache_service.wire import RequestError
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
                yield from fn(self, request, context, tenant)
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
        t0, tenant, code, msg = time.perf_counter(), None, OK, ""
        _track(self, +1)
        try:
            tenant = self.auth.tenant_of(context.invocation_metadata())
            return fn(self, request, context, tenant)
        except Exception as e:
            code, msg = status_of(e)
            _report(method, tenant, e, code, msg)
        finally:
            _track(self, -1)
            self.metrics.observe(method, tenant, code, time.perf_counter() - t0)
        context.abort(code, msg)
    return unary


def _track(servicer, delta: int) -> None:
    """Count RPCs in flight on the servicer (daemon stats, drain tests)."""
    with servicer.in_flight_lock:
        servicer.in_flight += delta
