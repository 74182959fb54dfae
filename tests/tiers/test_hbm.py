"""HbmTier: the slot pool on a torch device. Pool behaviour (capacity, slot
reuse, stats, threads) is covered for both pools in test_cpu.py; these tests
are about devices, and run on CUDA too when one is present."""
from __future__ import annotations

import threading

import pytest
import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import decode, encode, object_size
from tiers.cpu import CpuTier
from tiers.hbm import HbmTier
from tiers.types import BlockHash

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NS = Namespace("m", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=4)
SIZE = object_size(NS)


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def block(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, encoded object) of block i, seeded by i."""
    g = torch.Generator().manual_seed(i)
    payload = torch.randn(NS.block_shape, generator=g).to(torch.bfloat16)
    return payload, encode(NS, key(i), payload)


def test_default_device_is_the_gpu_when_present():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert HbmTier(SIZE, SIZE).device.type == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_is_fixed_at_construction_whatever_thread_uses_the_tier():
    # a save thread's current GPU is GPU 0 whatever its process uses: the tier's pool and copies stay on its own
    tier = HbmTier(4 * SIZE, SIZE)
    assert tier.device == torch.device("cuda", torch.cuda.current_device())
    got = []
    worker = threading.Thread(target=lambda: (tier.put_many([key(0)], [block(0)[1]]), got.extend(tier.get_many([key(0)]))))
    worker.start()
    worker.join()
    assert got[0].device == tier.device


@pytest.mark.parametrize("device", DEVICES)
def test_objects_live_and_come_back_on_the_tier_device(device):
    tier = HbmTier(4 * SIZE, SIZE, device=device)
    payloads, objs = zip(*(block(i) for i in range(3)))
    # Host objects go in; the pool and every object handed out are on the device.
    assert tier.put_many([key(i) for i in range(3)], list(objs)) == [True] * 3
    got = tier.get_many([key(i) for i in range(3)])
    assert all(t.device.type == device for t in got)
    # Header and payload decode back to the exact payload (memory tiers are trusted).
    for i, obj in enumerate(got):
        assert torch.equal(obj.cpu(), objs[i])
        assert torch.equal(decode(obj.cpu(), NS, key(i), verify_payload=tier.verify_payload), payloads[i])


@pytest.mark.parametrize("device", DEVICES)
def test_get_into_host_buffers(device):
    tier = HbmTier(4 * SIZE, SIZE, device=device)
    _, obj = block(5)
    tier.put_many([key(5)], [obj])
    # Load into (pinned, on a GPU machine) host buffers, then reuse the slot.
    outs = [torch.empty(SIZE, dtype=torch.uint8, pin_memory=torch.cuda.is_available()) for _ in range(2)]
    assert tier.get_into([key(5), key(6)], outs) == [True, False]
    tier.delete_many([key(5)])
    tier.put_many([key(7)], [block(7)[1]])
    assert torch.equal(outs[0], obj)


@pytest.mark.parametrize("device", DEVICES)
def test_demote_to_cpu_tier_and_promote_back(device):
    # The store's path between the two pools: get_many from one, put_many into the other.
    hbm, cpu = HbmTier(2 * SIZE, SIZE, device=device), CpuTier(2 * SIZE, SIZE)
    _, obj = block(9)
    hbm.put_many([key(9)], [obj])
    assert cpu.put_many([key(9)], hbm.get_many([key(9)])) == [True]
    hbm.delete_many([key(9)])
    assert hbm.put_many([key(9)], cpu.get_many([key(9)])) == [True]
    assert torch.equal(hbm.get_many([key(9)])[0].cpu(), obj)
