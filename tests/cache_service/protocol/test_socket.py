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
        ("RESERVE", 6), ("COMMIT", 7), ("LOOKUP", 8), ("HOLD", 9), ("LET_GO", 10), ("PIN_SESSION", 11),
        ("PREFETCH", 12)]
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


def _tcp_server(monkeypatch, hello=_hello, max_connections: int = 8):
    """A TCP server whose HELLO and call deadlines are short (1 s)."""
    from cache_service.protocol import socket_server
    monkeypatch.setattr(socket_server, "HELLO_TIMEOUT_S", 1.0)
    monkeypatch.setattr(socket_server, "CALL_TIMEOUT_S", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    server = FramedServer(listener, hello, _dispatch, max_connections=max_connections).start()
    return server, ("127.0.0.1", listener.getsockname()[1])


def _hung_up(raw: socket.socket, every_s: float, for_s: float) -> bool:
    """Send a byte every `every_s`; whether the server hung up within `for_s`."""
    import time
    end = time.monotonic() + for_s
    raw.settimeout(every_s)
    while time.monotonic() < end:
        try:
            raw.send(b"x")
            if raw.recv(1) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def test_a_hello_trickled_a_byte_at_a_time_is_cut_off(monkeypatch):
    server, address = _tcp_server(monkeypatch)
    try:
        raw = socket.create_connection(address)
        # A HELLO of 4,000 bytes sent a byte every 0.3 s kept a per-read timeout alive for 20 minutes;
        # the HELLO now has 1 s in all.
        raw.sendall(frames.FRAME.pack(4000, Op.HELLO))
        assert _hung_up(raw, 0.3, 6.0)
        raw.close()
        # The server still answers.
        c = SocketClient(address, "sesame", 5.0)
        assert LookupBody.held(c.ask(Op.LOOKUP, LookupBody.request([b"h" * 16]))) == 1 + len("ali")
        c.close()
    finally:
        server.close(grace_s=1.0)


def test_a_frame_whose_body_never_comes_ends_its_connection(monkeypatch):
    server, address = _tcp_server(monkeypatch)
    try:
        c = SocketClient(address, "sesame", 5.0)
        # A header announcing 16 MiB, then nothing: the connection ends once the call's time is up.
        c._sock.sendall(frames.FRAME.pack(16 << 20, Op.LOOKUP))
        c._sock.settimeout(10)
        assert c._sock.recv(1) == b""
        c.close()
    finally:
        server.close(grace_s=1.0)


def test_one_tenant_cannot_take_every_connection(monkeypatch):
    server, address = _tcp_server(monkeypatch, hello=lambda body: body.decode(), max_connections=4)
    try:
        # acme holds three of four; a fourth of its own is refused, globex still gets in.
        acme = [SocketClient(address, "acme", 5.0) for _ in range(3)]
        with pytest.raises(SocketCallError) as e:
            SocketClient(address, "acme", 5.0)
        assert e.value.code() == Code.RESOURCE_EXHAUSTED
        import time
        deadline = time.monotonic() + 5
        while len(server._conns) > 3 and time.monotonic() < deadline:  # the refused one is let go
            time.sleep(0.01)
        globex = SocketClient(address, "globex", 5.0)
        for c in acme + [globex]:
            c.close()
    finally:
        server.close(grace_s=1.0)


def test_connections_trickling_hellos_give_way_to_a_newcomer(monkeypatch):
    import time
    server, address = _tcp_server(monkeypatch, max_connections=4)
    try:
        # Silent connections, as many as the server takes; each newer one pushes the oldest out.
        silent = [socket.create_connection(address) for _ in range(4)]
        time.sleep(0.3)  # the pushed-out connections' threads end
        # A client arrives (well within the silent ones' HELLO time) and is served.
        c = SocketClient(address, "sesame", 5.0)
        assert LookupBody.held(c.ask(Op.LOOKUP, LookupBody.request([b"h" * 16]))) == 1 + len("ali")
        c.close()
        for s in silent:
            s.close()
    finally:
        server.close(grace_s=1.0)


def test_a_connection_that_cannot_get_a_thread_is_refused_and_accepting_goes_on(monkeypatch):
    server, address = _tcp_server(monkeypatch)
    start, failed = threading.Thread.start, []

    def start_once_failing(self):
        if self.name.endswith("-conn") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    try:
        with pytest.raises((SocketCallError, OSError)):
            SocketClient(address, "sesame", 5.0)
        # The next client is served, and closing the server does not trip over the thread never started.
        c = SocketClient(address, "sesame", 5.0)
        assert LookupBody.held(c.ask(Op.LOOKUP, LookupBody.request([b"h" * 16]))) == 1 + len("ali")
        c.close()
    finally:
        server.close(grace_s=1.0)
    assert failed
