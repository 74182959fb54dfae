"""The S3 tier through outages (moto's server, stopped and started; real
RGW runs in tests/integration/test_s3_tier.py): what counts as S3 being
down, how long it is left alone, deletes S3 did not take, and loads that
try once."""
from __future__ import annotations

import time
import uuid

import pytest
from botocore.exceptions import ClientError

import tiers.s3_io as s3_io
from tests.tiers.test_s3_unit import MB, Moto, block, keys
from tiers.s3 import S3Tier


@pytest.fixture(scope="module")
def moto():
    server = Moto()
    yield server
    server.stop()


def tier_on(moto, bucket: str, **kw) -> S3Tier:
    kw = dict(endpoint_url=moto.url, access_key="k", secret_key="s", retries=0, retry_after_s=0.2) | kw
    return S3Tier(bucket, capacity_bytes=64 * MB, **kw)


def holding_one(moto, **kw) -> tuple[S3Tier, bytes]:
    """A tier on a fresh bucket, and the one block it holds."""
    tier = tier_on(moto, f"tkv-{uuid.uuid4().hex[:16]}", **kw)
    a = keys(1)[0]
    assert tier.put_many([a], [block(a)]) == [True]
    return tier, a


def error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_an_http_5xx_is_an_outage_whatever_its_error_code_says():
    # S3 answers 500 with the code InternalError (as RGW and AWS do): down, like a 503 SlowDown or a 429.
    assert s3_io.looks_down(error(500, "InternalError")) and s3_io.looks_down(error(503, "SlowDown"))
    assert s3_io.looks_down(error(429, "TooManyRequests"))
    # A 404 or a 403 is about the request, not the service.
    assert not s3_io.looks_down(error(404, "NoSuchKey")) and not s3_io.looks_down(error(403, "AccessDenied"))


