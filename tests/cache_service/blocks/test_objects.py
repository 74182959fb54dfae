"""Block objects: round trip, and every kind of damage is a CorruptBlockError."""
import pytest
import torch

from cache_service.blocks.keys import Namespace, prefix_hashes
from cache_service.blocks import objects
from cache_service.blocks.objects import (HEADER_SIZE, checksum, decode, encode, verify,
                                          encode_rows, object_size)
from tiers import host_copy
from tiers.types import CorruptBlockError

NS = Namespace("tiny", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=4)
H = prefix_hashes(NS, range(12))


def _payload(seed: int) -> torch.Tensor:
    return torch.randn(NS.block_shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_round_trip_is_bit_exact_and_zero_copy():
    # encode then decode gives the same bits, as a view into the object
    p = _payload(0)
    obj = encode(NS, H[0], p)
    assert obj.numel() == object_size(NS) == HEADER_SIZE + NS.payload_bytes
    out = decode(obj, NS, H[0])
    assert torch.equal(out.view(torch.int16), p.view(torch.int16))
    assert out.data_ptr() == obj.data_ptr() + HEADER_SIZE


@pytest.mark.parametrize("offset", [0, 5, 30, 60, 81, HEADER_SIZE, HEADER_SIZE + 100, -1])
def test_any_flipped_bit_is_detected(offset):
    # a single flipped bit anywhere in header or payload fails decoding
    obj = encode(NS, H[0], _payload(1))
    obj[offset] ^= 0x10
    with pytest.raises(CorruptBlockError):
        decode(obj, NS, H[0])


def test_fast_header_check_agrees_with_decode_on_every_header_bit():
    # an intact object: the header check returns the payload checksum decode verifies
    obj = encode(NS, H[0], _payload(4))
    good = checksum(obj[HEADER_SIZE:])
    assert verify([obj], NS, H[:1], payload=False) == [good]
    # any one flipped bit of the header, padding included, makes it refuse, as decode does
    for byte in range(HEADER_SIZE):
        for bit in (0, 7):
            bad = obj.clone()
            bad[byte] ^= 1 << bit
            assert verify([bad], NS, H[:1], payload=False) == [None], (byte, bit)
            # the same answers for many rows checked at once, and for their headers alone
            rows = torch.stack([obj, bad, obj])
            assert verify(rows, NS, [H[0]] * 3, payload=False) == [good, None, good], (byte, bit)
            assert verify(rows[:, :HEADER_SIZE], NS, [H[0]] * 3, payload=False) == [good, None, good]
    # decode and intact (the disk's rebuild) refuse every one of them too, the padding included
    for byte in range(HEADER_SIZE):
        bad = obj.clone()
        bad[byte] ^= 1
        with pytest.raises(CorruptBlockError):
            decode(bad, NS, H[0])
        assert not objects.intact(H[0], memoryview(bad.numpy())), byte
    # another block's hash, another tenant, another size: refused too
    assert verify([obj], NS, [H[1]], payload=False) == [None]
    assert verify([obj], NS.with_tenant("other"), H[:1], payload=False) == [None]
    assert verify([obj[:-1]], NS, H[:1], payload=False) == [None]
    assert verify(torch.stack([obj, obj]), NS, H[:2], payload=False)[1] is None


def test_truncated_swapped_and_foreign_objects_are_detected():
    # truncation
    obj = encode(NS, H[0], _payload(2))
    with pytest.raises(CorruptBlockError, match="bytes"):
        decode(obj[:-1].clone(), NS, H[0])
    with pytest.raises(CorruptBlockError, match="short"):
        decode(obj[:10].clone(), NS, H[0])
    # an object stored under the wrong key (swapped files)
    with pytest.raises(CorruptBlockError, match="holds block"):
        decode(obj, NS, H[1])
    # same hash but another namespace (other tenant) or another layout
    with pytest.raises(CorruptBlockError, match="namespace"):
        decode(obj, NS.with_tenant("other"), H[0])
    wide = Namespace("tiny", "bfloat16", num_layers=2, kv_heads=2, head_dim=8, block_tokens=8)
    with pytest.raises(CorruptBlockError):
        decode(obj, wide, H[0])


def test_payload_checksum_can_be_skipped_for_trusted_memory():
    # memory tiers skip the payload hash, but the header is still checked
    obj = encode(NS, H[0], _payload(3))
    obj[-1] ^= 1
    decode(obj, NS, H[0], verify_payload=False)
    with pytest.raises(CorruptBlockError):
        decode(obj, NS, H[1], verify_payload=False)


def test_wrong_payload_size_is_a_clear_error():
    # a payload of the wrong shape is refused at encode time
    with pytest.raises(ValueError, match="bytes"):
        encode(NS, H[0], torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("batched_copy", [True, False])
def test_encoding_many_rows_equals_encoding_each_block(batched_copy, monkeypatch):
    # the C copy helper must be built here; torch copies are the fallback
    assert host_copy.copy_many is not None, "C copy helper missing (pip install -e . needs a C compiler)"
    if not batched_copy:
        monkeypatch.setattr(host_copy, "copy_many", None)
    # rows encoded in one call are byte for byte the objects encode() makes
    payloads = [_payload(10), _payload(11).transpose(-1, -2).contiguous().transpose(-1, -2)]  # one not contiguous
    rows = torch.full((2, object_size(NS)), 0xAA, dtype=torch.uint8)
    encode_rows(rows, NS, H[:2], payloads)
    for row, h, p in zip(rows, H, payloads):
        assert torch.equal(row, encode(NS, h, p))
    # a payload of the wrong size is refused before anything is written
    before = rows.clone()
    with pytest.raises(ValueError, match="bytes"):
        encode_rows(rows, NS, H[1:3], [payloads[0], torch.zeros(3, dtype=torch.bfloat16)])
    assert torch.equal(rows, before)


def test_encoding_into_chosen_rows_equals_encoding_each_block():
    # objects land in rows 3 and 1 exactly as encode() makes them; every other byte stays as it was
    rows = torch.full((5, object_size(NS) + 32), 0xAA, dtype=torch.uint8)
    before = rows.clone()
    payloads = [_payload(20), _payload(21)]
    objects.encode_objects(rows, [3, 1], NS, H[:2], payloads)
    for r, h, p in zip((3, 1), H, payloads):
        assert torch.equal(rows[r, :object_size(NS)], encode(NS, h, p))
        rows[r, :object_size(NS)] = 0xAA
    assert torch.equal(rows, before)


K = prefix_hashes(NS, range(40))  # ten blocks


def test_one_verification_api_for_rows_and_views():
    # verify: a checksum per sound object, None per damaged or misnamed one; rows and views agree
    rows = torch.stack([encode(NS, h, _payload(i)) for i, h in enumerate(K[:4])])
    rows[1, HEADER_SIZE + 3] ^= 1  # payload bit
    rows[2, 30] ^= 1  # header bit
    names = [K[0], K[1], K[2], K[5]]  # the last misnamed
    want = [checksum(rows[0, HEADER_SIZE:]), None, None, None]
    views = [memoryview(r.numpy()) for r in rows.unbind(0)]
    assert objects.verify(rows, NS, names) == objects.verify(views, NS, names) == want
    assert objects.verify(rows[:1], NS, names[:1], sums=[want[0] + 1]) == [None]  # the caller's sums are trusted
    # headers alone (a payload bit is not seen): rows, headers only, views
    claims = [want[0], objects.verify(rows[1:2], NS, names[1:2], payload=False)[0], None, None]
    assert claims[1] is not None and claims[1] != checksum(rows[1, HEADER_SIZE:])
    assert objects.verify(rows, NS, names, payload=False) == objects.verify(rows[:, :HEADER_SIZE], NS, names,
                                                                           payload=False) == claims
    assert objects.verify(views, NS, names, payload=False) == claims
    with pytest.raises(CorruptBlockError, match="header checksum"):
        objects.require(rows, NS, names, payload=False)
    # require: the checksums, or decode's diagnosis of the first bad object
    assert objects.require(views[:1], NS, names[:1]) == want[:1]
    for objs in (rows, views):
        with pytest.raises(CorruptBlockError, match="payload checksum"):
            objects.require(objs, NS, names)


def test_rehead_gives_a_payload_new_keys_in_rows_pool_slots_and_views():
    tenant = NS.with_tenant("acme")
    rows = torch.stack([encode(NS, h, _payload(i)) for i, h in enumerate(K[:3])])
    sums = objects.require(rows, NS, K[:3])
    table = rows.clone()
    objects.rehead(rows, tenant, K[3:6], sums)
    assert objects.require(rows, tenant, K[3:6]) == sums
    objects.rehead(table, tenant, [K[7]], [sums[2]], at=[2])  # a pool's slot
    assert objects.verify(table[:2], NS, K[:2]) == sums[:2] and objects.verify(table[2:], tenant, [K[7]]) == sums[2:]
    view = memoryview(bytearray(table[0].numpy()))
    objects.rehead([view], tenant, [K[8]], [sums[0]])
    assert objects.verify([view], tenant, [K[8]]) == sums[:1]
    # adopt: checked as sent, then headed for the store's keys
    fresh = torch.stack([encode(NS, h, _payload(i)) for i, h in enumerate(K[:3])])
    assert objects.adopt(fresh, NS, K[:3], tenant, K[3:6]) == sums and torch.equal(fresh, rows)


def test_a_sound_object_at_an_odd_offset_decodes():
    # an object that is a view at an odd byte offset (inside a larger buffer): verified, then decoded
    obj = encode(NS, H[0], _payload(9))
    buf = torch.zeros(obj.numel() + 1, dtype=torch.uint8)
    buf[1:] = obj
    assert verify([buf[1:]], NS, H[:1]) != [None]
    assert torch.equal(decode(buf[1:], NS, H[0]).view(torch.int16), _payload(9).view(torch.int16))
