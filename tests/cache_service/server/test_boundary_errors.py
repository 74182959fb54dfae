"""Bad input at the daemon's boundary, found in review: each gets a clear
error where it used to abort a process, answer INTERNAL, flood the log, or
say something else went wrong."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import grpc
import pytest

from cache_service.server.daemon import DaemonError
from connectors.grpc.client import GrpcClient
from proto import tierkv_pb2 as pb
from tests.cache_service.server.test_auth import needs_openssl, self_signed
from tests.cache_service.server.test_servicer import code_of, raw, start  # noqa: F401 (fixture)
from tiers.types import ConfigError, TierKVError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_a_client_certificate_without_its_key_is_an_error_not_an_abort(tmp_path):
    # In a process of its own: grpc aborted the whole process (a vLLM worker) on this URL.
    code = ("from connectors.grpc.client import GrpcClient\n"
            "try:\n    GrpcClient('grpc://127.0.0.1:1?tls=1&cert=/nonexistent.pem')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ConfigError" in out.stdout and "come together" in out.stdout, out


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "soon"])
@pytest.mark.parametrize("name", ["timeout", "lookup_timeout"])
def test_a_timeout_that_could_never_be_met_is_refused_in_the_url(name, timeout):
    with pytest.raises(TierKVError, match=name):
        GrpcClient(f"grpc://127.0.0.1:1?{name}={timeout}")


@needs_openssl
def test_a_certificate_and_a_key_that_do_not_go_together_say_so(start, tmp_path):
    (cert, _), (_, other_key) = self_signed(tmp_path, "a"), self_signed(tmp_path, "b")
    with pytest.raises((ConfigError, DaemonError), match="do not go together"):
        start(listen="localhost:0", tls_cert=cert, tls_key=other_key)


def test_request_bytes_that_do_not_parse_are_invalid_arguments(start):
    d = start()
    channel = grpc.insecure_channel(d.address)
    for method in ("Lookup", "Hello", "SaveSession", "Delete", "Pin"):
        # Bytes no protobuf message parses from (a truncated varint): refused as the caller's error.
        call = channel.unary_unary(f"/tierkv.v1.TierKV/{method}")
        code, why = code_of(lambda: call(b"\x08\xff\xff"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in why, (method, code, why)
    load = channel.unary_stream("/tierkv.v1.TierKV/Load")
    code, why = code_of(lambda: list(load(b"\x08\xff\xff")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_invalid_id_is_not_echoed_whole(start):
    d = start()
    stub = raw(d)
    # An id of 100,000 characters: the answer names it, shortened (it went whole into the reply and the log).
    code, why = code_of(lambda: stub.SaveSession(pb.SaveSessionRequest(session=pb.Session(session_id="x/" * 50_000))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(why) < 300 and "100000 characters" in why


def test_serving_beyond_this_machine_without_auth_is_warned_about(start, caplog):
    with caplog.at_level(logging.WARNING, logger="tierkv.server"):
        start(listen="127.0.0.1:0")
        assert not any("without auth" in r.getMessage() for r in caplog.records)
        start(listen="0.0.0.0:0")
    assert any("without auth" in r.getMessage() for r in caplog.records)


def test_a_tenant_keeps_at_most_max_sessions_manifests(start):
    d = start(max_sessions=3)
    stub = raw(d)

    def save(sid: str):
        return stub.SaveSession(pb.SaveSessionRequest(session=pb.Session(session_id=sid, messages_json="[]")))
    # Saves refused for their ids take no place in the quota.
    for bad in ("../a", "b/../b", "x\n", "y\n"):
        assert code_of(lambda: save(bad))[0] == grpc.StatusCode.INVALID_ARGUMENT
    # Three sessions are saved; a fourth new one is refused, while the three can still be rewritten.
    for sid in ("a", "b", "c"):
        save(sid)
    code, why = code_of(lambda: save("d"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in why
    save("a")
    # Once one is deleted, a new one fits again.
    stub.DeleteSession(pb.DeleteSessionRequest(session_id="b"))
    save("d")
    assert sorted(stub.ListSessions(pb.ListSessionsRequest()).session_ids) == ["a", "c", "d"]


@needs_openssl
def test_an_encrypted_tls_key_is_refused_without_asking_for_a_passphrase(start, tmp_path):
    cert, key = self_signed(tmp_path, "c", "-passout", "pass:secret")
    # OpenSSL would ask for the passphrase on the terminal (a daemon start blocked there): a clear error instead.
    with pytest.raises(ConfigError, match="encrypted"):
        start(listen="localhost:0", tls_cert=cert, tls_key=key)
