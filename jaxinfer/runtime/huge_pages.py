"""The model's weights in one block of host memory on 2 MiB pages (the CPU backend, Linux).

A decode step reads every weight once. XLA:CPU allocates each array by itself on 4 KiB pages, so
a single-row SmolLM2 step walks 92 MiB of codes and scales through ~23,600 pages, and the CPU
kernels' strided reads (a new page every row of codes or so in the wide matrices) need an
address translation for each. Linux backs a mapping with transparent huge pages where it is
asked to (`madvise`, the default setting of most distributions, or `always`): copying every
weight into one anonymous mapping advised MADV_HUGEPAGE and handing XLA zero-copy views of it
(DLPack) puts the weights on 2 MiB pages, 47 of them for SmolLM2. The arithmetic is untouched
(the same bytes, the same kernels); a single stream decodes ~7% faster, 16-64 rows about as
fast (docs/performance.md, item 12).

Where it cannot apply (another OS, transparent huge pages off, a view XLA would copy) the arrays
are left as they were. While the copy is made both exist, so a model briefly takes twice its
weights' memory on the host."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each array's offset in the arena (XLA:CPU's own alignment)
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


def transparent_huge_pages() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks (`[always]` or
    `[madvise]` selected in sysfs)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _advise_huge(arena: np.ndarray) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(arena.ctypes.data, arena.nbytes, MADV_HUGEPAGE) == 0


def rehome(tree):
    """`tree` with each of its CPU arrays copied into one mapping on huge pages (a zero-copy
    view of it); `tree` itself where that cannot be done. Run before the first step: the
    arrays' values and shapes are unchanged, only where their bytes live."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if not arrays or not transparent_huge_pages():
        return tree
    placements = [leaves[i].devices() for i in arrays]  # a view is one CPU device's array
    if any(len(d) != 1 or next(iter(d)).platform != "cpu" for d in placements):
        return tree
    offsets, size = [], 0
    for i in arrays:
        offsets.append(size)
        size += -(-leaves[i].nbytes // ALIGN) * ALIGN
    # whole huge pages, and one more so the arena can start on a huge-page boundary
    length = (-(-size // HUGE_PAGE) + 1) * HUGE_PAGE
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    arena = whole[start:start + size]  # the views keep the mapping alive, and nothing else does
    if not _advise_huge(whole[start:start + length - HUGE_PAGE]):
        logger.info("madvise(MADV_HUGEPAGE) failed: the weights stay where they are")
        return tree
    out, moved = list(leaves), 0
    for i, off in zip(arrays, offsets):
        if leaves[i].nbytes == 0:
            continue
        a = np.asarray(leaves[i])  # one array's host view at a time
        view = arena[off:off + a.nbytes].view(np.uint8)
        view[...] = a.reshape(-1).view(np.uint8)
        try:  # a dtype DLPack does not carry (bfloat16 from numpy) stays where it is
            array = jnp.from_dlpack(view.view(a.dtype).reshape(a.shape))
        except (BufferError, TypeError, ValueError):
            continue
        if array.unsafe_buffer_pointer() == view.ctypes.data:  # else XLA copied it: no gain
            out[i] = array
            moved += 1
    logger.info("%d of %d weight arrays on huge pages (%.1f MiB)", moved, len(arrays), size / 2**20)
    return jax.tree.unflatten(treedef, out)
