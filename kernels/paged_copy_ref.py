"""Pure-torch reference for moving KV between the paged cache and block buffers.

This is both the oracle the Triton kernels are tested against and the CPU hot
path of the engine, so it is vectorized: every direction is a single
``index_select`` / ``index_copy_`` over page rows, straight into the
destination, with no intermediate copy and no Python loop over blocks or
layers; rows are moved as wide words (``as_words``).

Layouts (see ``kernels/paged_copy.py`` for the checked public API):

- paged cache ``[L, 2, P, page, H, D]``: one page of one layer's K or V is a
  contiguous row of ``page * H * D`` elements, i.e. the cache is ``L*2*P`` rows;
- block buffer ``[n, L, 2, bt, H, D]`` with ``bt = ppb * page``: block ``b`` is
  ``L*2*ppb`` consecutive rows ordered (layer, kv, page-in-block).

Arguments are assumed validated by the caller.
"""

import torch
from torch import Tensor


# Widest first: CPU indexing kernels pay a per-element cost (index check,
# strided address math), so moving 16-byte words instead of 2-byte bf16
# elements makes ``index_copy_`` several times faster.
_WORDS = (torch.complex128, torch.int64)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_words(*tensors: Tensor) -> tuple[Tensor, ...]:
    """View all ``tensors`` as the widest word dtype every layout allows, else as is.

    The copies here move bytes, never values, so any same-size dtype will do;
    complex128 is simply the widest. All or none, so that source and
    destination keep one dtype. Bits are preserved either way.
    """
    if any(t.numel() == 0 for t in tensors):
        return tensors
    for word in _WORDS:
        if all(t.element_size() < word.itemsize for t in tensors):
            try:
                return tuple(t.view(word) for t in tensors)
            except RuntimeError:
                # Rows not a multiple of the word, or an unaligned view.
                continue
    same = _SAME_SIZE_INT.get(tensors[0].element_size())
    if same is not None and all(t.is_floating_point() for t in tensors):  # float8: index_copy_ has no kernel for it
        return tuple(t.view(same) for t in tensors)
    return tensors


def page_rows(page_ids: Tensor, layer_kv: int, num_pages: int) -> Tensor:
    """Cache row of every block row, in block order ``(block, layer*2+kv, page)``.

    ``page_ids`` is ``[n, ppb]``; returns int64 ``[n * layer_kv * ppb]`` with
    ``rows[b, lk, j] = lk * num_pages + page_ids[b, j]``.
    """
    ids = page_ids.to(torch.int64)
    lk = torch.arange(layer_kv, device=ids.device, dtype=torch.int64) * num_pages
    return (lk[None, :, None] + ids[:, None, :]).reshape(-1)


def _row_views(kv_cache: Tensor, blocks: Tensor, page_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """2-D row views of the cache and the blocks, plus the row index between them."""
    num_layers, _, num_pages, page_size, heads, head_dim = kv_cache.shape
    row = page_size * heads * head_dim
    rows = page_rows(page_ids, 2 * num_layers, num_pages)
    cache2d, blocks2d = as_words(kv_cache.view(-1, row), blocks.view(-1, row))
    return cache2d, blocks2d, rows


def gather_blocks_ref(kv_cache: Tensor, page_ids: Tensor, out: Tensor) -> Tensor:
    """Fill ``out [n, L, 2, bt, H, D]`` with the pages listed in ``page_ids [n, ppb]``."""
    if page_ids.numel() == 0:
        return out
    cache2d, out2d, rows = _row_views(kv_cache, out, page_ids)
    # One pass: each cache row lands directly in its place inside ``out``.
    torch.index_select(cache2d, 0, rows, out=out2d)
    return out


def scatter_blocks_ref(blocks: Tensor, page_ids: Tensor, kv_cache: Tensor) -> None:
    """Write each block of ``blocks [n, L, 2, bt, H, D]`` into its pages; others untouched."""
    if page_ids.numel() == 0:
        return
    cache2d, blocks2d, rows = _row_views(kv_cache, blocks, page_ids)
    cache2d.index_copy_(0, rows, blocks2d)
