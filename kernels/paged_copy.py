"""Gather/scatter KV between the engine's paged cache and contiguous block buffers.

Layouts (contracts shared with the engine and the store):

- paged cache ``kv_cache``: ``[num_layers, 2, num_pages, page_size, kv_heads,
  head_dim]`` (index 0 = K, 1 = V), contiguous, any float dtype;
- block buffer: ``[n_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]``
  contiguous, same dtype; block ``b`` covers the ``block_tokens // page_size``
  logical pages ``page_ids[b]``.

The Triton kernel gives one program to each (table page, layer*2+kv) pair; it
copies the ``page_size * kv_heads * head_dim`` contiguous elements of that
page in ``BLOCK_SIZE`` chunks. The pure-torch reference lives in
``paged_copy_ref.py`` and is the CPU path.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.paged_copy_ref import gather_blocks_ref, scatter_blocks_ref

_IMPLS = ("auto", "triton", "torch")
_MAX_BLOCK_SIZE = 4096


@triton.jit
def _copy_pages_kernel(
    cache_ptr,
    blocks_ptr,
    page_ids_ptr,
    num_pages,
    block_rows,
    PAGES_PER_BLOCK: tl.constexpr,
    PAGE_NUMEL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EVEN: tl.constexpr,
    TO_BLOCKS: tl.constexpr,
):
    """Copy one page of one (layer, kv) between the cache and a block buffer.

    Program ``(i, lk)``: ``i`` indexes the flattened ``[n * PAGES_PER_BLOCK]``
    page table, ``lk`` is ``layer * 2 + kv``. The cache page sits at row
    ``lk * num_pages + page`` of ``PAGE_NUMEL`` elements; in the block buffer
    it is row ``lk * PAGES_PER_BLOCK + j`` of block ``b``, and consecutive
    blocks start ``block_rows`` rows apart.
    """
    i = tl.program_id(0)
    lk = tl.program_id(1).to(tl.int64)
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    block = (i // PAGES_PER_BLOCK).to(tl.int64)
    j = i % PAGES_PER_BLOCK
    # int64 offsets: a large cache holds more than 2**31 elements. Both are
    # multiples of the constexpr PAGE_NUMEL, which tells the compiler their
    # alignment and so lets it vectorize loads and stores.
    cache_off = (lk * num_pages + page) * PAGE_NUMEL
    block_off = (block * block_rows + lk * PAGES_PER_BLOCK + j) * PAGE_NUMEL
    if TO_BLOCKS:
        src = cache_ptr + cache_off
        dst = blocks_ptr + block_off
    else:
        src = blocks_ptr + block_off
        dst = cache_ptr + cache_off
    for start in tl.range(0, PAGE_NUMEL, BLOCK_SIZE):
        offs = start + tl.arange(0, BLOCK_SIZE)
        if EVEN:
            # No mask: lets the compiler emit full-width vector loads/stores.
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < PAGE_NUMEL
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


_interpreted_kernel = None


def _kernel_for(device: torch.device):
    """The copy kernel runnable on ``device``.

    ``triton.jit`` picks compiled vs interpreted once, at import; a caller that
    enabled TRITON_INTERPRET after this module was imported (e.g. a test
    collected after the engine) still gets the interpreter for CPU tensors.
    """
    global _interpreted_kernel
    from triton.runtime.interpreter import InterpretedFunction

    if device.type != "cpu" or isinstance(_copy_pages_kernel, InterpretedFunction):
        return _copy_pages_kernel
    if _interpreted_kernel is None:
        _interpreted_kernel = InterpretedFunction(_copy_pages_kernel.fn)
    return _interpreted_kernel


def interpret_enabled() -> bool:
    """Whether TRITON_INTERPRET asks for the Triton CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` to "triton" or "torch" for tensors on ``device``.

    "auto" is Triton on CUDA and the torch reference elsewhere; "triton" on
    CPU tensors runs the interpreter and so requires TRITON_INTERPRET=1.
    """
    require(impl in _IMPLS, f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda":
        require(
            device.type == "cpu" and interpret_enabled(),
            f"impl='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}",
        )
    return impl


def require(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``: the launchers' layout check."""
    # Layout errors are caller bugs that would otherwise corrupt memory in the
    # kernel; unlike `assert` this survives `python -O`.
    if not cond:
        raise ValueError(msg)


def check_page_ids(page_ids: Tensor, num_pages: int, device: torch.device, unique: bool) -> Tensor:
    """Validate a ``[n, ppb]`` page table and return it flattened on ``device``.

    Host tables are range-checked exactly (and for duplicates when ``unique``,
    since two blocks writing one page is a race); device tables get an
    asynchronous range assert so the hot path never waits on the GPU.
    """
    require(
        page_ids.dtype in (torch.int32, torch.int64),
        f"page_ids must be int32 or int64, got {page_ids.dtype}",
    )
    require(
        page_ids.dim() == 2 and page_ids.shape[1] >= 1,
        f"page_ids must be [n_blocks, pages_per_block >= 1], got {tuple(page_ids.shape)}",
    )
    flat = page_ids.reshape(-1)
    if flat.numel() == 0:
        return flat.to(device)
    if flat.device.type == "cpu":
        lo, hi = (int(v) for v in torch.aminmax(flat))
        require(0 <= lo and hi < num_pages, f"page_ids must lie in [0, {num_pages}), got [{lo}, {hi}]")
        if unique:
            require(torch.unique(flat).numel() == flat.numel(), "page_ids must not repeat a page in a scatter")
    else:
        torch._assert_async(((flat >= 0) & (flat < num_pages)).all(), f"page_ids out of [0, {num_pages})")
    # a pinned host table is read by DMA after the call returns (its owner may refill it at once), and a
    # device table must land before the host reads it: those copies block; a pageable one is staged at once
    blocking = flat.device.type != "cpu" or flat.is_pinned()
    return flat.to(device, non_blocking=not blocking).contiguous()


def check_blocks(blocks: Tensor, shape: tuple[int, ...], like: Tensor, name: str) -> None:
    """Validate a block buffer against the expected shape, dtype and device of ``like``."""
    require(tuple(blocks.shape) == shape, f"{name} must have shape {shape}, got {tuple(blocks.shape)}")
    require(blocks.dtype == like.dtype, f"{name} dtype {blocks.dtype} != cache dtype {like.dtype}")
    require(blocks.device == like.device, f"{name} on {blocks.device}, cache on {like.device}")
    require(blocks.is_contiguous(), f"{name} must be contiguous")


def _check_cache(kv_cache: Tensor) -> None:
    require(
        kv_cache.dim() == 6 and kv_cache.shape[1] == 2,
        "kv_cache must be [num_layers, 2, num_pages, page_size, kv_heads, head_dim], "
        f"got {tuple(kv_cache.shape)}",
    )
    require(kv_cache.is_contiguous(), "kv_cache must be contiguous")
    require_movable(kv_cache.dtype, "kv_cache")


def require_movable(dtype: torch.dtype, what: str) -> None:
    """The caches the kernels move: float dtypes, and int8 (a quantized cache's bytes)."""
    require(dtype.is_floating_point or dtype == torch.int8, f"{what} must be a float or int8 dtype, got {dtype}")


def _block_shape(kv_cache: Tensor, n_blocks: int, pages_per_block: int) -> tuple[int, ...]:
    num_layers, _, _, page_size, heads, head_dim = kv_cache.shape
    return (n_blocks, num_layers, 2, pages_per_block * page_size, heads, head_dim)


def launch_copy_pages(
    cache: Tensor,
    blocks: Tensor,
    flat_ids: Tensor,
    pages_per_block: int,
    block_stride: int,
    to_blocks: bool,
) -> None:
    """Launch the page-copy kernel over already validated tensors.

    ``cache`` is ``[..., num_pages, page, H, D]`` contiguous, its leading dims
    flattening to ``layer_kv`` (layer, kv) pairs; ``blocks`` points at the
    first element of block 0 in the block buffer (possibly a view such as
    ``out[:, layer]``); ``block_stride`` is the element distance between
    consecutive blocks there, a whole number of pages.
    """
    num_pages = cache.shape[-4]
    page_numel = cache.shape[-3] * cache.shape[-2] * cache.shape[-1]
    layer_kv = cache.numel() // (num_pages * page_numel)
    assert block_stride % page_numel == 0, (block_stride, page_numel)
    block_size = min(triton.next_power_of_2(page_numel), _MAX_BLOCK_SIZE)
    grid = (flat_ids.numel(), layer_kv)
    with torch.cuda.device(cache.device) if cache.is_cuda else contextlib.nullcontext():
        _launch(cache, blocks, flat_ids, grid, num_pages, block_stride // page_numel, pages_per_block, page_numel,
                block_size, to_blocks)


def _launch(cache: Tensor, blocks: Tensor, flat_ids: Tensor, grid: tuple[int, int], num_pages: int,
            block_pages: int, pages_per_block: int, page_numel: int, block_size: int, to_blocks: bool) -> None:
    """The kernel on `cache`'s device, whose stream Triton takes as the current one: a launch from a
    thread whose current GPU is another (a save thread's is GPU 0) would run there, on its pointers."""
    _kernel_for(cache.device)[grid](
        cache,
        blocks,
        flat_ids,
        num_pages,
        block_pages,
        PAGES_PER_BLOCK=pages_per_block,
        PAGE_NUMEL=page_numel,
        BLOCK_SIZE=block_size,
        EVEN=page_numel % block_size == 0,
        TO_BLOCKS=to_blocks,
    )


def gather_blocks(kv_cache: Tensor, page_ids: Tensor, out: Tensor | None = None, impl: str = "auto") -> Tensor:
    """Copy the pages of each block out of the paged cache into contiguous blocks.

    ``page_ids`` (int32/int64 ``[n_blocks, pages_per_block]``) lists, per block,
    its logical pages in token order. Returns ``out``
    ``[n_blocks, L, 2, pages_per_block * page_size, H, D]`` (allocated when None).
    """
    _check_cache(kv_cache)
    ids = check_page_ids(page_ids, kv_cache.shape[2], kv_cache.device, unique=False)
    n_blocks, ppb = page_ids.shape
    shape = _block_shape(kv_cache, n_blocks, ppb)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    else:
        check_blocks(out, shape, kv_cache, "out")
    if resolve_impl(impl, kv_cache.device) == "torch":
        return gather_blocks_ref(kv_cache, ids.view(n_blocks, ppb), out)
    if n_blocks:
        launch_copy_pages(kv_cache, out, ids, ppb, out[0].numel(), to_blocks=True)
    return out


def scatter_blocks(blocks: Tensor, page_ids: Tensor, kv_cache: Tensor, impl: str = "auto") -> None:
    """Write each block into its pages of the paged cache (inverse of ``gather_blocks``).

    Pages not listed in ``page_ids`` are left untouched; a page may appear at
    most once.
    """
    _check_cache(kv_cache)
    ids = check_page_ids(page_ids, kv_cache.shape[2], kv_cache.device, unique=True)
    n_blocks, ppb = page_ids.shape
    page_size = kv_cache.shape[3]
    require(blocks.dim() == 6, f"blocks must be [n, L, 2, block_tokens, H, D], got {tuple(blocks.shape)}")
    require(
        blocks.shape[3] % page_size == 0,
        f"block_tokens ({blocks.shape[3]}) must be a multiple of page_size ({page_size})",
    )
    check_blocks(blocks, _block_shape(kv_cache, n_blocks, ppb), kv_cache, "blocks")
    if resolve_impl(impl, kv_cache.device) == "torch":
        scatter_blocks_ref(blocks, ids.view(n_blocks, ppb), kv_cache)
    elif n_blocks:
        launch_copy_pages(kv_cache, blocks, ids, ppb, blocks[0].numel(), to_blocks=False)
