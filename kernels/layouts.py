"""Adapters between vLLM's per-layer KV cache layouts and our canonical blocks.

Canonical block buffer: ``[n, L, 2, block_tokens, kv_heads, head_dim]``
contiguous (see ``kernels/paged_copy.py``). vLLM registers one cache tensor
per attention layer, in a backend-specific layout:

- CPU attention: not here. vLLM's CPU backend packs each page according to
  the instruction set it detects (K transposed to ``[head_dim, block_size]``
  on AVX-512, another packing with AMX), so no fixed adapter is right; the
  vLLM connector learns the packing at start-up by writing probe values
  through vLLM's own cache writer (``connectors/vllm/pages.py``).
- CUDA flash-attention: ``[2, num_blocks, block_size, kv_heads, head_dim]``,
  i.e. one layer of our engine's paged cache, so the page-copy Triton kernel
  serves it with one launch per layer; ``block_tokens`` may span several vLLM
  blocks (``page_ids [n, block_tokens // block_size]``).
"""

import torch
from torch import Tensor

from kernels.paged_copy import check_blocks, check_page_ids, launch_copy_pages, require, require_movable, resolve_impl
from kernels.paged_copy_ref import as_words


def _check_layers(layers: list[Tensor], rank: int, what: str) -> Tensor:
    """Check every layer has one shape/dtype/device and is contiguous; return the first."""
    require(len(layers) > 0, "layers must not be empty")
    first = layers[0]
    require(first.dim() == rank, f"each layer must be {what}, got {tuple(first.shape)}")
    require_movable(first.dtype, "layers")
    for i, layer in enumerate(layers):
        require(
            layer.shape == first.shape and layer.dtype == first.dtype and layer.device == first.device,
            f"layer {i} is {tuple(layer.shape)} {layer.dtype} on {layer.device}, "
            f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}",
        )
        require(layer.is_contiguous(), f"layer {i} must be contiguous")
    return first


# ------------------------------------------------------- CUDA flash-attention


def _check_flash(layers: list[Tensor], page_ids: Tensor, unique: bool) -> tuple[Tensor, tuple[int, ...]]:
    """Validate flash-attention ``layers`` and ``page_ids [n, ppb]``.

    Returns the flattened page ids on the layers' device and the canonical
    block shape ``(n, L, 2, ppb * block_size, H, D)``.
    """
    first = _check_layers(layers, 5, "[2, num_blocks, block_size, kv_heads, head_dim]")
    require(first.shape[0] == 2, f"layer dim 0 must be 2 (K, V), got {tuple(first.shape)}")
    _, num_blocks, block_size, heads, head_dim = first.shape
    ids = check_page_ids(page_ids, num_blocks, first.device, unique=unique)
    n_blocks, ppb = page_ids.shape
    return ids, (n_blocks, len(layers), 2, ppb * block_size, heads, head_dim)


def _flash_pairs(layers: list[Tensor], blocks: Tensor, ppb: int):
    """Per (layer, kv, page-in-block j): (vLLM rows [NB, S], block rows [n, S]) as words.

    Both sides are 2-D with contiguous rows, so torch's row-copy fast paths
    apply; the block side is strided across blocks, which costs nothing extra.
    """
    num_blocks, block_size = layers[0].shape[1], layers[0].shape[2]
    n = blocks.shape[0]
    for layer_idx, layer in enumerate(layers):
        for kv in range(2):
            cache = layer[kv].view(num_blocks, -1)
            for j in range(ppb):
                rows = blocks[:, layer_idx, kv, j * block_size : (j + 1) * block_size].view(n, -1)
                yield j, *as_words(cache, rows)


def gather_vllm_flash_ref(layers: list[Tensor], page_ids: Tensor, out: Tensor) -> Tensor:
    """Pure-torch flash-layout gather over validated arguments (the kernel's oracle)."""
    ids = page_ids.to(torch.int64)
    for j, cache, dst in _flash_pairs(layers, out, page_ids.shape[1]):
        torch.index_select(cache, 0, ids[:, j], out=dst)
    return out


def scatter_vllm_flash_ref(blocks: Tensor, page_ids: Tensor, layers: list[Tensor]) -> None:
    """Pure-torch flash-layout scatter over validated arguments (the kernel's oracle)."""
    ids = page_ids.to(torch.int64)
    for j, cache, src in _flash_pairs(layers, blocks, page_ids.shape[1]):
        cache.index_copy_(0, ids[:, j], src)


def gather_vllm_flash(
    layers: list[Tensor], page_ids: Tensor, out: Tensor | None = None, impl: str = "auto"
) -> Tensor:
    """Copy flash-attention pages ``page_ids [n, ppb]`` of every layer into canonical blocks.

    Returns ``out [n, L, 2, ppb * block_size, H, D]`` (allocated when None).
    ``impl`` as in ``kernels.gather_blocks``.
    """
    ids, shape = _check_flash(layers, page_ids, unique=False)
    first = layers[0]
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    else:
        check_blocks(out, shape, first, "out")
    use_torch = resolve_impl(impl, first.device) == "torch"
    if ids.numel() == 0:
        return out
    if use_torch:
        return gather_vllm_flash_ref(layers, ids.view(page_ids.shape), out)
    for layer_idx, layer in enumerate(layers):
        launch_copy_pages(layer, out[:, layer_idx], ids, page_ids.shape[1], out[0].numel(), to_blocks=True)
    return out


def scatter_vllm_flash(blocks: Tensor, page_ids: Tensor, layers: list[Tensor], impl: str = "auto") -> None:
    """Write canonical ``blocks`` into the flash-attention pages ``page_ids [n, ppb]`` of every layer."""
    ids, shape = _check_flash(layers, page_ids, unique=True)
    first = layers[0]
    check_blocks(blocks, shape, first, "blocks")
    use_torch = resolve_impl(impl, first.device) == "torch"
    if ids.numel() == 0:
        return
    if use_torch:
        scatter_vllm_flash_ref(blocks, ids.view(page_ids.shape), layers)
        return
    for layer_idx, layer in enumerate(layers):
        launch_copy_pages(layer, blocks[:, layer_idx], ids, page_ids.shape[1], blocks[0].numel(), to_blocks=False)
