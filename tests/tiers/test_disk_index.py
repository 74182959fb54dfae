"""The disk tier's index heals itself: random bytes in it, a truncated or
emptied index, damage met by a later write, a deleted LOCK file. Each time
the tier opens (never a crash, never an exception), serves every block whose
slot is whole, and counts the heal."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import encode, intact, object_size
from tiers.disk import DiskTier
from tiers.disk_index import bytes_in_use, vet

REPO = Path(__file__).resolve().parents[2]
NS = Namespace("heal-model", "bfloat16", num_layers=2, kv_heads=2, head_dim=16, block_tokens=4)
MB = 1 << 20


def blocks(n: int, start: int = 0) -> list[tuple[bytes, torch.Tensor]]:
    hs = prefix_hashes(NS, range(start, start + 4 * n))
    return [(h, encode(NS, h, torch.full(NS.block_shape, float(i), dtype=torch.bfloat16))) for i, h in enumerate(hs)]


def filled(root: Path, n: int = 40) -> list[tuple[bytes, torch.Tensor]]:
    made = blocks(n)
    tier = DiskTier(root, 8 * MB, check=intact)
    assert all(tier.put_many([h for h, _ in made], [o for _, o in made]))
    tier.close()
    return made


def serves_all(root: Path, made) -> DiskTier:
    tier = DiskTier(root, 8 * MB, check=intact)
    got = tier.get_many([h for h, _ in made])
    assert all(g is not None and torch.equal(g, o) for g, (_, o) in zip(got, made))
    return tier


def index_file(root: Path) -> Path:
    return root / "index.lmdb" / "data.mdb"


def test_random_bytes_in_the_index_are_healed_from_the_slots(tmp_path):
    made = filled(tmp_path)
    # Bytes of the index's pages in use overwritten at random, several times over.
    f, rng = index_file(tmp_path), random.Random(5)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        for _ in range(20):
            fh.seek(rng.randrange(0, size - 64))
            fh.write(rng.randbytes(64))
    # Opening heals: every block is served again, and the heal is counted.
    tier = serves_all(tmp_path, made)
    assert tier.stats.errors == 1 and len(list(tmp_path.glob("index.lmdb.damaged-*"))) == 1
    tier.close()
    # The rebuilt index is an ordinary one: the next open reads it without healing.
    tier = serves_all(tmp_path, made)
    assert tier.stats.errors == 0
    tier.close()


def test_a_truncated_index_is_set_aside_before_lmdb_maps_it(tmp_path):
    made = filled(tmp_path, 200)
    f = index_file(tmp_path)
    # Cut short (lmdb would map past the end: SIGBUS at the first read there): the check says so.
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    assert "needs" in vet(tmp_path / "index.lmdb")
    # Opened in a child process, so a crash would show as its exit status, not take pytest down.
    code = ("import sys; from tiers.disk import DiskTier; from cache_service.blocks.objects import intact;"
            f"t = DiskTier({str(tmp_path)!r}, 8 << 20, check=intact); print(t.stats.blocks, t.stats.errors)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["200", "1"]
    assert list(tmp_path.glob("index.lmdb.damaged-*"))
    serves_all(tmp_path, made).close()


def test_an_emptied_index_is_rebuilt_and_damaged_files_are_left_out(tmp_path):
    made = filled(tmp_path)
    tier = DiskTier(tmp_path, 8 * MB, check=intact)
    path, off, _ = tier.location_of(made[3][0])
    tier.close()
    # The index truncated to nothing, and one object damaged meanwhile.
    index_file(tmp_path).write_bytes(b"")
    with open(path, "r+b") as fh:
        fh.seek(off + 500)
        fh.write(b"\xff" * 8)
    tier = DiskTier(tmp_path, 8 * MB, check=intact)
    got = tier.get_many([h for h, _ in made])
    # Every whole block is back; the damaged one is a miss and its slot is cleared for reuse.
    assert [g is not None for g in got] == [j != 3 for j in range(len(made))]
    with open(path, "rb") as fh:
        fh.seek(off - 32)
        assert fh.read(32) == bytes(32)
    tier.close()


def test_damage_met_while_open_rebuilds_the_index_from_the_slots(tmp_path):
    made = filled(tmp_path)
    tier = DiskTier(tmp_path, 8 * MB, check=intact)
    # The index's pages past the meta pages overwritten under the open tier.
    f = index_file(tmp_path)
    with open(f, "r+b") as fh:
        fh.seek(2 * 4096)
        fh.write(random.Random(7).randbytes(bytes_in_use(f.parent) - 2 * 4096))
    # Reads and writes go on (the index is rebuilt from the slots) and nothing is lost.
    more = blocks(5, start=1000)
    assert all(tier.put_many([h for h, _ in more], [o for _, o in more]))
    assert tier.delete_many([made[0][0]]) == 1
    tier.close()
    tier = serves_all(tmp_path, made[1:] + more)
    assert tier.stats.blocks == len(made) - 1 + len(more)
    tier.close()


def test_a_deleted_lock_file_is_created_again(tmp_path):
    made = filled(tmp_path, 5)
    (tmp_path / "LOCK").unlink()
    serves_all(tmp_path, made).close()
    assert (tmp_path / "LOCK").exists()


def test_without_a_check_a_damaged_index_starts_empty(tmp_path):
    filled(tmp_path, 5)
    index_file(tmp_path).write_bytes(b"\x00" * 8192)
    tier = DiskTier(tmp_path, 8 * MB)
    # Nothing can vouch for the slots: the segment files are emptied, not trusted.
    assert tier.stats.blocks == 0 and all(p.stat().st_size == 0 for p in (tmp_path / "segments").iterdir())
    tier.close()


def test_a_record_whose_size_was_damaged_is_a_miss_and_the_totals_stay_whole(tmp_path):
    import lmdb

    for byte in (1, 2, 3):  # size fields a bit flip leaves below the largest object an index accepts
        root = tmp_path / f"flip{byte}"
        held = filled(root, 8)
        env = lmdb.open(str(root / "index.lmdb"), subdir=True, lock=False)
        with env.begin(write=True) as txn:
            rec = bytearray(txn.get(held[3][0]))
            rec[byte] ^= 0x10
            txn.put(held[3][0], bytes(rec))
        env.close()
        tier = DiskTier(root, 1 << 30)
        # Reads: the damaged record's block is a miss, every other block a hit; a second read the same.
        for _ in range(2):
            got = tier.get_many([h for h, _ in held])
            assert [g is not None for g in got] == [i != 3 for i in range(8)]
            assert all(torch.equal(g, o) for g, (_, o) in zip(got, held) if g is not None)
        # The tier's totals count the seven blocks left, as they are.
        assert tier.capacity_bytes - tier.free_bytes() == sum(o.numel() for i, (_, o) in enumerate(held) if i != 3)
        tier.close()
