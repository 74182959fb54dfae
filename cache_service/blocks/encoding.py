"""Many blocks encoded at once (`TieredStore.store`): one allocation for
the batch, the payloads copied into its rows by as few calls as their form
allows, the payload checksums in one C call, the headers written together
(`rehead`). What one block costs in torch calls here is most of a small
block's store time, so each copy path below exists to avoid a call per block."""
from __future__ import annotations

from typing import Sequence

import torch

from cache_service.blocks.keys import Namespace
from cache_service.blocks.objects import HEADER_SIZE, encode_rows, object_size, rehead
from tiers.host_copy import copy_spans, row_sums
from tiers.types import BlockHash


def encode_many(ns: Namespace, hashes: Sequence[BlockHash],
                payloads: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """`encode` of many blocks: one allocation, each payload copied and hashed
    in one pass (`encode_rows`); the objects are views of its rows. Small
    payloads (up to STACKED_BYTES) are copied by one call (`_stack_into`):
    CPU ones alike in shape and dtype, or one tensor whose rows are the
    blocks (an engine's gathered blocks, from any device)."""
    rows = torch.empty(len(hashes), object_size(ns), dtype=torch.uint8)
    if not _stack_into(rows, ns, payloads):
        encode_rows(rows, ns, hashes, payloads)
        return list(rows.unbind(0))
    rehead(rows, ns, hashes, row_sums(rows.numpy(), HEADER_SIZE))
    return list(rows.unbind(0))


STACKED_BYTES = 64 << 10  # payloads up to this size are copied by one stack per batch


def _stack_into(rows: torch.Tensor, ns: Namespace, payloads: Sequence[torch.Tensor]) -> bool:
    """Copy the payloads into rows[:, HEADER_SIZE:] with one torch call, when
    they are small, on the CPU and all of one shape and dtype holding
    ns.payload_bytes: a view per block costs several torch calls, each of
    which lets the store's writer thread take the GIL (a few us apiece at
    1 KiB blocks, more than the copy). False: nothing copied."""
    if ns.payload_bytes > STACKED_BYTES:  # large blocks: copied and hashed in one pass (encode_rows)
        return False
    if isinstance(payloads, torch.Tensor):
        return _copy_batch(rows, ns, payloads)
    if not payloads:
        return False
    first = payloads[0]
    dtype, numel = first.dtype, first.numel()
    if numel * first.element_size() != ns.payload_bytes or first.dim() == 0 or \
            not first.is_cpu or not all(p.dtype is dtype for p in payloads):
        return False
    if _copy_rows(rows, ns, payloads, numel):
        return True
    out = rows[:, HEADER_SIZE:].view(dtype).view(len(payloads), *first.shape)
    try:  # torch checks the shapes and devices (one dtype: no casting into `out`)
        with torch.no_grad():
            torch.stack(list(payloads), out=out)
    except RuntimeError:
        return False  # encode_rows copies them one by one, or says which one is wrong
    return True


def _copy_batch(rows: torch.Tensor, ns: Namespace, batch: torch.Tensor) -> bool:
    """`_stack_into` of small blocks that are the rows of one tensor: one copy
    (torch casts nothing: the bytes view has the batch's dtype). False: nothing copied."""
    if batch.dim() < 2 or not len(batch) or batch[0].numel() * batch.element_size() != ns.payload_bytes:
        return False
    try:
        with torch.no_grad():
            rows[:, HEADER_SIZE:].view(batch.dtype).view(batch.shape).copy_(batch)
    except RuntimeError:
        return False  # encode_rows copies them row by row, or says which one is wrong
    return True


def _copy_rows(rows: torch.Tensor, ns: Namespace, payloads: Sequence[torch.Tensor], numel: int) -> bool:
    """`_stack_into`'s copy by address, one C call (torch.stack costs a
    microsecond per tensor): when every payload is a contiguous CPU tensor of
    `numel` elements (the dtype is checked by the caller). False: nothing copied."""
    if not all(p.is_cpu and p.is_contiguous() and p.numel() == numel for p in payloads):
        return False
    n, base, stride = ns.payload_bytes, rows.data_ptr() + HEADER_SIZE, rows.stride(0)
    return copy_spans([(base + i * stride, n) for i in range(len(payloads))], [(p.data_ptr(), n) for p in payloads])


def pick(ns: Namespace, payloads: Sequence[torch.Tensor] | torch.Tensor,
         at: Sequence[int]) -> Sequence[torch.Tensor] | torch.Tensor:
    """The payloads at positions `at`: a sequence's items, or a tensor's rows,
    small ones by one index (a copy, which `encode_many` copies at once),
    large ones as views (`encode_rows` copies each in its one pass anyway)."""
    if isinstance(payloads, torch.Tensor) and ns.payload_bytes <= STACKED_BYTES:
        return payloads[torch.tensor(at, dtype=torch.long, device=payloads.device)]
    return [payloads[i] for i in at]
