"""The standalone cache daemon: a grpc server around one TieredStore.

    tierkv serve --config tierkv.toml [--listen 127.0.0.1:7600] [--metrics-port 9600]
                 [--token-file tokens.txt] [--tls-cert C --tls-key K [--tls-client-ca CA]]

Services: ``tierkv.v1.TierKV`` (cache_service/server/servicer.py), the standard
``grpc.health.v1.Health`` (``""`` and ``tierkv.v1.TierKV`` report SERVING
until shutdown begins) and server reflection, so ``grpcurl`` works without
the proto file. Auth and TLS: cache_service/server/auth.py. Same-host clients call
the shared-memory calls on a Unix socket beside it (cache_service/server/socket_server.py);
streaming clients move bytes on a TCP data path (cache_service/server/data_path.py).

Shutdown (SIGTERM or SIGINT) drains: health turns NOT_SERVING, the socket servers
and the gRPC server stop accepting calls, in-flight calls get ``grace_s`` to finish
(and handlers whose calls were cancelled then, up to 10 s more to leave the store), then
``store.close()`` flushes background writes (up to the store's
``flush_timeout_s``) and closes the tiers, so the disk index is committed
and closed cleanly. A restart on the same config sees every block that
reached the disk tier.
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cache_service.protocol.messages import lenient
from cache_service.protocol.tls import server_credentials
from cache_service.server.auth import AuthInterceptor, Authenticator
from cache_service.config import Config, ServerConfig, default_cache_dir
from cache_service.server.socket_server import DaemonSocketServer
from cache_service.factory import open_sessions, open_store
from cache_service.protocol.streaming import StoreMessage
from cache_service.server.data_path import HANDLERS
from cache_service.server.metrics import Metrics
from cache_service.server.pool import HANDLERS as POOL_HANDLERS
from cache_service.server.servicer import TierKVServicer
from cache_service.sessions.manifests import Manifests, SessionManager, SessionStore
from cache_service.server.attachments import Attachments
from cache_service.store.tiered_store import TieredStore
from proto import tierkv_pb2 as pb
from tiers.types import TierKVError

log = logging.getLogger("tierkv.server")
SERVICE = pb.DESCRIPTOR.services_by_name["TierKV"].full_name
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
HANDLER_DRAIN_S = 10.0  # at least this long for handlers whose calls a stop cancelled to leave the store
SHARED_FLUSH_S = 60.0  # how long a shared session's save waits for its blocks to reach the lower tiers


class DaemonError(TierKVError):
    """The daemon cannot start (address in use, bad TLS files, ...)."""


class Daemon:
    """A running (after `start`) gRPC daemon that owns `store` and closes it on `stop`;
    `settings` is the config's [server] section."""

    def __init__(self, store: TieredStore, settings: ServerConfig | None = None,
                 manifests: Manifests | None = None) -> None:
        """`manifests`: where sessions live (`serve` passes the config's: shared
        through Redis and S3 when it has a [directory]); by default files in
        the settings' `sessions_dir`."""
        self.store, self.settings = store, settings or ServerConfig()
        s = self.settings
        self.auth = Authenticator.from_file(s.token_file)
        self.metrics = Metrics()
        self.attachments = Attachments(Path(s.shm_dir))
        shared = manifests is not None and not isinstance(manifests, SessionStore)
        manifests = manifests or SessionStore(s.sessions_dir or default_cache_dir() / "store")
        # a manifest other nodes read must not name blocks still on their way down
        sessions = SessionManager(store, manifests, durable_timeout_s=SHARED_FLUSH_S if shared else None)
        self.servicer = TierKVServicer(store, s, self.auth, self.metrics, self.attachments, sessions)
        self.metrics.watch_store(store.stats, self.servicer.daemon_stats)
        self.health = health.HealthServicer()
        options = [("grpc.max_receive_message_length", s.max_message_bytes),
                   ("grpc.max_send_message_length", s.max_message_bytes),
                   ("grpc.so_reuseport", 0)]
        reject = lambda method, code: self.metrics.observe(method.rsplit("/", 1)[-1], None, code, None)  # noqa: E731
        self.server = grpc.server(ThreadPoolExecutor(s.workers, thread_name_prefix="tierkv-rpc"),
                                  interceptors=[AuthInterceptor(self.auth, reject)], options=options,
                                  maximum_concurrent_rpcs=s.max_concurrent_rpcs)
        handlers = tierkv_handlers(self.servicer)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.server.add_registered_method_handlers(SERVICE, handlers)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), self.server)
        self.port = self._bind()
        self.same_host_server: DaemonSocketServer | None = None
        self.data_path_server: DaemonSocketServer | None = None
        self.metrics_port: int | None = None
        self._stopped = threading.Event()

    def _bind(self) -> int:
        s = self.settings
        try:
            if s.tls_cert:
                port = self.server.add_secure_port(s.listen, server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca))
            else:
                port = self.server.add_insecure_port(s.listen)
        except RuntimeError as e:
            raise DaemonError(f"cannot listen on {s.listen}: {e}") from None
        if not port:
            raise DaemonError(f"cannot listen on {s.listen} (address in use?)")
        return port

    @property
    def address(self) -> str:
        """host:port clients connect to (the bound port, when listening on :0)."""
        return f"{self.settings.listen.rpartition(':')[0]}:{self.port}"

    def start(self) -> "Daemon":
        s = self.settings
        if s.metrics_port is not None:
            self.metrics_port = self.metrics.serve(s.metrics_port, s.metrics_host)
        self.server.start()
        try:  # the shared-memory calls' fast path; without it clients call through gRPC
            self.same_host_server = DaemonSocketServer(self.servicer, bulk=POOL_HANDLERS).start()
            self.servicer.socket_path = self.same_host_server.path
        except OSError as e:
            log.warning("no same-host socket (%s); shared-memory calls go through gRPC", e)
        self.data_path_server = self._open_data_path()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        fields = {"listen": self.address, "tls": bool(s.tls_cert), "auth": self.auth.enabled,
                  "metrics_port": self.metrics_port, "tiers": ",".join(t.name for t in self.store.tiers)}
        log.info("serving", extra={"fields": fields})
        if not self.auth.enabled and not _loopback(s.listen.rpartition(":")[0]):
            log.warning("serving on %s without auth: anyone who can reach it may read and write this cache "
                        "(set server.token_file)", s.listen)
        return self

    def _open_data_path(self) -> DaemonSocketServer | None:
        """The streamed data path (cache_service/server/data_path.py) on the listen host, unless off or TLS."""
        s = self.settings
        if s.data_port is None or s.tls_cert:
            return None
        host = s.listen.rpartition(":")[0].strip("[]")
        try:
            listener = socket.create_server((host, s.data_port), family=socket.AF_INET6 if ":" in host
                                            else socket.AF_INET)
        except OSError as e:
            log.warning("no data path on %s:%s (%s); streaming clients use gRPC", host, s.data_port, e)
            return None
        server = DaemonSocketServer(self.servicer, listener=listener, bulk=HANDLERS).start()
        self.servicer.data_port = listener.getsockname()[1]
        return server

    def stop(self, grace_s: float | None = None) -> None:
        """Drain and shut down (idempotent): see the module doc."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.settings.grace_s if grace_s is None else grace_s
        log.info("draining", extra={"fields": {"grace_s": grace}})
        self.health.enter_graceful_shutdown()
        self.servicer.socket_path, self.servicer.data_port = "", 0
        # the three servers stop accepting at once and share one grace
        closing = [threading.Thread(target=srv.close, args=(grace,), name="tierkv-drain", daemon=True)
                   for srv in (self.same_host_server, self.data_path_server) if srv is not None]
        for t in closing:
            t.start()
        stopped = self.server.stop(grace)
        for t in closing:
            t.join()
        stopped.wait()
        self._drain_handlers(max(grace, HANDLER_DRAIN_S))
        self.servicer.stalls.close()
        self.attachments.close()
        close_manifests = getattr(self.servicer.sessions.manifests, "close", None)
        if close_manifests is not None:  # a directory of their own (Redis), or uploads still waiting
            close_manifests()
        self.store.close()  # flushes background writes first
        self.metrics.close()
        log.info("stopped")

    def _drain_handlers(self, timeout_s: float) -> None:
        """Wait for handlers still running: grpc's stop cancels their calls but
        not their threads, which may still be in the store closed next."""
        deadline = time.monotonic() + timeout_s
        while self.servicer.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.servicer.in_flight > 0:
            log.warning("stopping with %d calls still in the store", self.servicer.in_flight)

    def wait(self, stop: threading.Event, reap_every_s: float = 30.0) -> None:
        """Block until `stop` is set, reaping idle shared-memory attachments.

        Wakes every quarter second: a signal that the kernel hands to one of
        grpc's threads only runs its Python handler once the main thread wakes.
        """
        next_reap = time.monotonic() + reap_every_s
        while not stop.wait(0.25):
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + reap_every_s
                n = self.attachments.reap()
                if n:
                    log.info("reaped idle shared-memory segments", extra={"fields": {"count": n}})


def _loopback(host: str) -> bool:
    """Whether a listen host is this machine only."""
    host = host.strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tierkv_handlers(servicer: TierKVServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The TierKV method handlers: the generated messages' (de)serializers,
    except on the streamed data path, whose messages the servicer frames and
    reads itself (cache_service/protocol/streaming.py): Load yields serialized
    LoadChunks, Store gets each StoreChunk as a `StoreMessage`."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["TierKV"].methods:
        request, reply = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = kinds[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name), request_deserializer=lenient(request),
            response_serializer=reply.SerializeToString)
    handlers["Load"] = grpc.unary_stream_rpc_method_handler(servicer.Load, request_deserializer=lenient(pb.LoadRequest))
    handlers["Store"] = grpc.stream_unary_rpc_method_handler(servicer.Store, request_deserializer=StoreMessage,
                                                             response_serializer=pb.StoreReply.SerializeToString)
    return handlers


def sessions_root(cfg: Config) -> str:
    """Where manifests live by default: beside the disk tier, as for ``local://``."""
    return cfg.tiers.disk.path if cfg.tiers.disk is not None else str(default_cache_dir() / "store")


