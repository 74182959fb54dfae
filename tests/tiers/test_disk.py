"""DiskTier on real segment files and a real lmdb index: round trips,
reopening in another process, damaged slots, recovery on open, crashes
mid-write (a filesystem that runs out of space: test_disk_enospc.py)."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.tiers.disk_writer_child import block_for, key_for
from tiers.disk import DiskTier
from tiers.types import CapacityError, TierKVError, TierUnavailableError

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("disk_writer_child.py")
MB = 1 << 20


def keys(n: int, seed: int = 0):
    return [key_for(seed, i) for i in range(n)]


def child(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(CHILD), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def stored_bytes(tier: DiskTier, h) -> bytes:
    """The object bytes of `h` as they sit in its segment file."""
    path, off, size = tier.location_of(h)
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(size)


def overwrite(tier: DiskTier, h, data: bytes, at: int = 0) -> None:
    path, off, _ = tier.location_of(h)
    with open(path, "r+b") as f:
        f.seek(off + at)
        f.write(data)


def test_round_trip_on_disk_layout(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    hs = keys(5)
    assert tier.put_many(hs, [block_for(h) for h in hs]) == [True] * 5
    # Objects sit in slots of segment files under segments/, each in a slot of its own.
    places = [tier.location_of(h) for h in hs]
    assert all(p[0].parent == tmp_path / "segments" for p in places) and len(set(places)) == 5
    assert all(stored_bytes(tier, h) == block_for(h).numpy().tobytes() for h in hs)
    # Reads are byte-exact; an unknown hash is a miss.
    got = tier.get_many(hs + keys(1, seed=1))
    assert all(torch.equal(g, block_for(h)) for g, h in zip(got, hs)) and got[-1] is None
    # Putting held blocks again (even twice in one batch) writes nothing.
    assert tier.put_many([hs[0], hs[0]], [block_for(hs[0])] * 2) == [True, True]
    total = sum(block_for(h).numel() for h in hs)
    s = tier.stats
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out, s.blocks, s.used_bytes) == (5, 1, total, total, 5, total)
    assert tier.free_bytes() == 8 * MB - total
    tier.close()


def test_reopen_in_a_new_process_finds_every_block(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    hs = keys(20)
    tier.put_many(hs, [block_for(h) for h in hs])
    tier.delete_many(hs[:3])
    tier.close()
    # Another interpreter opens the same directory and checks every block byte by byte.
    proc = child("check", str(tmp_path), str(8 * MB))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["17", "ok"]


def test_last_access_order_survives_reopen(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    a, b, c = keys(3)
    tier.put_many([a, b, c], [block_for(h) for h in (a, b, c)])
    # Reading a makes it the most recently used; the order is flushed on close.
    tier.get_many([a])
    assert tier.keys() == [b, c, a]
    tier.close()
    reopened = DiskTier(tmp_path, 8 * MB)
    assert reopened.keys() == [b, c, a]
    reopened.close()


def _truncate(tier, a, b):
    path, off, _ = tier.location_of(a)  # a sits in the last slot of the file
    os.truncate(path, off + 100)


def _flip_bit(tier, a, b):
    overwrite(tier, a, bytes([stored_bytes(tier, a)[777] ^ 0x10]), at=777)


def _swap(tier, a, b):
    # b's slot (header and all) copied over a's, then b's erased: a's slot now holds b
    (pa, oa, _), (pb, ob, n) = tier.location_of(a), tier.location_of(b)
    with open(pb, "r+b") as f:
        f.seek(ob - 32)
        slot = f.read(32 + n)
        f.seek(ob - 32)
        f.write(bytes(len(slot)))
    with open(pa, "r+b") as f:
        f.seek(oa - 32)
        f.write(slot)


def _erase(tier, a, b):
    overwrite(tier, a, bytes(len(stored_bytes(tier, a))), at=-32)  # header and object zeroed


@pytest.mark.parametrize("damage", [_truncate, _flip_bit, _swap, _erase])
def test_damaged_slot_is_a_counted_quarantined_miss(tmp_path, damage):
    tier = DiskTier(tmp_path, 8 * MB)
    a, b, c = [k for k in keys(64) if block_for(k).numel() == block_for(keys(1)[0]).numel()][:3]
    for h in (b, c, a):
        tier.put_many([h], [block_for(h)])
    damage(tier, a, b)
    on_disk = stored_bytes(tier, a)
    # The damaged block is never returned; intact neighbours are.
    got = dict(zip((a, b, c), tier.get_many([a, b, c])))
    assert got[a] is None and torch.equal(got[c], block_for(c))
    lost = [a] if damage is not _swap else [a, b]
    assert (got[b] is None) == (damage is _swap)
    # Counted as corrupt misses and dropped from the index (also across a reopen).
    assert tier.stats.corrupt == len(lost) and tier.stats.misses == len(lost)
    assert tier.contains_many(lost) == [False] * len(lost)
    assert tier.stats.used_bytes == sum(block_for(h).numel() for h in (a, b, c) if h not in lost)
    # What was in a's slot is kept aside in quarantine, byte for byte.
    quarantined = [p.read_bytes() for p in (tmp_path / "quarantine").iterdir()]
    assert on_disk in quarantined and len(quarantined) == len(lost)
    tier.close()
    reopened = DiskTier(tmp_path, 8 * MB)
    assert sorted(reopened.keys()) == sorted(h for h in (a, b, c) if h not in lost)
    reopened.close()


def test_quarantine_on_the_stores_request(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    a, b = keys(2)
    tier.put_many([a, b], [block_for(a), block_for(b)])
    # The store found a's object unusable (say, a header for another layout).
    tier.quarantine([a, keys(1, seed=3)[0]])
    assert tier.contains_many([a, b]) == [False, True] and tier.location_of(a) is None
    assert [p.read_bytes() for p in (tmp_path / "quarantine").iterdir()] == [block_for(a).numpy().tobytes()]
    # The store counts that one; the tier's own counter is for its own checksum failures.
    assert tier.stats.corrupt == 0 and tier.stats.blocks == 1
    tier.close()
    reopened = DiskTier(tmp_path, 8 * MB)
    assert reopened.keys() == [b]
    reopened.close()


def test_capacity_is_respected(tmp_path):
    hs = keys(5)
    objs = [block_for(h)[:4096] for h in hs]
    tier = DiskTier(tmp_path, 3 * 4096 + 100)
    # Three fit; the rest are refused (not raised) until something is deleted.
    assert tier.put_many(hs, objs) == [True] * 3 + [False] * 2
    assert tier.free_bytes() == 100 and tier.stats.used_bytes == 3 * 4096
    assert tier.delete_many(hs[:1]) == 1
    assert tier.put_many(hs[3:], objs[3:]) == [True, False]
    # An object larger than the whole tier can never fit.
    with pytest.raises(CapacityError):
        tier.put_many(keys(1, seed=9), [torch.zeros(3 * 4096 + 101, dtype=torch.uint8)])
    assert sorted(tier.keys()) == sorted(hs[1:4])
    tier.close()


def test_one_process_owns_a_directory(tmp_path):
    tier = DiskTier(tmp_path, MB)
    with pytest.raises(TierUnavailableError):
        DiskTier(tmp_path, MB)
    tier.close()
    with pytest.raises(TierKVError):
        tier.get_many(keys(1))
    DiskTier(tmp_path, MB).close()  # released by close


def test_reads_racing_deletes_and_rewrites_are_exact_and_not_corrupt(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB, fsync=False)
    hs = keys(6)
    stop = threading.Event()
    wrong: list[str] = []

    def churn() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            h = rng.choice(hs)
            tier.put_many([h], [block_for(h)])
            tier.delete_many([rng.choice(hs)])

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(300):
            for h, obj in zip(hs, tier.get_many(hs)):
                if obj is not None and not torch.equal(obj, block_for(h)):
                    wrong.append(h.hex())
    finally:
        stop.set()
        writer.join(timeout=60)
    # A file deleted under a reader is a plain miss, never a corrupt block.
    assert wrong == [] and tier.stats.corrupt == 0
    assert list((tmp_path / "quarantine").iterdir()) == []
    tier.close()


def test_block_rewritten_during_a_read_is_a_plain_miss(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * MB)
    h = keys(1)[0]
    tier.put_many([h], [block_for(h)])
    real_read = tier._read
    rewritten = torch.zeros(1000, dtype=torch.uint8)

    def read_after_race(h_, e, buf):
        # Another thread deletes the block and stores different bytes under it first.
        tier.delete_many([h_])
        tier.put_many([h_], [rewritten])
        return real_read(h_, e, buf)

    monkeypatch.setattr(tier, "_read", read_after_race)
    # The read sees a file that no longer matches what it looked up: a miss, not corruption.
    assert tier.get_many([h]) == [None]
    assert tier.stats.corrupt == 0 and list((tmp_path / "quarantine").iterdir()) == []
    # The new block is untouched.
    monkeypatch.undo()
    assert torch.equal(tier.get_many([h])[0], rewritten)
    tier.close()


def _wait_ready(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready and proc.stdout.readline().strip() == "ready", proc.stderr.read() if not ready else ""


@pytest.mark.slow
def test_sigkill_mid_write_never_leaves_a_torn_block(tmp_path):
    rng = random.Random(1234)
    capacity = 3 * MB  # small enough that writers also evict and delete
    deadline = time.monotonic() + 20
    rounds = seen = 0
    while rounds < 10 and (rounds < 4 or time.monotonic() < deadline):
        # A writer puts, evicts and deletes blocks until killed at a random moment.
        proc = child("write", str(tmp_path), str(capacity), str(rounds))
        _wait_ready(proc)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, "writer ended before it was killed"
        # Reopening serves at once; every indexed block reads back byte-exact, each from a slot of its own.
        tier = DiskTier(tmp_path, capacity)
        assert tier.swept.wait(30)
        held = tier.keys()
        got = tier.get_many(held)
        assert all(g is not None and torch.equal(g, block_for(h)) for g, h in zip(got, held))
        assert tier.stats.corrupt == 0 and tier.stats.used_bytes <= capacity
        assert len({tier.location_of(h) for h in held}) == len(held)
        tier.close()
        rounds += 1
        seen += len(held)
    assert rounds >= 4 and seen > 0, "no writer got any block in before its kill"


def test_lookups_from_the_presence_table_agree_with_the_index(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB, fsync=False)
    hs = keys(60)
    tier.put_many(hs[:40], [block_for(h) for h in hs[:40]])
    tier.close()
    # Reopened: the sweep walks the index and fills the presence table; lookups then use it.
    tier = DiskTier(tmp_path, 8 * MB, fsync=False)
    assert tier.swept.wait(30) and tier.presence_ready
    # Puts, deletes and a quarantine after that keep table and index in step.
    tier.put_many(hs[40:], [block_for(h) for h in hs[40:]])
    tier.delete_many(hs[:10])
    tier.quarantine(hs[10:12])
    want = [i >= 12 for i in range(60)]
    assert tier.contains_many(hs) == tier._present(hs) == want
    assert tier.contains_many(keys(20, seed=5)) == [False] * 20
    tier.close()
