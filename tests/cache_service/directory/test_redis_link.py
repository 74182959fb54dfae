"""The Redis link's outage state machine against a Redis that hangs: a real
socket that accepts connections and never answers (as a stopped or wedged
server does), reached through redis-py's own clients. No caller waits on it
past the first failure: one probe at a time tries again, never the engine's
lookups; a cluster client whose build hangs is not built again by every
caller queued behind it."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from cache_service.directory.redis_directory import DirectoryStats
from cache_service.directory.redis_link import Link, make_client


@pytest.fixture
def hung():
    """(host, port) of a listener that accepts (the kernel's backlog) and never replies."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()


def callers(link: Link, n: int, seconds: float) -> None:
    """n engine threads calling through the link for `seconds`."""
    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            link.call_or(lambda r: r.get("k"), "get", None)
            time.sleep(0.01)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_after_the_first_failure_callers_skip_and_only_a_probe_tries_again(hung):
    stats = DirectoryStats()
    link = Link(lambda: make_client(f"redis://{hung[0]}:{hung[1]}/0", (), 0.3), stats, max_backoff_s=0.5)
    # Eight callers for three seconds, through several backoffs.
    callers(link, 8, 3.0)
    # The requests out when Redis hung failed; every later caller was answered at once.
    assert stats.errors <= 8 and stats.skipped > 100
    # A probe (the directory's own thread) does try again, one at a time.
    time.sleep(link.retry_in() + 0.01)
    assert link.call_or(lambda r: r.get("k"), "heartbeat", None, probe=True) is None
    assert stats.errors <= 9
    link.close()


def test_a_cluster_client_whose_build_hangs_is_built_once_per_backoff(hung):
    stats = DirectoryStats()
    link = Link(lambda: make_client("", [hung], 0.3), stats, max_backoff_s=5.0)
    # Eight callers arrive while the first one builds the cluster client (it reads the slot map: it hangs).
    callers(link, 8, 0.5)
    # One build failed; the callers queued behind it did not build again.
    assert stats.errors == 1
    link.close()
