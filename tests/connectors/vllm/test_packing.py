"""vLLM's CPU page packings as strided maps: learned from an index, checked
against the oracle's plain per-element indexing, copied both ways."""
import pytest
import torch

from connectors.vllm.packing import copy_half, strided_halves
from connectors.vllm.pages import CpuPageLayout, PagedKV
from tests.connectors.vllm.oracle import cpu_index, read_tokens, same

SIZES = [("tokens", 128, 8), ("k_transposed", 128, 64), ("k_transposed", 16, 8), ("amx", 32, 16),
         ("amx", 128, 64), ("amx", 64, 32)]


def _position(halves, kv: int, t: int, d: int) -> int:
    """Where the learned digits put element (kv, t, d)."""
    half = halves[kv]
    pos = half.offset
    for value, axes in ((t, half.tokens), (d, half.dims)):
        for size, stride in reversed(axes):
            pos += (value % size) * stride
            value //= size
    return pos


@pytest.mark.parametrize("kind,page,dim", SIZES)
def test_every_vllm_packing_is_strided_and_the_digits_place_every_element(kind, page, dim):
    # the digits learned from the index put every element where the index says
    index = cpu_index(kind, page, dim)
    halves = strided_halves(index)
    assert halves is not None
    for kv in range(2):
        for t in range(page):
            for d in range(0, dim, 3):
                assert _position(halves, kv, t, d) == index[kv, t, d], (kv, t, d)


def test_a_random_permutation_is_not_strided():
    # a packing with no digits is left to the gather path
    assert strided_halves(cpu_index("permuted", 16, 8, seed=1)) is None
    assert CpuPageLayout(cpu_index("permuted", 16, 8, seed=1)).kind == "permuted"
    # AMX is recognized as strided (vLLM's "amx" ISA, bf16 pages of 32k tokens)
    assert CpuPageLayout(cpu_index("amx", 128, 64)).kind == "strided"


# store blocks of 16 or 32 tokens within a page (larger ones are regrouped before they get here)
@pytest.mark.parametrize("kind,page,dim,tokens", [(*size, t) for size in SIZES for t in (16, 32) if size[1] % t == 0])
def test_copy_half_writes_and_reads_what_the_oracle_indexes(kind, page, dim, tokens):
    index, heads, m = cpu_index(kind, page, dim), 3, 4
    halves = strided_halves(index)
    gen = torch.Generator().manual_seed(page * dim + tokens)
    canon = torch.randn(m, page // tokens, 2, tokens, heads, dim, generator=gen).to(torch.bfloat16)
    # write canonical K and V into m regions (spaced one region apart, as every other page)
    pages = torch.zeros(2 * m, heads, 2 * page * dim, dtype=torch.bfloat16)
    regions = pages[::2]
    for j in range(2):
        copy_half(regions, halves[j], canon[:, :, j], into_pages=True)
    # the oracle reads back every token of every page, bit for bit
    layer = pages.view(2 * m, heads, page, 2 * dim)
    want = canon.permute(2, 0, 1, 3, 4, 5).reshape(1, 2, m * page, heads, dim)
    assert same(read_tokens([layer], list(range(0, 2 * m, 2)), 0, 0, m * page, index), want)
    assert not pages[1::2].any()  # the pages in between stay untouched
    # and reading them out gives the canonical blocks again
    back = torch.zeros_like(canon)
    for j in range(2):
        copy_half(regions, halves[j], back[:, :, j], into_pages=False)
    assert same(back, canon)


def test_paged_kv_round_trips_amx_pages_through_the_strided_path():
    # a vLLM-shaped AMX cache: 2 layers, 8 pages of 128 tokens, 3 heads of 64
    page, heads, dim, layers = 128, 3, 64, 2
    layout = CpuPageLayout(cpu_index("amx", page, dim))
    caches = {f"model.layers.{i}.attn": torch.zeros(8, heads, page, 2 * dim, dtype=torch.bfloat16)
              for i in range(layers)}
    kv = PagedKV(caches, heads, dim, page, layout)
    blocks = torch.randn(2 * page // 16, layers, 2, 16, heads, dim).to(torch.bfloat16)
    # store blocks written into pages 5 and 2, then read back
    kv.write_blocks(list(blocks), [5, 2])
    assert same(kv.read_blocks([5, 2], 16), blocks)


def _writer_by_index(index: torch.Tensor):
    """A page writer as vLLM's is called (token-major K and V, token slots), placing by the oracle's index."""
    def write(layer, key, value, slots):
        pages, heads, page, _ = layer.shape
        regions = layer.view(pages, heads, -1)
        for kv, src in enumerate((key, value)):
            for t, slot in enumerate(slots.tolist()):
                p, r = divmod(slot, page)
                regions[p, :, index[kv, r]] = src[t]
    return write


@pytest.mark.parametrize("kind", ["amx", "k_transposed"])
def test_loads_through_the_engines_own_page_writer_stage_tokens_and_slots_right(kind):
    # the same blocks written by strided copies and by a vLLM-style writer land identically
    page, heads, dim, layers = 32, 3, 16, 2
    index = cpu_index(kind, page, dim)
    blocks = list(torch.randn(3 * page // 16, layers, 2, 16, heads, dim).to(torch.bfloat16))
    pages = []
    for layout in (CpuPageLayout(index), CpuPageLayout(index, _writer_by_index(index))):
        caches = {f"model.layers.{i}.attn": torch.zeros(6, heads, page, 2 * dim, dtype=torch.bfloat16)
                  for i in range(layers)}
        PagedKV(caches, heads, dim, page, layout).write_blocks(blocks, [4, 1, 2])
        pages.append(torch.stack(list(caches.values())))
    assert same(pages[0], pages[1]) and pages[0].any()