def tune_process() -> None:
    """Process-wide settings for a daemon whose hot path is copying blocks.

    - One intra-op thread: calls run concurrently on the RPC workers, so the
      parallelism is across requests; OpenMP teams spinning next to those
      workers made single copies slower, not faster (unless OMP_NUM_THREADS
      asks for more).
    - glibc malloc keeps freed block-sized buffers for reuse (fixed mmap and
      trim thresholds): the store allocates a buffer per block it encodes or
      reads, and fresh pages cost a fault each, which measured 3-7x slower
      loads and stores than recycled ones.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def share_cpu_pool(cfg: Config) -> None:
    """Resolve ``[tiers.cpu] shared = "auto"``: yes when the CPU tier is the
    top tier (same-host clients then store straight into it,
    cache_service/server/pool.py) and not page-locked, else no."""
    cpu, hbm = cfg.tiers.cpu, cfg.tiers.hbm
    top = hbm is None or not (hbm.device or torch.cuda.is_available())  # open_store drops an hbm tier it cannot use
    if cpu is not None and cpu.shared == "auto":
        cpu.shared = "yes" if top and cpu.pin != "yes" else "no"


def open_daemon(cfg: Config) -> Daemon:
    """The daemon of `cfg`, not started: its store, and its sessions (shared
    through Redis and S3 when the config has a [directory], as for local://)."""
    settings = cfg.server
    if settings.sessions_dir is None:
        settings.sessions_dir = sessions_root(cfg)
    share_cpu_pool(cfg)
    store = open_store(cfg)
    try:
        return Daemon(store, settings, open_sessions(cfg, settings.sessions_dir, store))
    except BaseException:
        store.close()
        raise


def serve(cfg: Config) -> int:
    """Run the daemon of `cfg` (its [server] section) until SIGTERM/SIGINT, then drain; returns the exit code."""
    tune_process()
    daemon = open_daemon(cfg)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        daemon.start()
        daemon.wait(stop)
    finally:
        daemon.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
