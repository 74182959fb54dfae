"""DiskTier's slots over their lifetime: a slot written but never indexed, holes
left by deletes, a segment file cut short, and the older one-file-per-block
layout found on open."""
from __future__ import annotations

import errno
import os

import pytest
import torch
import xxhash

from tests.tiers.disk_writer_child import block_for, key_for
from tiers import disk_slots
from tiers.disk import DiskTier
from tiers.disk_geometry import PAGE, slot_size
from tiers.disk_slots import Segments

MB = 1 << 20


def same_size_keys(pool: int) -> list[bytes]:
    """Those of the first `pool` keys whose blocks are as large as the first one's (so they share a slot size)."""
    size = block_for(key_for(0, 0)).numel()
    return [k for k in (key_for(0, i) for i in range(pool)) if block_for(k).numel() == size]


def test_a_slot_written_but_never_indexed_is_free_after_a_crash(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    held, orphan, new = same_size_keys(64)[:3]
    tier.put_many([held], [block_for(held)])
    # A put that wrote its slot and died before its index commit.
    obj = memoryview(block_for(orphan).numpy())
    slot = tier.space.take(len(obj))
    tier.segments.write(orphan, obj, slot, 0)
    orphan_place = tier.segments.located(len(obj), slot)
    tier.close()
    reopened = DiskTier(tmp_path, 8 * MB)
    # The orphan is not a block; its slot is the next one handed out.
    assert reopened.keys() == [held] and reopened.get_many([orphan]) == [None]
    assert reopened.put_many([new], [block_for(new)]) == [True]
    assert reopened.location_of(new)[:2] == orphan_place
    assert torch.equal(reopened.get_many([new])[0], block_for(new))
    reopened.close()


def test_slots_deleted_before_a_reopen_are_handed_out_after_its_walk(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB, fsync=False)
    hs = same_size_keys(600)[:6]
    tier.put_many(hs[:4], [block_for(h) for h in hs[:4]])
    freed = tier.location_of(hs[1])
    tier.delete_many([hs[1]])
    tier.close()
    # Reopened: the sweep walks the index and finds the hole deleting hs[1] left.
    reopened = DiskTier(tmp_path, 8 * MB, fsync=False)
    assert reopened.swept.wait(30)
    reopened.put_many([hs[4]], [block_for(hs[4])])
    assert reopened.location_of(hs[4]) == freed
    # The next one goes past the last slot; every block reads back exact.
    reopened.put_many([hs[5]], [block_for(hs[5])])
    assert reopened.location_of(hs[5]) not in {reopened.location_of(h) for h in hs[:5]}
    got = reopened.get_many(hs)
    assert got[1] is None and all(torch.equal(g, block_for(h)) for g, h in zip(got, hs) if h != hs[1])
    reopened.close()


def test_the_sweep_drops_entries_whose_slot_lies_past_the_end_of_its_file(tmp_path):
    tier = DiskTier(tmp_path, 8 * MB)
    fine, gone, short = same_size_keys(64)[:3]
    for h in (fine, gone, short):
        tier.put_many([h], [block_for(h)])
    path, off, _ = tier.location_of(gone)
    tier.close()
    os.truncate(path, off + 10)  # the file cut short in gone's slot: gone and short lie past its end
    # Before the sweep gets to them, reading them is a miss, never wrong bytes.
    reopened = DiskTier(tmp_path, 8 * MB)
    assert reopened.get_many([gone, short])[1] is None or not reopened.swept.is_set()
    # The sweep drops what is left of them: only the intact block remains.
    assert reopened.swept.wait(30)
    assert reopened.keys() == [fine]
    assert reopened.location_of(short) is None
    assert reopened.stats.used_bytes == block_for(fine).numel() == 8 * MB - reopened.free_bytes()
    reopened.close()


def test_a_directory_of_the_one_file_per_block_layout_is_set_aside_and_removed(tmp_path):
    # What an earlier version left: data/<hash hex> files and their index.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / key_for(0, 0).hex()).write_bytes(b"x" * 100)
    (tmp_path / "index.lmdb").mkdir()
    tier = DiskTier(tmp_path, 8 * MB)
    # The tier starts empty in its own layout and works; the sweep removes the old one.
    assert tier.keys() == [] and tier.put_many([key_for(0, 0)], [block_for(key_for(0, 0))]) == [True]
    assert tier.swept.wait(30)
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob("*old-layout*"))
    tier.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_a_batch_of_slot_writes_in_one_call_writes_what_the_python_loop_writes(tmp_path, monkeypatch, in_c):
    # the C batch (built here) and the Python loop it replaces
    assert disk_slots.write_slots is not None, "C slot writer missing (pip install -e . needs a C compiler)"
    if not in_c:
        monkeypatch.setattr(disk_slots, "write_slots", None)
    hs = same_size_keys(64)[:5]
    objs = [block_for(h) for h in hs]
    datas = [memoryview(o.numpy()) for o in objs]
    # a batch of five into scattered slots, checksums computed on the way
    segs = Segments(tmp_path / "batch", sync=True)
    sums, files, err = segs.write_many(hs, objs, [4, 0, 9, 1, 2])
    assert err is None and sums == [xxhash.xxh3_64_intdigest(d) for d in datas] and len(files) == 1
    segs.sync(files)
    # byte for byte the files that one `write` per object makes
    ref = Segments(tmp_path / "one-by-one", sync=True)
    for h, d, s, c in zip(hs, datas, [4, 0, 9, 1, 2], sums):
        ref.write(h, d, s, c)
    for key in ref.ends():
        assert segs.path(key).read_bytes() == ref.path(key).read_bytes()
    # each slot reads back as its block
    for h, d, s, c in zip(hs, datas, [4, 0, 9, 1, 2], sums):
        buf = torch.empty(len(d), dtype=torch.uint8)
        assert segs.read(h, len(d), c, s, buf) and buf.numpy().tobytes() == bytes(d)
    segs.close()
    ref.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_a_slot_of_whole_pages_is_written_to_its_end_and_a_small_one_to_its_object(tmp_path, monkeypatch, in_c):
    # (a slot's last page written in part is read in by the kernel first when it is not cached)
    if not in_c:
        monkeypatch.setattr(disk_slots, "write_slots", None)
    segs = Segments(tmp_path, sync=True)
    for n in (20_000, 1_000):  # a slot of five pages; a small slot, sharing its pages with others
        slot = slot_size(n)
        hs = [bytes([i]) * 16 for i in range(3)]
        objs = [torch.full((n,), 7 + i, dtype=torch.uint8) for i in range(3)]
        segs.path((slot, 0)).write_bytes(b"\xee" * 3 * slot)  # the slots hold old bytes from end to end
        # new objects, shorter than the old ones
        sums, files, err = segs.write_many(hs, objs, [0, 1, 2])
        assert err is None and None not in sums and files == {(slot, 0)}
        raw = segs.path((slot, 0)).read_bytes()
        for s, o in enumerate(objs):
            body = raw[s * slot + 32:(s + 1) * slot]
            assert body[:n] == bytes(o.numpy())
            # past the object: zeros to a slot of whole pages' end; the old bytes in a small slot
            assert body[n:] == (bytes(slot - 32 - n) if slot % PAGE == 0 else b"\xee" * (slot - 32 - n))
    segs.close()


