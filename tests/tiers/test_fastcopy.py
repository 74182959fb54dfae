"""The batched copy accelerator against its reference, torch's copy_."""
import os

import pytest
import torch

if os.environ.get("CI") == "true":  # CI installs with a compiler: a missing build is a failure there
    from tiers import _fastcopy as fastcopy
else:
    fastcopy = pytest.importorskip("tiers._fastcopy")


def test_copy_many_matches_torch_copies():
    # blocks of assorted sizes copied in one call land exactly as torch copies them
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 1, 4095, 368_768)]
    dsts = [torch.zeros(s.numel() + 7, dtype=torch.uint8) for s in srcs]
    fastcopy.copy_many([d.numpy() for d in dsts], [s.numpy() for s in srcs])
    for d, s in zip(dsts, srcs):
        assert torch.equal(d[: s.numel()], s)
        assert not d[s.numel():].any()  # nothing written past the source's length


def test_copy_many_refuses_bad_arguments_before_copying():
    # a short destination anywhere in the batch: nothing is copied
    first, short = torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="destination has 2 bytes"):
        fastcopy.copy_many([first.numpy(), short.numpy()], [b"abcdefgh", b"abc"])
    assert not first.any()
    # read-only destinations and mismatched lists are errors too
    with pytest.raises(BufferError):
        fastcopy.copy_many([b"xxxx"], [b"a"])
    with pytest.raises(ValueError, match="one destination per source"):
        fastcopy.copy_many([bytearray(1)], [])



def test_a_batch_below_the_gil_release_size_is_copied_and_hashed_as_a_large_one():
    # 64 small blocks (72 KiB: the GIL is kept) and one of 512 KiB (released) land alike, with the same sums
    import xxhash
    from tiers.host_copy import XXH3
    for n, size in ((64, 1152), (1, 512 << 10)):
        srcs = [torch.full((size,), i % 251, dtype=torch.uint8) for i in range(n)]
        dsts = [torch.zeros(size, dtype=torch.uint8) for _ in srcs]
        fastcopy.copy_many([d.numpy() for d in dsts], [s.numpy() for s in srcs])
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        dsts = [torch.zeros(size, dtype=torch.uint8) for _ in srcs]
        sums = fastcopy.copy_hash_many([d.numpy() for d in dsts], [s.numpy() for s in srcs], 128, XXH3)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        assert sums == [xxhash.xxh3_64_intdigest(s.numpy()[128:]) for s in srcs]