def test_the_pause_doubles_while_s3_answers_nothing_and_starts_over_after_an_answer(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(s3_io.time, "monotonic", lambda: now[0])
    outage = s3_io.Outage(retry_after_s=2.0)
    # S3 hangs: the first request fails, and S3 is left alone for 2 s.
    outage.trip()
    assert not outage.over()
    # The request sent as the pause ended fails only after its timeouts (30 s later), S3 having answered
    # nothing meanwhile: the pause doubles, not resets.
    now[0] += 2.0 + 30.0
    outage.trip()
    now[0] += 2.0
    assert not outage.over()
    now[0] += 2.0
    assert outage.over()
    # S3 answers again; a failure a while later is a new outage: 2 s.
    outage.answered()
    now[0] += 30.0
    outage.trip()
    now[0] += 2.01
    assert outage.over()


def test_one_connection_reset_on_a_load_is_that_loads_miss_not_an_outage(moto):
    from botocore.exceptions import ConnectionClosedError

    tier = tier_on(moto, f"tkv-{uuid.uuid4().hex[:16]}", retry_after_s=30.0)
    a, b = keys(2)
    assert tier.put_many([a], [block(a)]) == [True]
    real = tier._reader.get_object

    def reset_once(**kw):
        tier._reader.get_object = real
        raise ConnectionClosedError(endpoint_url=moto.url)
    tier._reader.get_object = reset_once
    # The load whose connection was reset misses; S3 is not left alone for it: the next load and put go through.
    assert tier.get_many([a]) == [None] and tier.available()
    assert tier.get_many([a])[0] is not None and tier.put_many([b], [block(b)]) == [True]
    tier.close()


def test_an_endpoint_that_drops_every_connection_is_an_outage_after_a_few(moto):
    from botocore.exceptions import ConnectionClosedError

    tier = tier_on(moto, f"tkv-{uuid.uuid4().hex[:16]}", retry_after_s=30.0)
    hs = keys(5)
    tier.note_namespace(bytes(block(hs[0])[8:24].tolist()))  # loads of blocks of this namespace ask S3

    def dropped(**kw):  # a proxy whose S3 is gone: it accepts each connection and closes it
        raise ConnectionClosedError(endpoint_url=moto.url)
    tier._reader.get_object = dropped
    # The first drops are misses; a few in a row with no answer between, and S3 is left alone.
    for h in hs[:s3_io.DROPS_TO_TRIP - 1]:
        assert tier.get_many([h]) == [None] and tier.available()
    assert tier.get_many([hs[-1]]) == [None] and not tier.available()
    tier.close()


def test_deletes_sent_again_go_a_few_batches_per_tick(moto):
    tier = tier_on(moto, f"tkv-{uuid.uuid4().hex[:16]}")
    tier._undeleted.add(f"tierkv/x/{i:08d}" for i in range(10_000))
    # One tick sends a few batches and leaves the rest to the next ones: the writer's uploads are not held up.
    tier.tick()
    assert len(tier._undeleted) == 10_000 - 4 * s3_io.DELETE_BATCH
    while len(tier._undeleted):
        tier.tick()
    tier.close()


def test_a_delete_s3_did_not_take_is_sent_once_it_answers(moto):
    bucket = f"tkv-{uuid.uuid4().hex[:16]}"
    tier = tier_on(moto, bucket)
    hs = keys(4)
    assert tier.put_many(hs, [block(h) for h in hs]) == [True] * 4
    # S3 is down while the blocks are deleted: forgotten here at once, still in the bucket.
    moto.stop()
    try:
        assert tier.delete_many(hs) == 4 and tier.contains_many(hs) == [False] * 4
    finally:
        moto.start()
    # Once S3 answers, the store's writer tick sends the deletes: another node finds none of the blocks.
    deadline = time.monotonic() + 20
    while len(tier._undeleted) and time.monotonic() < deadline:
        time.sleep(0.3)
        tier.tick()
    other = tier_on(moto, bucket)
    other.note_namespace(bytes(block(hs[0])[8:24].tolist()))
    assert other.get_many(hs) == [None] * 4
    other.close()
    tier.close()


def test_a_block_stored_again_after_a_failed_delete_keeps_its_new_object(moto):
    bucket = f"tkv-{uuid.uuid4().hex[:16]}"
    tier = tier_on(moto, bucket)
    [h] = keys(1)
    assert tier.put_many([h], [block(h)]) == [True]
    moto.stop()
    try:
        tier.delete_many([h])
    finally:
        moto.start()
    # Stored again once S3 answers: the delete left over is not sent after it.
    deadline = time.monotonic() + 20
    while tier.put_many([h], [block(h)]) != [True] and time.monotonic() < deadline:
        time.sleep(0.3)
    tier.tick()
    other = tier_on(moto, bucket)
    assert other.contains_many([h]) == [True]
    other.close()
    tier.close()


def test_loads_try_once_and_writes_retry(moto):
    tier = tier_on(moto, f"tkv-{uuid.uuid4().hex[:16]}", retries=2)
    # A load that fails is a miss the engine recomputes: waiting out retries of an S3 that hangs costs more.
    assert tier._reader.meta.config.retries["total_max_attempts"] == 1
    assert tier._client.meta.config.retries["total_max_attempts"] == 3
    tier.close()


def test_loads_leave_an_s3_gone_silent_to_the_writers_probe(moto, monkeypatch):
    import threading

    from botocore.exceptions import ReadTimeoutError

    monkeypatch.setattr("tiers.s3.UNTICKED_S", 0.3)
    tier, a = holding_one(moto, retry_after_s=0.2)
    tier.tick()  # the store's writer ticks the tier about once a second
    asked = []
    real_get, real_head = tier._reader.get_object, tier._reader.head_bucket

    def silent(**kw):  # a black hole: every request waits out its read timeout (0.5 s here)
        asked.append(kw)
        time.sleep(0.5)
        raise ReadTimeoutError(endpoint_url=moto.url)
    tier._reader.get_object = tier._reader.head_bucket = silent
    # The first load finds S3 silent: a miss, and S3 is left alone.
    assert tier.get_many([a]) == [None] and not tier.available() and len(asked) == 1
    # The pause ends: the writer's tick probes (and waits out the timeout); loads meanwhile miss at once.
    time.sleep(0.25)
    probe = threading.Thread(target=tier.tick)
    probe.start()
    time.sleep(0.4)
    assert tier.get_many([a]) == [None] and len(asked) == 2
    probe.join()
    assert not tier.available()
    # The next pause ends: still no load goes to S3 until a tick's probe saw it answer.
    while not tier.available():
        time.sleep(0.02)
    assert tier.get_many([a]) == [None] and len(asked) == 2
    # S3 answers again (a 403 to the HEAD is an answer too): the tick sees it, and loads go back to S3.
    tier._reader.get_object = real_get
    tier._reader.head_bucket = lambda **kw: (_ for _ in ()).throw(error(403, "AccessDenied"))
    tier.tick()
    assert tier.get_many([a])[0] is not None
    tier._reader.head_bucket = real_head
    tier.close()


def test_a_tier_no_writer_ticks_probes_with_its_loads(moto, monkeypatch):
    monkeypatch.setattr("tiers.s3.UNTICKED_S", 0.3)
    tier, a = holding_one(moto, retry_after_s=0.2)
    # Left alone after a failure, and no tick came since the pause ended: a load finds out S3 is back.
    tier._outage.trip()
    time.sleep(0.2 + 0.35)
    assert tier.get_many([a])[0] is not None
    tier.close()
