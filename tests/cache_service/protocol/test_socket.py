"""The framed-socket server and client every socket of tierkv uses (the
daemon's same-host socket and TCP data path, the vLLM lookups)."""
import os
import shutil
import socket
import tempfile
import threading

import grpc
import pytest

from cache_service.protocol import frames
from cache_service.protocol.messages import RequestError
from cache_service.protocol.ops import SPECS, LookupBody, Op
from cache_service.protocol.socket_client import SocketCallError, SocketClient
from cache_service.protocol.socket_server import FramedServer, abstract_listener, private_unix_listener

Code = grpc.StatusCode


def test_the_op_codes_are_the_wires():
    # the numbers travel: never renumber; every op has request and reply types
    assert [(op.name, int(op)) for op in Op] == [
        ("HELLO", 0), ("LOAD_SHM", 1), ("STORE_SHM", 2), ("LOAD", 3), ("STORE", 4), ("MAP_POOL", 5),
        ("RESERVE", 6), ("COMMIT", 7), ("LOOKUP", 8), ("HOLD", 9), ("LET_GO", 10)]
    assert set(SPECS) == set(Op)
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert LookupBody.hashes(LookupBody.request(hashes)) == hashes and LookupBody.held(LookupBody.reply(7)) == 7
    with pytest.raises(ValueError):
        LookupBody.hashes(b"short")


def _hello(body: bytes):
    if body != b"sesame":
        raise RequestError(Code.UNAUTHENTICATED, "wrong token")
    return "ali"


def _dispatch(conn, op, body, peer):
    if op == Op.LOOKUP:
        return Code.OK, LookupBody.reply(len(LookupBody.hashes(body)) + len(peer)), []
    if op == Op.LOAD:  # raw bytes follow the reply
        return Code.OK, b"", [b"0123456789"]
    conn.unread = True
    return Code.UNIMPLEMENTED, f"no op {op}".encode(), []


@pytest.fixture(params=["private", "abstract", "tcp"])
def served(request):
    where = None
    if request.param == "private":
        listener, where = private_unix_listener()
        address = str(where / "sock")
    elif request.param == "abstract":
        address = f"\0tierkv-test-{threading.get_ident()}-{id(request)}"
        listener = abstract_listener(address)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        address = ("127.0.0.1", listener.getsockname()[1])
    server = FramedServer(listener, _hello, _dispatch, max_connections=2, owned_dir=where).start()
    yield server, address
    server.close(grace_s=1.0)
    assert where is None or not where.exists()


def test_calls_answer_in_order_and_raw_bytes_follow(served):
    server, address = served
    c = SocketClient(address, "sesame", 5.0)
    assert LookupBody.held(c.ask(Op.LOOKUP, LookupBody.request([b"h" * 16] * 4))) == 4 + len("ali")
    c.ask(Op.LOAD, b"")
    got = bytearray(10)
    c.recv_into(memoryview(got))
    assert got == b"0123456789" and server.calls == 2
    # an unknown op is answered, then the connection ends (bytes of its own may follow it)
    with pytest.raises(SocketCallError) as e:
        c.ask(Op.STORE, b"")
    assert e.value.code() == Code.UNIMPLEMENTED
    with pytest.raises(SocketCallError) as e:
        c.ask(Op.LOOKUP, b"")
    assert e.value.code() == Code.UNAVAILABLE
    c.close()


def test_hello_is_checked_first(served):
    _, address = served
    with pytest.raises(SocketCallError) as e:
        SocketClient(address, "open up", 5.0)
    assert e.value.code() == Code.UNAUTHENTICATED
    # a first frame that is not HELLO is refused
    raw = socket.socket(socket.AF_INET if isinstance(address, tuple) else socket.AF_UNIX)
    raw.connect(address)
    frames.send(raw, Op.LOOKUP, b"")
    assert frames.receive(raw)[0] == Code.FAILED_PRECONDITION.value[0]
    raw.close()


def test_connections_past_the_limit_are_closed(served):
    _, address = served
    a, b = SocketClient(address, "sesame", 5.0), SocketClient(address, "sesame", 5.0)
    with pytest.raises((SocketCallError, OSError)):
        SocketClient(address, "sesame", 5.0)
    a.close()
    b.close()


def test_socket_directories_of_dead_processes_are_removed(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # a process that ended without removing its socket directory, and one still alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = tmp_path / f"tierkv-socket-{dead.stdout.strip()}-x1", tmp_path / f"tierkv-socket-{os.getpid()}-x2"
    for d in (stale, live):
        d.mkdir()
        (d / "sock").touch()
    # the next listener removes the dead one's and leaves the live one's
    listener, where = private_unix_listener()
    try:
        assert not stale.exists() and live.exists() and where.name.startswith(f"tierkv-socket-{os.getpid()}-")
    finally:
        listener.close()
        shutil.rmtree(where)
