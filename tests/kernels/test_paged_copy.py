"""Paged cache <-> block buffer copies: Triton (interpreted on CPU) vs torch reference.

Every Triton test runs the real kernel under TRITON_INTERPRET=1 on CPU tensors;
both implementations are also checked against a naive per-page definition of
the layout, so a shared mistake cannot pass unnoticed. Sizes are tiny because
the interpreter executes each program in Python.
"""

import pytest
import torch

from kernels import gather_blocks, scatter_blocks
from kernels.paged_copy import resolve_impl

IMPLS = ["triton", "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    # impl="triton" on CPU tensors runs the Triton interpreter only when asked.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_cache(dtype=torch.float32, layers=2, pages=24, page=4, heads=2, dim=8, seed=0):
    """A paged cache [L, 2, P, page, H, D] whose every element is distinct."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, pages, page, heads, dim)
    return torch.randn(shape, generator=gen).to(dtype)


def scattered_ids(n_blocks, ppb, pages, seed=1, dtype=torch.int64):
    """A non-monotonic page table [n_blocks, ppb] of distinct pages."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(pages, generator=gen)[: n_blocks * ppb].view(n_blocks, ppb).to(dtype)


def naive_gather(cache, ids):
    """Block b, token slice j of the layout is page ids[b, j] of every layer/kv."""
    layers, _, _, page, heads, dim = cache.shape
    n, ppb = ids.shape
    out = torch.empty(n, layers, 2, ppb * page, heads, dim, dtype=cache.dtype)
    for b in range(n):
        for j in range(ppb):
            out[b, :, :, j * page : (j + 1) * page] = cache[:, :, int(ids[b, j])]
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ppb", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_follows_the_layout(impl, ppb, dtype):
    # A cache and a scattered table of 3 blocks, each ppb pages long.
    cache = make_cache(dtype)
    ids = scattered_ids(3, ppb, cache.shape[2])
    # Gathering yields exactly the naive per-page copy, bit for bit.
    out = gather_blocks(cache, ids, impl=impl)
    assert out.shape == (3, 2, 2, ppb * 4, 2, 8) and out.is_contiguous()
    assert torch.equal(out, naive_gather(cache, ids))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_page_size_uses_masked_tail(impl, dtype):
    # page*H*D = 3*3*5 = 45 elements: not a power of two (kernel masks the
    # tail), and odd bytes per row (reference cannot use word views).
    cache = make_cache(dtype, layers=3, pages=10, page=3, heads=3, dim=5)
    ids = scattered_ids(2, 2, 10, dtype=torch.int32)
    out = gather_blocks(cache, ids, impl=impl)
    assert torch.equal(out, naive_gather(cache, ids))
    # Scatter back into a zeroed cache lands every page where it came from.
    target = torch.zeros_like(cache)
    scatter_blocks(out, ids, target, impl=impl)
    flat = ids.reshape(-1).long()
    assert torch.equal(target[:, :, flat], cache[:, :, flat])


@pytest.mark.parametrize("ppb", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_triton_matches_reference_and_spares_other_pages(ppb, dtype):
    # Two identical caches and fresh blocks to write into scattered pages.
    cache = make_cache(dtype)
    ids = scattered_ids(3, ppb, cache.shape[2], seed=ppb)
    blocks = torch.randn(3, 2, 2, ppb * 4, 2, 8).to(dtype)
    by_triton, by_torch = cache.clone(), cache.clone()
    # Both implementations write the same bytes.
    scatter_blocks(blocks, ids, by_triton, impl="triton")
    scatter_blocks(blocks, ids, by_torch, impl="torch")
    assert torch.equal(by_triton, by_torch)
    # Mapped pages now hold the blocks ...
    assert torch.equal(naive_gather(by_triton, ids), blocks)
    # ... and every other page is exactly as before.
    untouched = torch.ones(cache.shape[2], dtype=torch.bool)
    untouched[ids.reshape(-1)] = False
    assert untouched.sum() == cache.shape[2] - 3 * ppb
    assert torch.equal(by_triton[:, :, untouched], cache[:, :, untouched])


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_caches_move_as_bytes(impl):
    # a quantized cache (the namespace allows kv_dtype int8) gathers and scatters like any other
    cache = torch.randint(-128, 128, (2, 2, 24, 4, 2, 8), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    ids = scattered_ids(3, 2, 24)
    out = gather_blocks(cache, ids, impl=impl)
    assert torch.equal(out, naive_gather(cache, ids))
    target = torch.zeros_like(cache)
    scatter_blocks(out, ids, target, impl=impl)
    assert torch.equal(target[:, :, ids.reshape(-1)], cache[:, :, ids.reshape(-1)])


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_batch_into_a_larger_pool(impl):
    # A 6-block table, of which only every other row is moved this step.
    cache = make_cache(torch.bfloat16)
    table = scattered_ids(6, 2, cache.shape[2], seed=7)
    ids = table[::2]
    assert not ids.is_contiguous()
    # The destination is the head of a preallocated pool filled with a sentinel.
    pool = torch.full((6, 2, 2, 8, 2, 8), -7.0, dtype=torch.bfloat16)
    got = gather_blocks(cache, ids, out=pool[:3], impl=impl)
    # The filled rows are the gathered blocks, the rest of the pool is intact.
    assert got.data_ptr() == pool.data_ptr()
    assert torch.equal(pool[:3], naive_gather(cache, ids))
    assert bool((pool[3:] == -7.0).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_round_trip_is_identity_on_mapped_pages(impl, id_dtype):
    # Gather blocks from one cache, scatter them into a blank one.
    cache = make_cache(torch.float16, seed=3)
    ids = scattered_ids(4, 2, cache.shape[2], seed=4, dtype=id_dtype)
    blocks = gather_blocks(cache, ids, impl=impl)
    restored = torch.zeros_like(cache)
    scatter_blocks(blocks, ids, restored, impl=impl)
    # The mapped pages are restored exactly; gathering again gives the same blocks.
    flat = ids.reshape(-1).long()
    assert torch.equal(restored[:, :, flat], cache[:, :, flat])
    assert torch.equal(gather_blocks(restored, ids, impl=impl), blocks)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_table_is_a_no_op(impl):
    # Zero blocks: an empty result and an unchanged cache.
    cache = make_cache()
    ids = torch.empty(0, 2, dtype=torch.int64)
    assert gather_blocks(cache, ids, impl=impl).shape == (0, 2, 2, 8, 2, 8)
    before = cache.clone()
    scatter_blocks(torch.empty(0, 2, 2, 8, 2, 8), ids, cache, impl=impl)
    assert torch.equal(cache, before)


def test_auto_picks_triton_only_on_cuda():
    # The engine's CPU path is the reference even with the interpreter enabled.
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("triton", torch.device("cpu")) == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    # Without TRITON_INTERPRET the CPU kernel cannot run: a clear error.
    monkeypatch.delenv("TRITON_INTERPRET")
    cache = make_cache()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        gather_blocks(cache, scattered_ids(1, 1, 24), impl="triton")


def _bad_layout_cases(impl="torch"):
    """Malformed calls, each with the phrase its error must contain."""
    cache = make_cache()
    ids = scattered_ids(2, 2, 24)
    blocks = gather_blocks(cache, ids, impl="torch")
    strided_out = blocks.transpose(4, 5).contiguous().transpose(4, 5)

    def g(kv, table, **kw):
        return gather_blocks(kv, table, impl=kw.pop("impl", impl), **kw)

    def s(blk, table, kv):
        return scatter_blocks(blk, table, kv, impl=impl)

    return {
        "cache rank": (lambda: g(cache[0], ids), "num_layers, 2, num_pages"),
        "cache kv dim": (lambda: g(cache[:, :1].contiguous(), ids), "num_layers, 2, num_pages"),
        "cache strided": (lambda: g(cache.transpose(4, 5), ids), "kv_cache must be contiguous"),
        "cache int": (lambda: g(cache.to(torch.int32), ids), "float or int8 dtype"),
        "ids float": (lambda: g(cache, ids.float()), "int32 or int64"),
        "ids rank": (lambda: g(cache, ids.reshape(-1)), "pages_per_block"),
        "ids negative": (lambda: g(cache, ids - 30), r"\[0, 24\)"),
        "ids too large": (lambda: g(cache, ids + 24), r"\[0, 24\)"),
        "out shape": (lambda: g(cache, ids, out=blocks[:1]), "out must have shape"),
        "out dtype": (lambda: g(cache, ids, out=blocks.half()), "dtype"),
        "out strided": (lambda: g(cache, ids, out=strided_out), "out must be contiguous"),
        "block tokens": (lambda: s(blocks[:, :, :, :6], ids, cache), "multiple of page_size"),
        "blocks shape": (lambda: s(blocks[:, :1], ids, cache), "blocks must have shape"),
        "duplicate page": (lambda: s(blocks, torch.tensor([[1, 2], [2, 3]]), cache), "must not repeat"),
        "impl": (lambda: g(cache, ids, impl="cuda"), "impl must be one of"),
    }


@pytest.mark.parametrize("case", sorted(_bad_layout_cases()))
@pytest.mark.parametrize("impl", IMPLS)
def test_launchers_reject_bad_layouts(case, impl):
    # Each malformed argument is refused before any copy, naming the problem.
    call, message = _bad_layout_cases(impl)[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("to_blocks", [True, False])
def test_kernel_compiles_to_vector_copies_for_sm90(to_blocks, monkeypatch):
    """The interpreter accepts code the GPU compiler may reject; compile for real.

    Cross-compiles the kernel for an sm_90 target with the ptxas bundled in
    triton (no GPU needed) and checks the copy is 16-byte vector loads/stores.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    import kernels.paged_copy as pc

    # Pure copies have no FP math; pin the knob only to silence its warning.
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    # A bf16 page of 16 tokens x 8 heads x 128 dims, 2 pages per block.
    kernel = JITFunction(pc._copy_pages_kernel.fn)
    consts = {"PAGES_PER_BLOCK": 2, "PAGE_NUMEL": 16 * 8 * 128, "BLOCK_SIZE": 4096, "EVEN": True}
    consts["TO_BLOCKS"] = to_blocks
    signature = {"cache_ptr": "*bf16", "blocks_ptr": "*bf16", "page_ids_ptr": "*i32"}
    signature |= {"num_pages": "i32", "block_rows": "i32"} | {name: "constexpr" for name in consts}
    # Torch allocations are 16-byte aligned; triton specializes on that too.
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=aligned)
    ptx = compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_caches_with_odd_rows_scatter_on_every_path(dtype):
    # float8 pages of 3 bytes a row: no wider word fits, and CPU index_copy_ has no float8 kernel
    cache = torch.randn(1, 2, 4, 3, 1, 1).to(dtype)
    ids = torch.tensor([[2], [0]])
    blocks = gather_blocks(cache, ids)
    for impl in ("torch", "triton"):
        out = torch.zeros_like(cache)
        scatter_blocks(blocks, ids, out, impl=impl)
        assert torch.equal(out[:, :, [2, 0]].view(torch.uint8), cache[:, :, [2, 0]].view(torch.uint8)), impl
