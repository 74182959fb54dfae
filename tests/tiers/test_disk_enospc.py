"""DiskTier on a filesystem that runs out of space (real ENOSPC on a small
tmpfs, or lmdb's commit refused): puts are refused, nothing is damaged, and
the index keeps room for its own writes."""
from __future__ import annotations

import errno
import os

import lmdb
import numpy as np
import torch

from tests.tiers.disk_writer_child import block_for, key_for
from tests.tiers.tmpfs import mount_tmpfs, require_tmpfs, unmount
from tiers.disk import DiskTier

MB = 1 << 20


def _fill_until_refused(tier: DiskTier, seed: int) -> tuple[list, list]:
    """Put 64 KiB blocks until the filesystem refuses one; (stored, refused)."""
    stored, refused = [], []
    for i in range(64):
        h = key_for(seed, i)
        obj = torch.from_numpy(np.resize(block_for(h).numpy(), 64 * 1024))
        (stored if tier.put_many([h], [obj]) == [True] else refused).append((h, obj))
        if refused:
            break
    return stored, refused


def test_full_filesystem_refuses_puts_without_damage(tmp_path, monkeypatch):
    root = tmp_path / "small"
    mounted = mount_tmpfs(root, "1m")
    if not mounted:
        # Fallback (not root / mount not permitted): segment space past 1 MiB is refused with ENOSPC.
        real_allocate, allocated = os.posix_fallocate, [0]

        def allocate_until_full(fd, offset, length):
            if allocated[0] + length > MB:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            allocated[0] += length
            return real_allocate(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", allocate_until_full)
    try:
        # The tier believes it has 64 MiB; the filesystem under it holds 1 MiB.
        tier = DiskTier(root, 64 * MB)
        stored, refused = _fill_until_refused(tier, seed=5)
        assert stored and refused, "the filesystem never filled up"
        assert tier.stats.errors == 0
        assert tier.contains_many([h for h, _ in refused]) == [False]
        assert all(torch.equal(g, o) for g, (_, o) in zip(tier.get_many([h for h, _ in stored]), stored))
        # After deleting, the space is usable again; a reopen sees exactly the stored blocks.
        tier.delete_many([h for h, _ in stored[:4]])
        assert tier.put_many([refused[0][0]], [refused[0][1]]) == [True]
        tier.close()
        reopened = DiskTier(root, 64 * MB)
        expect = {h for h, _ in stored[4:]} | {refused[0][0]}
        assert set(reopened.keys()) == expect and reopened.stats.corrupt == 0
        reopened.close()
    finally:
        if mounted:
            unmount(root)


def test_an_index_write_the_disk_refuses_is_a_failed_write_not_damage(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 8 * MB)
    assert tier.swept.wait(30)
    kept = [key_for(7, i) for i in range(4)]
    tier.put_many(kept, [block_for(h) for h in kept])
    tier.merge()
    # a full or failing disk makes lmdb's commit fail (ENOSPC, or EIO from its sync): not a damaged index
    for error in (lmdb.DiskError("mdb_txn_commit: No space left on device"),
                  lmdb.Error("mdb_txn_commit: Input/output error")):
        env = tier.index._env
        monkeypatch.setattr(tier.index, "_env", _RefusingWrites(env, error))
        tier._dirty = False  # the next put's first step: the dirty flag's commit
        new = key_for(8, len(str(error)))
        assert tier.put_many([new], [block_for(new)]) == [False]
        monkeypatch.setattr(tier.index, "_env", env)
    # nothing was set aside or rebuilt, the blocks stored before read back, and puts work again
    assert tier.index.healed == 0 and not list(tmp_path.glob("index.lmdb.damaged-*"))
    assert all(torch.equal(g, block_for(h)) for g, h in zip(tier.get_many(kept), kept))
    assert tier.put_many([key_for(9, 0)], [block_for(key_for(9, 0))]) == [True]
    tier.close()


class _RefusingWrites:
    """An lmdb environment whose write transactions fail with `error`."""

    def __init__(self, env, error: Exception) -> None:
        self._env, self._error = env, error

    def begin(self, write: bool = False, **kw):
        if write:
            raise self._error
        return self._env.begin(write=write, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_slots_leave_a_full_filesystems_last_bytes_to_the_index(tmp_path):
    root = tmp_path / "small"
    require_tmpfs(root, "8m")
    try:
        # many small blocks fill the filesystem; the index still takes their records at the merge
        tier = DiskTier(root, 1024 * MB, fsync=False)  # it believes it has far more than the filesystem
        stored = []
        for i in range(2000):
            h = key_for(11, i)
            if tier.put_many([h], [torch.full((16384,), i % 251, dtype=torch.uint8)]) != [True]:
                break
            stored.append(h)
        assert 100 < len(stored) < 2000, "the filesystem never filled up"
        tier.close()  # the merge writes every fresh record into lmdb (it used to be "healed" there: SIGBUS)
        reopened = DiskTier(root, 1024 * MB, fsync=False)
        assert set(reopened.keys()) == set(stored) and not list(root.glob("index.lmdb.damaged-*"))
        assert reopened.delete_many(stored[:50]) == 50
        reopened.close()
    finally:
        unmount(root)
