"""S3Tier where its view of the bucket could drift from the bucket: an
outage at open (the bucket is listed once it answers, so the blocks it held
are counted and served) and a GET that misses while a put of the same block
lands (the fresh upload stays known). Against moto's server, as test_s3_unit."""
from __future__ import annotations

import time

import torch
from botocore.exceptions import ClientError

from tests.tiers.test_s3_unit import MB, block, keys, make_tier, moto  # noqa: F401 (fixtures)
from tiers.s3 import S3Tier


def test_a_bucket_unreachable_at_open_is_listed_once_it_answers(make_tier, moto):
    first = make_tier()
    held = keys(3)
    assert first.put_many(held, [block(h) for h in held]) == [True] * 3
    # A node opens while S3 is down: it starts empty.
    moto.stop()
    try:
        later = S3Tier(make_tier.bucket, capacity_bytes=64 * MB, endpoint_url=moto.url, access_key="k",
                       secret_key="s", retries=0, retry_after_s=0.5)
        assert later.contains_many(held) == [False] * 3 and later.stats.blocks == 0
    finally:
        moto.start()
    # Once S3 answers, the writer's tick (the store's writer ticks its tiers every second) checks and
    # lists the bucket: the blocks are known, counted and served.
    time.sleep(0.6)
    later.tick()
    later.note_namespace(bytes(block(held[0])[8:24].tolist()))
    got = later.get_many(held[:1])
    assert got[0] is not None and torch.equal(got[0], block(held[0]))
    assert later.contains_many(held) == [True] * 3
    assert later.stats.blocks == 3 and later.stats.used_bytes == 3 * block(held[0]).numel()
    assert later.keys() and set(later.keys()) == set(held)
    later.close()


def test_a_miss_answered_after_a_put_of_the_block_landed_keeps_the_upload(make_tier):
    tier = make_tier()
    [h] = keys(1)
    tier.note_namespace(bytes(block(h)[8:24].tolist()))  # a namespace in use: an unknown block is looked for
    real = tier._reader.get_object

    def get_racing_a_put(**kw):
        # The GET is answered 404; before the answer is seen, a put of the same block lands.
        tier._reader.get_object = real
        try:
            return real(**kw)
        except ClientError:
            assert tier.put_many([h], [block(h)]) == [True]
            raise

    tier._reader.get_object = get_racing_a_put
    assert tier.get_many([h]) == [None]
    # The miss was the GET's; the block written meanwhile is still known and counted.
    assert tier.contains_many([h]) == [True] and tier.stats.blocks == 1
    assert torch.equal(tier.get_many([h])[0], block(h))
