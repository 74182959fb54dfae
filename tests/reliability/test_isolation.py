"""Isolation on a daemon with tokens: unauthenticated requests get nothing and
change nothing; another tenant's requests for the same hashes get misses."""
from __future__ import annotations

import grpc
import pytest

from cache_service.sessions.manifests import Session
from cache_service.protocol.messages import ns_to_pb
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from proto import tierkv_pb2_grpc as pb_grpc
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.reliability.conftest import cpu_disk_config, figure

pytestmark = pytest.mark.slow
TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef"}
METHODS = pb.DESCRIPTOR.services_by_name["TierKV"].methods


def call_every_method(stub, metadata, blocks: list) -> dict[str, grpc.StatusCode]:
    """Each TierKV method once, with a request that would act on `blocks` where
    it takes hashes; method name -> status code (OK when it answered)."""
    codes = {}
    for m in METHODS:
        req = getattr(pb, m.input_type.name)()
        if "hashes" in m.input_type.fields_by_name:
            req.hashes.extend(blocks)
        if "ns" in m.input_type.fields_by_name:
            req.ns.CopyFrom(ns_to_pb(NS))
        fn = getattr(stub, m.name)
        try:
            if m.client_streaming:
                fn(iter([req]), metadata=metadata, timeout=10)
            elif m.server_streaming:
                list(fn(req, metadata=metadata, timeout=10))
            else:
                fn(req, metadata=metadata, timeout=10)
            codes[m.name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            codes[m.name] = e.code()
    return codes


def intact(client, hs) -> bool:
    return all(p is not None and same(p, payload_for(h)) for p, h in zip(client.load(NS, hs), hs))


def test_unauthenticated_and_wrong_tenant_requests_get_nothing(daemons, tmp_path):
    (tmp_path / "tokens.txt").write_text("".join(f"{t} {n}\n" for n, t in TOKENS.items()))
    d = daemons(cpu_disk_config(tmp_path, 64 * OBJ), "--token-file", str(tmp_path / "tokens.txt"))
    d.start()
    hs = hashes(8)
    with GrpcClient(d.url(), token=TOKENS["acme"]) as acme, GrpcClient(d.url(), token=TOKENS["globex"]) as globex:
        # acme stores blocks and a session
        assert acme.store(NS, hs, [payload_for(h) for h in hs]) == 8
        acme.sessions.put(Session("plan", token_ids=list(range(32))), ns=NS, pin=True)
        # no token, a wrong token, a malformed header: every method refused, before touching anything
        stub = pb_grpc.TierKVStub(grpc.insecure_channel(d.address))
        refused = 0
        for md in ((), (("authorization", "Bearer not-a-known-token-000"),), (("authorization", TOKENS["acme"]),)):
            codes = call_every_method(stub, md, hs)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
            refused += len(codes)
        # the other tenant, holding a valid token: misses for acme's exact hashes, its deletes remove nothing
        assert globex.lookup(hs) == 0 and globex.load(NS, hs) == [None] * 8
        assert globex.delete(hs) == 0
        assert globex.sessions.list() == [] and globex.sessions.get("plan") is None
        assert not globex.sessions.delete("plan")
        # naming acme explicitly, or using acme's shared-memory attachment, is refused
        bearer = (("authorization", f"Bearer {TOKENS['globex']}"),)
        cross = {
            "Load": lambda: list(stub.Load(pb.LoadRequest(ns=ns_to_pb(NS.with_tenant("acme")), hashes=hs),
                                           metadata=bearer, timeout=10)),
            "ListSessions": lambda: stub.ListSessions(pb.ListSessionsRequest(tenant="acme"), metadata=bearer,
                                                      timeout=10),
        }
        if acme.transport == "shm":
            cross["LoadShm"] = lambda: stub.LoadShm(pb.ShmRequest(ns=ns_to_pb(NS), hashes=hs,
                                                                  attachment=acme._near.attachment),
                                                    metadata=bearer, timeout=10)
        for name, fn in cross.items():
            with pytest.raises(grpc.RpcError) as e:
                fn()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        # acme still has everything
        assert acme.lookup(hs) == 8 and intact(acme, hs) and acme.sessions.list() == ["plan"]
        blocks = acme.stats()["cpu"]["blocks"]
    figure("isolation", unauthenticated_refused=refused, methods=len(METHODS), cross_tenant_refused=len(cross),
           wrong_tenant_hits=0, owner_blocks_kept=blocks)
    assert blocks == 8
