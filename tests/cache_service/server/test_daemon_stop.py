"""The daemon's drain: the store is closed only once the handlers still in it have left."""
from __future__ import annotations

import threading
import time

from cache_service.config import ServerConfig
from cache_service.server.daemon import Daemon
from connectors.grpc.client import GrpcClient
from tests.cache_service.server.test_servicer import url
from tests.cache_service.store.store_helpers import hashes, make_store


def test_stop_closes_the_store_after_the_handlers_still_in_it(tmp_path):
    d = Daemon(make_store(tmp_path / "store", cpu_blocks=16, disk_blocks=None),
               ServerConfig(listen="127.0.0.1:0", sessions_dir=str(tmp_path))).start()
    events, inside = [], threading.Event()
    lookup, close = d.store.lookup, d.store.close

    def slow_lookup(hs):  # a call that outlives the grace: grpc cancels it, its thread goes on in the store
        inside.set()
        time.sleep(1.0)
        events.append("lookup returned")
        return lookup(hs)

    def closing():
        events.append("store closed")
        close()

    d.store.lookup, d.store.close = slow_lookup, closing
    client = GrpcClient(url(d))
    caller = threading.Thread(target=client.lookup, args=(hashes(4),))
    caller.start()
    assert inside.wait(10)
    # a stop with a short grace waits for the handler to leave the store before closing it
    d.stop(grace_s=0.2)
    assert events == ["lookup returned", "store closed"]
    caller.join(10)
    client.close()
