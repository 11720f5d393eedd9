"""Large CPU buffers of the rounding engine on transparent huge pages (issue 13).

At GPT-2 width a step widens tensors of hundreds of megabytes (the 50257 × 768 embedding and
output head, the 512 × 50257 logits and their gradients) into fresh float64 buffers, and with
4 KB pages the first touch of each page — a fault, the kernel zeroing it — costs several times
the copy itself: widening the embedding takes 119 ms into a fresh buffer, 22 ms into one
advised for 2 MB pages. torch's own switch for that (`THP_MEM_ALLOC_ENABLE=1`) applies to every
allocation from 2 MB, where it slows mid-sized steps (the image CNN's, by a fifth here), so
ovt advises only the buffers it makes itself, and only from `HUGE_FROM` bytes: an anonymous
`mmap` advised `MADV_HUGEPAGE`, which the tensor over it keeps alive and which is unmapped
when that tensor is freed. Elsewhere (no `MADV_HUGEPAGE`: not Linux) the buffers are torch's.
"""

from __future__ import annotations

import mmap

import torch

HUGE_FROM = 1 << 26  # bytes: 64 MiB

_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def copy_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, a new tensor of the same values converted as `copy_` converts them (the
    same operation `to` uses), laid out as `to` lays it out: with `t`'s strides where `t` is
    dense, else contiguous. On huge pages where `t` is a CPU tensor of `HUGE_FROM` bytes or
    more in `dtype`; such a tensor's storage cannot be resized (a caller must not hand it to an
    op that writes it: `out=` forms resize)."""
    size = t.numel() * dtype.itemsize
    if _ADVICE is None or not t.is_cpu or not size or size < HUGE_FROM or t.dtype == dtype:
        return t.to(dtype)
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])  # outermost dimension first
    permuted = t.permute(order)
    dense = permuted.is_contiguous()
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(_ADVICE)
    flat = torch.frombuffer(buffer, dtype=dtype, count=t.numel())
    if not dense:
        return flat.view(t.shape).copy_(t)
    out = flat.view(permuted.shape).permute(_inverse(order))
    return out.copy_(t)


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, d in enumerate(order):
        inverse[d] = position
    return inverse
