"""The daemon's auth and tenants: tokens, tenant isolation, TLS, token files."""
from __future__ import annotations

import os
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service.blocks.keys import tenant_keys
from cache_service.server.auth import load_tokens
from cache_service.sessions.manifests import Session
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.store.store_helpers import NS, hashes
from tests.cache_service.server.test_servicer import (P, TOKENS, bearer, code_of, intact, put, raw, scrape,  # noqa: F401
                                             start, url)
from tiers.types import ConfigError, TierUnavailableError

Code = grpc.StatusCode


def test_tenants_never_share_blocks_or_sessions(start):
    d = start(auth=True, metrics_port=0)
    hs = hashes(6)
    with GrpcClient(url(d), token=TOKENS["acme"]) as acme, GrpcClient(url(d), token=TOKENS["globex"]) as globex:
        assert acme.hello.tenant == "acme" and acme.hello.auth_required
        put(acme, hs)
        acme.sessions.put(Session("plan", token_ids=[1, 2, 3]))
        # the same hashes address nothing for another tenant, and do not disturb acme's copies
        assert globex.lookup(hs) == 0 and globex.load(NS, hs) == [None] * 6
        assert globex.sessions.list() == [] and globex.sessions.get("plan") is None
        assert acme.lookup(hs) == 6 and intact(acme, hs)
        assert acme.stats()["cpu"]["corrupt"] == 0
        # keys are salted server-side: an unauthenticated view of the store misses the raw hashes
        assert d.store.lookup(hs) == 0 and d.store.lookup(tenant_keys("acme", hs)) == 6
        # naming another tenant is refused
        evil = pb.LoadRequest(ns=ns_to_pb(NS.with_tenant("acme")), hashes=hs)
        code, msg = code_of(lambda: list(raw(d).Load(evil, metadata=bearer("globex"))))
        assert code == Code.PERMISSION_DENIED and "tenant" in msg
    m = scrape(d)
    assert m[("tierkv_tenant_bytes_total", (("direction", "store"), ("tenant", "acme")))] == 6 * P
    assert ("tierkv_tenant_bytes_total", (("direction", "store"), ("tenant", "globex"))) not in m


def test_missing_or_wrong_tokens_are_refused(start):
    d = start(auth=True)
    stub, req = raw(d), pb.LookupRequest(hashes=hashes(1))
    assert code_of(lambda: stub.Lookup(req))[0] == Code.UNAUTHENTICATED
    assert code_of(lambda: stub.Lookup(req, metadata=(("authorization", "Bearer nope-nope-nope-nope"),))) == \
        (Code.UNAUTHENTICATED, "unknown token")
    assert code_of(lambda: stub.Lookup(req, metadata=(("authorization", TOKENS["acme"]),)))[0] == Code.UNAUTHENTICATED
    assert stub.Lookup(req, metadata=bearer("acme")).blocks == 0
    # the client turns a refused token into TierUnavailableError at connect time
    with pytest.raises(TierUnavailableError, match="UNAUTHENTICATED"):
        GrpcClient(url(d), token="wrong-token-0123456789")
    # health needs no token (probes); reflection does
    ch = grpc.insecure_channel(d.address)
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tierkv.v1.TierKV"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    assert code_of(lambda: list(refl.ServerReflectionInfo(iter([ask]))))[0] == Code.UNAUTHENTICATED
    names = {s.name for r in refl.ServerReflectionInfo(iter([ask]), metadata=bearer("acme"))
             for s in r.list_services_response.service}
    assert "tierkv.v1.TierKV" in names


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None and os.environ.get("CI") != "true",
                                   reason="needs openssl to make a certificate (under CI its absence fails)")


def self_signed(tmp_path, name: str, *options: str) -> tuple[str, str]:
    """(certificate, key) PEM paths of a self-signed certificate for localhost;
    `options`: more `openssl req` flags (default `-nodes`: an unencrypted key)."""
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1", "-subj", "/CN=localhost",
                    *(options or ("-nodes",)), "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@needs_openssl
def test_tls_with_a_self_signed_certificate(start, tmp_path):
    # a certificate for localhost, trusted by the client as its CA
    cert, key = self_signed(tmp_path, "cert", "-nodes", "-addext", "subjectAltName=DNS:localhost")
    d = start(listen="localhost:0", tls_cert=str(cert), tls_key=str(key))
    with GrpcClient(f"grpc://localhost:{d.port}?tls=1&ca={cert}") as c:
        assert put(c, hashes(2)) == 2 and intact(c, hashes(2))
    # the plaintext data path is not opened next to TLS: streamed bytes stay inside it
    assert d.data_path_server is None and d.servicer.data_port == 0
    with GrpcClient(f"grpc://localhost:{d.port}?tls=1&ca={cert}&transport=stream") as c:
        assert c._data_path is None and put(c, hashes(3)) == 1 and intact(c, hashes(3))
    # a plaintext client cannot talk to it
    with pytest.raises(TierUnavailableError):
        GrpcClient(f"grpc://localhost:{d.port}", connect_timeout_s=1)
    # mutual TLS: without a client certificate the handshake fails; with one it works
    m = start(listen="localhost:0", tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(cert))
    with pytest.raises(TierUnavailableError):
        GrpcClient(f"grpc://localhost:{m.port}?tls=1&ca={cert}", connect_timeout_s=1)
    with GrpcClient(f"grpc://localhost:{m.port}?tls=1&ca={cert}&cert={cert}&key={key}") as c:
        assert c.lookup(hashes(1)) == 0


def test_token_files_in_both_formats(tmp_path):
    (tmp_path / "t.txt").write_text("# comment\nabcdefghijklmnop0 acme\n\nqrstuvwxyz0123456 globex  # trailing\n")
    (tmp_path / "t.toml").write_text('[tokens]\n"abcdefghijklmnop0" = "acme"\n')
    assert sorted(load_tokens(tmp_path / "t.txt").values()) == ["acme", "globex"]
    assert list(load_tokens(tmp_path / "t.toml").values()) == ["acme"]
    for bad, why in [("short acme\n", "at least"), ("abcdefghijklmnop0\n", "expected"),
                     ("abcdefghijklmnop0 ../etc\n", "tenant")]:
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(ConfigError, match=why):
            load_tokens(tmp_path / "bad.txt")
