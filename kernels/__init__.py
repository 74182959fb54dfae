"""Triton kernels (with pure-torch references) moving KV between paged caches and blocks."""

from kernels.paged_copy import gather_blocks, scatter_blocks

__all__ = ["gather_blocks", "scatter_blocks"]
