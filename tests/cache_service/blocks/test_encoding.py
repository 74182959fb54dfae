"""Many blocks encoded at once: every copy path gives exactly what encode() gives block by block."""
import pytest
import torch

from cache_service.blocks import encoding
from cache_service.blocks.encoding import STACKED_BYTES, encode_many, pick
from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks.objects import encode

NS = Namespace("tiny", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=4)
H = prefix_hashes(NS, range(40))  # 10 blocks
LARGE = Namespace("large", "bfloat16", num_layers=8, kv_heads=8, head_dim=64, block_tokens=16)  # past STACKED_BYTES


def _payload(seed: int, ns: Namespace = NS) -> torch.Tensor:
    return torch.randn(ns.block_shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _each(ns, hashes, payloads) -> list[torch.Tensor]:
    return [encode(ns, h, p) for h, p in zip(hashes, payloads)]


def test_encoding_many_blocks_at_once_equals_encoding_each():
    # what the store encodes per call: each object equal to encode()'s, all views of one allocation
    transposed = _payload(32).transpose(-1, -2).contiguous().transpose(-1, -2)
    for payloads in ([_payload(30), _payload(31), transposed],  # alike: copied by one stack (one not contiguous)
                     [_payload(30), _payload(31).view(torch.uint8), transposed]):  # not alike: one view each
        objs = encode_many(NS, H[:3], payloads)
        for obj, h, p in zip(objs, H, payloads):
            assert torch.equal(obj, encode(NS, h, p)) and obj.is_contiguous()
        assert len({obj.untyped_storage().data_ptr() for obj in objs}) == 1
    # nothing to encode is no objects; a wrong size is refused
    assert encode_many(NS, [], []) == []
    with pytest.raises(ValueError, match="bytes"):
        encode_many(NS, H[:1], [torch.zeros(3, dtype=torch.bfloat16)])


def test_a_batch_tensor_encodes_as_each_of_its_rows(monkeypatch):
    # an engine's gathered blocks as one tensor: one copy, the same objects as encode() of each row
    copied = []
    one_copy = encoding._copy_batch
    monkeypatch.setattr(encoding, "_copy_batch", lambda *a: copied.append(one_copy(*a)) or copied[-1])
    batch = torch.stack([_payload(i) for i in range(5)])
    objs = encode_many(NS, H[:5], batch)
    assert copied == [True]  # the one-copy path, not the fallback that copies row by row
    assert all(torch.equal(o, e) for o, e in zip(objs, _each(NS, H[:5], batch)))
    assert len({obj.untyped_storage().data_ptr() for obj in objs}) == 1
    # a strided batch (every other block of a larger one) and its bytes under another dtype alike
    strided = torch.stack([_payload(i) for i in range(10)])[::2]
    assert all(torch.equal(o, e) for o, e in zip(encode_many(NS, H[:5], strided), _each(NS, H[:5], strided)))
    flat = batch.reshape(5, -1).view(torch.uint8)
    assert all(torch.equal(o, e) for o, e in zip(encode_many(NS, H[:5], flat), objs))
    # no rows is no objects; rows of the wrong size are refused by name
    assert encode_many(NS, [], batch[:0]) == []
    with pytest.raises(ValueError, match="bytes"):
        encode_many(NS, H[:2], torch.zeros(2, 3, dtype=torch.bfloat16))


def test_large_blocks_in_a_batch_are_copied_and_hashed_in_one_pass():
    # past STACKED_BYTES a batch goes the one-pass way (copy + checksum per block): same objects
    assert LARGE.payload_bytes > STACKED_BYTES
    batch = torch.stack([_payload(i, LARGE) for i in range(2)])
    hs = prefix_hashes(LARGE, range(32))
    assert all(torch.equal(o, e) for o, e in zip(encode_many(LARGE, hs, batch), _each(LARGE, hs, batch)))


def test_pick_takes_a_batch_s_rows_or_a_list_s_items():
    # what the store keeps of a batch when some of its blocks are held already: small rows in one index
    batch = torch.stack([_payload(i) for i in range(4)])
    assert torch.equal(pick(NS, batch, [0, 3]), batch[[0, 3]])
    assert torch.equal(pick(NS, list(batch), [2])[0], batch[2])
    assert len(pick(NS, batch, [])) == 0
    # large rows stay views of the batch: encode_rows copies each once, a gathered copy would be a second
    large = torch.stack([_payload(i, LARGE) for i in range(3)])
    kept = pick(LARGE, large, [2, 0])
    assert [k.data_ptr() for k in kept] == [large[2].data_ptr(), large[0].data_ptr()]
