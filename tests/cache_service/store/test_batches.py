"""The store given an engine's gathered blocks as one tensor, over real tiers."""
import pytest
import torch

from tests.cache_service.store.store_helpers import NS, hashes, make_store, payload_for, same


def test_the_store_takes_a_batch_tensor_and_skips_rows_it_holds(tmp_path):
    # block 1 of 4 is stored first; the batch stores the other three, and all four load back
    store = make_store(tmp_path, disk_blocks=None)
    hs = hashes(4)
    batch = torch.stack([payload_for(h) for h in hs])
    assert store.store(NS, hs[1:2], batch[1:2]) == 1
    assert store.store(NS, hs, batch) == 3
    got = store.load(NS, hs)
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(got, hs))
    # a batch whose length differs from the hashes is refused, storing nothing
    with pytest.raises(ValueError, match="payloads"):
        store.store(NS, hashes(3, 10), batch)
    assert store.lookup(hashes(3, 10)) == 0
    store.close()


def test_blocks_a_lower_tier_holds_are_not_written_to_it_again(tmp_path, monkeypatch):
    # 32 blocks through a 16-block CPU tier over a disk: the first 16 are on the disk alone now
    store = make_store(tmp_path, cpu_blocks=16, disk_blocks=64)
    queued = []  # what the store hands the disk's writer
    submit = store._placement.submit
    monkeypatch.setattr(store._placement, "submit", lambda i, items, *a, **k: (
        queued.extend(h for h, _ in items) if i == 1 else None, submit(i, items, *a, **k))[1])
    hs = hashes(32)
    batch = torch.stack([payload_for(h) for h in hs])
    for a in (0, 16):
        store.store(NS, hs[a:a + 16], batch[a:a + 16])
    assert store.flush(30)
    assert not any(store.tiers[0].contains_many(hs[:16])) and all(store.tiers[1].contains_many(hs))
    written, queued[:] = store.stats()["disk"]["bytes_in"], []
    # stored again, they go back into the CPU tier and its other 16 are evicted: the disk holds those, so
    # they are not queued for it; the 16 stored again are (the disk rechecks its copies) but not written again
    assert store.store(NS, hs[:16], batch[:16]) == 16
    assert store.flush(30)
    assert not any(store.tiers[0].contains_many(hs[16:])) and sorted(queued) == sorted(hs[:16])
    assert store.stats()["disk"]["bytes_in"] == written
    assert all(g is not None and same(g, payload_for(h)) for g, h in zip(store.load(NS, hs), hs))
    store.close()
