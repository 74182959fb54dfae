"""Strided packings of vLLM's CPU KV pages (vLLM-free).

vLLM's CPU attention packs each (page, head) region of ``2 * page * D``
elements per ISA: token-major, K transposed (the "vec" family), or AMX tiles
(K in groups of 16 tokens with head dims in 32-bit pairs, V in groups of 16
head dims with tokens in pairs). Each of these places element (t, d) of a
half at ``offset + f(t) + g(d)`` where f and g are mixed-radix maps: t (and
d) split into digits, each digit with a stride. `strided_halves` finds those
digits from a learned index, so any such packing, including ones vLLM adds
later, is copied with strided views (one `copy_` per half and run of pages)
instead of a gather through a staging buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch
from torch import Tensor

Axis = tuple[int, int]  # (size, stride), outer digit first


@dataclass(frozen=True, slots=True)
class HalfPacking:
    """Where one half (K or V) of a region puts element (t, d): `offset`
    plus the token digits' and the head-dim digits' strides."""

    offset: int
    tokens: tuple[Axis, ...]
    dims: tuple[Axis, ...]


def strided_halves(index: Tensor) -> tuple[HalfPacking, HalfPacking] | None:
    """K's and V's packing for a region index ``[2, page, D]`` (flat position
    of (kv, t, d)), or None when a half is no sum of mixed-radix maps."""
    halves = []
    for kv in range(2):
        ix = index[kv].long()
        base = int(ix[0, 0])
        ft, fd = ix[:, 0] - base, ix[0, :] - base
        if not bool((ix == base + ft[:, None] + fd[None, :]).all()):
            return None
        tokens, dims = _axes(ft.tolist()), _axes(fd.tolist())
        if tokens is None or dims is None:
            return None
        halves.append(HalfPacking(base, tokens, dims))
    return halves[0], halves[1]


def _axes(f: list[int]) -> tuple[Axis, ...] | None:
    """Digits (size, stride), outer first, such that f[i] is the sum of i's
    mixed-radix digits times their strides; None if f is no such map."""
    n, unit, inner = len(f), 1, []
    while unit < n:
        stride, size = f[unit], 1
        while unit * (size + 1) <= n and all(f[size * unit + r] == size * stride + f[r] for r in range(unit)):
            size += 1
        while (n // unit) % size:  # a digit must divide what is left
            size -= 1
        if size == 1:
            return None
        inner.append((size, stride))
        unit *= size
    return tuple(reversed(inner)) or ((1, 1),)


def copy_half(regions: Tensor, half: HalfPacking, canon: Tensor, into_pages: bool) -> None:
    """Copy between one half of m regions ``[m, H, 2 * page * D]`` and the
    canonical ``[m, k, tokens, H, D]`` (k * tokens = page) in one strided
    copy_: into the pages when `into_pages`, else out of them."""
    regions, half, canon = _widened(regions, half, canon)
    m, k, tokens, heads, dim = canon.shape
    t_sizes = _refine((k, tokens), [s for s, _ in half.tokens])
    d_sizes = _refine((dim,), [s for s, _ in half.dims])
    assert t_sizes is not None and d_sizes is not None, (half, canon.shape)
    t_axes, d_axes = _split(half.tokens, t_sizes), _split(half.dims, d_sizes)
    packed = regions.as_strided(
        (m, heads, *t_sizes, *d_sizes),
        (regions.stride(0), regions.stride(1), *(s for _, s in t_axes), *(s for _, s in d_axes)),
        regions.storage_offset() + half.offset)
    nt = len(t_sizes)
    flat = _unflatten(_unflatten(canon, 4, (dim,), d_sizes), 1, (k, tokens), t_sizes)  # [m, *t, H, *d]
    flat = flat.permute(0, nt + 1, *range(1, nt + 1), *range(nt + 2, flat.dim()))
    if into_pages:
        packed.copy_(flat)
    else:
        flat.copy_(packed)


_WIDER = {4: torch.int32, 8: torch.int64}


def _widened(regions: Tensor, half: HalfPacking, canon: Tensor) -> tuple[Tensor, HalfPacking, Tensor]:
    """The same copy in wider elements when a run of head dims is adjacent on
    both sides (AMX's K pairs, token-major rows): a copy moves words, not
    single bf16 values, which is several times faster."""
    size, stride = half.dims[-1]
    w = next((w for w in (4, 2) if stride == 1 and size % w == 0 and w * canon.element_size() in _WIDER), 0)
    strides = [half.offset, *(s for _, s in half.tokens), *(s for _, s in half.dims[:-1])]
    if not w or any(x % w for x in strides):
        return regions, half, canon
    wide = _WIDER[w * canon.element_size()]
    try:
        regions, canon = regions.view(wide), canon.view(wide)
    except RuntimeError:  # an odd offset or stride: element by element, as given
        return regions, half, canon
    return regions, HalfPacking(half.offset // w, tuple((n, s // w) for n, s in half.tokens),
                                tuple((n, s // w) for n, s in half.dims[:-1]) + ((size // w, 1),)), canon


def _refine(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """The coarsest digits (outer first) that refine both factorizations a
    and b of one number, or None when no such digits exist."""
    cuts = sorted(set(_suffix_products(a)) | set(_suffix_products(b)))
    if prod(a) != prod(b) or any(y % x for x, y in zip(cuts, cuts[1:])):
        return None
    return [y // x for x, y in zip(cuts, cuts[1:])][::-1] or [1]


def _suffix_products(sizes: Sequence[int]) -> list[int]:
    out, p = [1], 1
    for s in reversed(sizes):
        p *= s
        out.append(p)
    return out


def _groups(sizes: Sequence[int], digits: Sequence[int]) -> list[list[int]]:
    """`digits` (a refinement of `sizes`, outer first) grouped by the size each cuts
    (a size of 1 gets no digit)."""
    todo, out = list(digits), []
    for size in sizes:
        parts: list[int] = []
        while prod(parts) < size:
            parts.append(todo.pop(0))
        assert prod(parts) == size, (sizes, digits)
        out.append(parts)
    return out


def _split(axes: Sequence[Axis], sizes: Sequence[int]) -> list[Axis]:
    """`axes` cut into digits of `sizes` (a refinement of their sizes, outer first)."""
    out = []
    for (_, stride), parts in zip(axes, _groups([n for n, _ in axes], sizes)):
        out += [(p, stride * prod(parts[j + 1:])) for j, p in enumerate(parts)]
    return out


def _unflatten(x: Tensor, first: int, sizes: Sequence[int], digits: Sequence[int]) -> Tensor:
    """x with its dims first.. (of `sizes`) cut into `digits` (a refinement, outer first)."""
    d = first
    for parts in _groups(sizes, digits):
        x = x.unflatten(d, parts) if len(parts) > 1 else x if parts else x.squeeze(d)  # a size-1 dim has no digit
        d += len(parts)
    return x