def test_a_batch_of_mixed_sizes_is_written_alike_in_c_and_in_python(tmp_path, monkeypatch):
    # One object with a slot of whole pages and one small one, over old bytes, by each path.
    hs, objs = [b"a" * 16, b"b" * 16], [torch.full((20_000,), 3, dtype=torch.uint8), torch.full((1_000,), 4, dtype=torch.uint8)]
    files = {}
    for path in ("c", "python"):
        if path == "python":
            monkeypatch.setattr(disk_slots, "write_slots", None)
        segs = Segments(tmp_path / path, sync=False)
        for o in objs:
            segs.path((slot_size(o.numel()), 0)).write_bytes(b"\xee" * 2 * slot_size(o.numel()))
        assert None not in segs.write_many(hs, objs, [1, 1])[0]
        files[path] = {key: segs.path(key).read_bytes() for key in segs.ends()}
        segs.close()
    # Byte for byte the same files.
    assert files["c"] == files["python"] and len(files["c"]) == 2


@pytest.mark.parametrize("in_c", [True, False])
def test_a_batch_whose_file_cannot_grow_writes_nothing_there_and_says_why(tmp_path, monkeypatch, in_c):
    if not in_c:
        monkeypatch.setattr(disk_slots, "write_slots", None)
    segs = Segments(tmp_path, sync=True)
    hs = same_size_keys(64)[:3]
    datas = [block_for(h) for h in hs]
    small = slot_size(datas[0].numel())

    # the disk is full past the first segment's first slot
    def allocate_one_slot(fd, off, length):
        if off + length > small:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.ftruncate(fd, max(os.fstat(fd).st_size, off + length))

    monkeypatch.setattr(os, "posix_fallocate", allocate_one_slot)
    sums, files, err = segs.write_many(hs, datas, [0, 1, 2])
    # the file could not grow to its furthest slot: no object written, the error returned
    assert sums == [None, None, None] and files == set() and err.errno == errno.ENOSPC
    # one object that fits is written
    sums, files, err = segs.write_many(hs[:1], datas[:1], [0])
    assert err is None and sums[0] is not None and len(files) == 1
    segs.close()


