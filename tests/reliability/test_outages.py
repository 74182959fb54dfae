"""Redis, then the S3 gateway, stopped in the middle of a load on a store
cpu -> disk -> s3 with a Redis directory: no error reaches the caller (the
engine's side of the store API), no wrong block is served, once each
service is back the store uses it again within seconds, and the blocks
stored while S3 was down reach it then."""
from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from cache_service.config import load_config
from cache_service.factory import open_store
from tests.cache_service.store.store_helpers import NS, OBJ, hashes, payload_for, same
from tests.reliability.conftest import figure, servers

pytestmark = pytest.mark.slow


class Load:
    """A background client: stores new blocks, loads earlier ones, checks every byte.
    Bounded in operations and stopped by `stop()`."""

    def __init__(self, store, max_ops: int = 200_000) -> None:
        self.store, self.max_ops = store, max_ops
        self.ops = self.errors = self.wrong = self.misses = 0
        self.first_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng, written = random.Random(3), []
        for n in range(self.max_ops):
            if self._stop.is_set():
                break
            try:
                new = hashes(2, start=100_000 + 8 * n)
                self.store.store(NS, new, [payload_for(h) for h in new])
                written += new
                pick = rng.sample(written, min(4, len(written)))
                self.store.lookup(pick[:1])
                for g, h in zip(self.store.load(NS, pick), pick):
                    self.misses += g is None
                    self.wrong += g is not None and not same(g, payload_for(h))
            except Exception as e:  # anything here would have reached the engine
                self.errors += 1
                self.first_error = self.first_error or e
            self.ops += 1
            time.sleep(0.01)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self.stop()

    def progressed(self, seconds: float) -> int:
        """Operations completed during the next `seconds`."""
        before = self.ops
        time.sleep(seconds)
        return self.ops - before


def until(check, limit_s: float = 30.0, every_s: float = 0.25) -> float | None:
    """Seconds until `check()` is true (polling), None if it never was within limit_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if check():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


def test_redis_and_s3_outages_mid_load(tmp_path, s3_server, s3_bucket, redis_url):
    prefix = f"rel-out-{uuid.uuid4().hex[:8]}"
    tiers = {"cpu": {"capacity": 32 * OBJ, "slot_bytes": OBJ},
             "disk": {"path": str(tmp_path / "disk"), "capacity": 16384 * OBJ, "fsync": False},
             "s3": {"bucket": s3_bucket, "prefix": prefix, "endpoint": s3_server.endpoint, "capacity": "1GiB",
                    "access_key": s3_server.access_key, "secret_key": s3_server.secret_key, "retries": 0,
                    "connect_timeout": 1.0, "read_timeout": 3.0}}
    directory = {"url": redis_url, "socket_timeout_s": 0.5, "max_backoff_s": 1.0}
    cfg = load_config(env={}, overrides={"tiers": tiers, "directory": directory, "store": {"queue_depth": 64}})
    probe = iter(range(10**6))

    def fresh_blocks_reach(where: str) -> bool:
        """Store two new blocks; are they in S3 (where="s3") or in the directory ("redis")?"""
        hs = hashes(2, start=900_000 + 8 * next(probe))
        store.store(NS, hs, [payload_for(h) for h in hs])
        store.flush(10)
        if where == "s3":
            stored_while_down.extend(hs)
            return store.tiers[2].contains_many(hs) == [True, True]
        return store.directory.in_s3(hs) == [True, True]

    stored_while_down: list = []

    recovered, during, late = {}, {}, {}
    with open_store(cfg) as store, Load(store) as load:
        try:
            assert until(lambda: fresh_blocks_reach("redis"), 20) is not None  # all up: the directory learns
            for name, stop, start, where in (("redis", "redis", "redis", "redis"), ("s3", "rgw", "s3", "s3")):
                # stop the service under load: the load goes on
                assert servers("stop", stop, timeout=120).returncode == 0
                during[name] = load.progressed(2.0)
                assert not fresh_blocks_reach(where)
                refused = list(stored_while_down)
                assert servers("start", start, timeout=300).returncode == 0
                # back: fresh blocks reach it again, and S3 gets what it refused while down
                recovered[name] = until(lambda: fresh_blocks_reach(where), 45)
                if name == "s3":
                    late["s3"] = until(lambda: store.tiers[2].contains_many(refused) == [True] * len(refused), 45)
                    late["deferred"] = store.stats()["s3"]["deferred"]
        finally:
            servers("start", "redis", timeout=300)
            servers("start", "s3", timeout=300)
        after = load.progressed(1.0)
    figure("outages", ops=load.ops, errors=load.errors, wrong=load.wrong, misses=load.misses,
           ops_during_redis_outage=during.get("redis"), ops_during_s3_outage=during.get("s3"),
           redis_back_s=recovered.get("redis"), s3_back_s=recovered.get("s3"),
           s3_refused_written_s=late.get("s3"), s3_deferred=late.get("deferred"), ops_after=after)
    assert load.errors == 0, repr(load.first_error)
    assert load.wrong == 0
    assert all(n > 0 for n in during.values()) and after > 0
    assert None not in recovered.values(), recovered
    assert late.get("s3") is not None, "blocks stored while S3 was down never reached it"
