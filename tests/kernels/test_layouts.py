"""vLLM flash-attention layout adapter (Triton vs torch).

The expected canonical blocks are derived from vLLM's own reading of the
layout ([2, num_blocks, block_size, H, D]), written as naive per-block loops.
(The CPU layout is learned at run time: tests/connectors/vllm.)
"""

import pytest
import torch

from kernels import gather_blocks
from kernels.layouts import gather_vllm_flash, scatter_vllm_flash

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
L, NB, BS, H, D = 3, 12, 4, 2, 8


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    # impl="triton" on CPU tensors runs the Triton interpreter only when asked.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def randn(*shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def flash_layers(dtype, seed=0):
    """vLLM flash-attention caches, one [2, num_blocks, block_size, H, D] tensor per layer."""
    return [randn(2, NB, BS, H, D, dtype=dtype, seed=seed + i) for i in range(L)]


def naive_from_flash(layers, page_ids):
    n, ppb = page_ids.shape
    out = torch.empty(n, L, 2, ppb * BS, H, D, dtype=layers[0].dtype)
    for b in range(n):
        for j, page in enumerate(page_ids[b].tolist()):
            for layer_idx, layer in enumerate(layers):
                out[b, layer_idx, :, j * BS : (j + 1) * BS] = layer[:, page]
    return out


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("ppb", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_gather_follows_the_layout(impl, ppb, dtype):
    # A block of ppb vLLM pages, for two blocks at scattered pages.
    layers = flash_layers(dtype)
    page_ids = torch.tensor([[5, 1], [10, 3]])[:, :ppb]
    out = gather_vllm_flash(layers, page_ids, impl=impl)
    assert torch.equal(out, naive_from_flash(layers, page_ids))
    # Flash layers stacked are our engine cache: both paths agree.
    assert torch.equal(out, gather_blocks(torch.stack(layers), page_ids, impl="torch"))


@pytest.mark.parametrize("ppb", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_scatter_triton_matches_reference(ppb, dtype):
    # Identical layer sets written by each implementation.
    by_triton, by_torch = flash_layers(dtype, seed=2), flash_layers(dtype, seed=2)
    before = [t.clone() for t in by_triton]
    page_ids = torch.tensor([[6, 0], [2, 11], [9, 4]])[:, :ppb]
    blocks = randn(3, L, 2, ppb * BS, H, D, dtype=dtype, seed=3)
    scatter_vllm_flash(blocks, page_ids, by_triton, impl="triton")
    scatter_vllm_flash(blocks, page_ids, by_torch, impl="torch")
    # Same bytes, the blocks land in their pages, the other pages are intact.
    mapped = page_ids.reshape(-1).tolist()
    others = [p for p in range(NB) if p not in mapped]
    for new, ref, old in zip(by_triton, by_torch, before):
        assert torch.equal(new, ref)
        assert torch.equal(new[:, others], old[:, others])
    assert torch.equal(naive_from_flash(by_triton, page_ids), blocks)


def test_flash_round_trip_is_identity():
    # Gather from one set of layers, scatter into blank ones, gather again.
    layers = flash_layers(torch.float16, seed=4)
    page_ids = torch.tensor([[8, 2], [0, 7]], dtype=torch.int32)
    blocks = gather_vllm_flash(layers, page_ids, impl="triton")
    blank = [torch.zeros_like(t) for t in layers]
    scatter_vllm_flash(blocks, page_ids, blank, impl="triton")
    flat = page_ids.reshape(-1).long()
    for new, old in zip(blank, layers):
        assert torch.equal(new[:, flat], old[:, flat])
    assert torch.equal(gather_vllm_flash(blank, page_ids, impl="triton"), blocks)


def _bad_cases():
    """Malformed adapter calls, each with the phrase its error must contain."""
    flash = flash_layers(torch.float32)
    blocks = randn(2, L, 2, BS, H, D, dtype=torch.float32, seed=7)
    ids2 = torch.tensor([[0], [1]])
    return {
        "flash kv dim": (lambda: gather_vllm_flash([t[:1] for t in flash], ids2), "must be 2"),
        "flash rank": (lambda: gather_vllm_flash([t[0] for t in flash], ids2), "num_blocks, block_size"),
        "flash ids range": (lambda: gather_vllm_flash(flash, ids2 - 1), "must lie in"),
        "flash blocks dtype": (
            lambda: scatter_vllm_flash(blocks.half(), ids2, flash),
            "dtype",
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_adapters_reject_bad_layouts(case):
    # Each malformed argument is refused with a message naming the problem.
    call, message = _bad_cases()[case]
    with pytest.raises(ValueError, match=message):
        call()