def test_a_failed_slot_write_in_the_c_batch_is_reported_and_the_others_still_land(tmp_path):
    from tiers.host_copy import XXH3
    h = same_size_keys(64)[0]
    data = memoryview(block_for(h).numpy())
    # one fd that cannot be written (read-only) between two that can
    (tmp_path / "ro").write_bytes(b"")
    ro, rw = os.open(tmp_path / "ro", os.O_RDONLY), os.open(tmp_path / "rw", os.O_RDWR | os.O_CREAT)
    far = slot_size(len(data))
    sums, code = disk_slots.write_slots([rw, ro, rw], [0, 0, far], [h] * 3, [data] * 3, XXH3)
    # the failure is None with its errno; the others hold header and object
    assert sums[1] is None and code == errno.EBADF and sums[0] == sums[2] == xxhash.xxh3_64_intdigest(data)
    assert os.pread(rw, 4, far) == b"TKVS" and os.pread(rw, len(data), far + 32) == bytes(data)
    os.close(ro)
    os.close(rw)


def test_a_batch_whose_sync_fails_fails_as_a_whole_in_c_and_in_python(tmp_path, monkeypatch):
    from tiers.host_copy import XXH3
    h = same_size_keys(64)[0]
    data = memoryview(block_for(h).numpy())
    # /dev/null takes the writes and refuses the sync (EINVAL), after a file that syncs
    rw, null = os.open(tmp_path / "rw", os.O_RDWR | os.O_CREAT), os.open("/dev/null", os.O_WRONLY)
    sums, code = disk_slots.write_slots([rw, null], [0, 0], [h] * 2, [data] * 2, XXH3, True)
    # nothing of the batch is durable: every slot fails with the sync's errno
    assert sums == [None, None] and code == errno.EINVAL
    # the same batch without the sync writes both
    sums, code = disk_slots.write_slots([rw, null], [0, 0], [h] * 2, [data] * 2, XXH3, False)
    assert code == 0 and None not in sums
    os.close(rw)
    os.close(null)
    # the Python reference fails the whole batch alike
    segs = Segments(tmp_path / "py", sync=True)
    monkeypatch.setattr(disk_slots, "write_slots", None)
    monkeypatch.setattr(os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "sync failed")))
    sums, _, err = segs.write_many([h], [block_for(h)], [0], durable=True)
    assert sums == [None] and err.errno == errno.EIO
    segs.close()
