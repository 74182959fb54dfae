"""The client ends share only cache_service/protocol/ with the daemon, and
their parts get functions from `GrpcClient`, not the client itself."""
import ast
from pathlib import Path

from cache_service.sessions.manifests import SessionError
from connectors.grpc.same_host import SameHost
from connectors.grpc.sessions import RemoteSessions
from proto import tierkv_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_connectors_import_no_server_module_and_the_server_no_connector():
    for path in (ROOT / "connectors").rglob("*.py"):
        assert not any(m.startswith("cache_service.server") for m in _imports(path)), path
    for path in (ROOT / "cache_service" / "server").rglob("*.py"):
        assert not any(m.startswith("connectors") for m in _imports(path)), path


def test_remote_sessions_use_an_admin_function():
    calls = []

    def admin(name, request, invalid):
        calls.append((name, invalid))
        return pb.ListSessionsReply(session_ids=["a", "b"])

    assert RemoteSessions(admin).list() == ["a", "b"] and calls == [("ListSessions", SessionError)]


def test_same_host_reports_its_transport_through_a_callback():
    seen = []
    near = SameHost(lambda *a, **k: None, lambda *a: 0, seen.append, None, 1.0, nbytes=0)
    assert near.segment() is None and seen == []  # no segment asked for: nothing to report
    near.close()
