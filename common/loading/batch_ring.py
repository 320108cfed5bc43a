"""A ring of shared-memory batch slots between the isolated loader's process and the loop's.

Use when: reading how `IsolatedLoader` hands a batch over without pickling it: the child
process writes the batch's tensors into a slot (an anonymous shared-memory file, `memfd`), the
loop's process maps the slot once and reads the tensors as views of it, and the slot is given
back when the loop has dropped every tensor of that batch.
Cost: per batch, one copy of its tensors into the slot (a `memcpy` in the child, whose pages
are faulted in once per slot, not once per batch) and a few hundred bytes of layout through
the pipe; a slot grows (a new segment) only when a batch outgrows it.
Adapt here: `ALIGN` (the bytes each tensor starts on).
Trade-off: a slot is reused only once nothing in the loop's process holds a view of it (a
`weakref.finalize` per tensor's buffer): a loop that keeps its batches makes the ring grow by a
slot per kept batch, as much memory as those batches cost anywhere, never a batch overwritten.
Copy with: nothing.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import weakref
from typing import Any

import numpy as np
import torch

ALIGN = 64
_PAGE = mmap.PAGESIZE


def flatten(batch) -> tuple[Any, list[torch.Tensor]]:
    """`(spec, tensors)`: the batch's structure with each tensor (and numpy array) replaced by
    its place in `tensors`; other leaves (ints, strings, None) stay in the spec."""
    tensors: list[torch.Tensor] = []

    def walk(node):
        if isinstance(node, torch.Tensor):
            tensors.append(node.detach())
            return ("t", len(tensors) - 1)
        if isinstance(node, np.ndarray) and node.dtype != object:
            tensors.append(torch.from_numpy(np.ascontiguousarray(node)))
            return ("n", len(tensors) - 1)
        if type(node) in (tuple, list):
            return (type(node).__name__, [walk(v) for v in node])
        if type(node) is dict:
            return ("dict", [(k, walk(v)) for k, v in node.items()])
        return ("v", node)  # a scalar, a string, or anything else: pickled with the layout

    return walk(batch), tensors


def unflatten(spec, tensors: list[torch.Tensor]):
    kind, body = spec
    if kind == "t":
        return tensors[body]
    if kind == "n":
        return tensors[body].numpy()
    if kind in ("tuple", "list"):
        items = [unflatten(s, tensors) for s in body]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: unflatten(s, tensors) for k, s in body}
    return body


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its elements fill their span (contiguous, or channels-last as a
    vision batch is); else a contiguous copy."""
    if tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)):
        return tensor
    return tensor.contiguous()


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def new_segment(size: int) -> tuple[int, mmap.mmap]:
    """An anonymous shared-memory file of `size` bytes and its mapping: `(fd, mapping)`. No name
    stays behind (a `memfd`, else a temp file unlinked at once): it lives while a process maps
    it or holds its descriptor."""
    size = max(_PAGE, -(-size // _PAGE) * _PAGE)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("recipes-batch-slot", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - macOS
        fd, name = tempfile.mkstemp(prefix="recipes-batch-slot-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


class Ring:
    """The slots, as the loop's process holds them (a forked child inherits the mappings).

    `take()` gives a free slot's id (a new one when every slot is in use), `write` (in the
    child) fills a slot, `read` (in the loop's process) returns views of it, each tensor's
    buffer watched so that the slot is free again once the loop dropped them all."""

    def __init__(self):
        self.maps: dict[int, mmap.mmap] = {}
        self._free: list[int] = []
        self._count = 0
        self._live: dict[int, int] = {}  # slot -> buffers of its batch still alive in the loop
        self._lock = threading.Lock()  # finalizers run in whatever thread drops the last view

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._count += 1
            return self._count - 1

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def slots(self) -> int:
        return self._count

    # ---- in the child ------------------------------------------------------------------
    def write(self, slot: int, tensors: list[torch.Tensor]) -> tuple[list[tuple], int | None]:
        """Copies `tensors` into `slot`; returns (their layouts, the fd of a new segment when
        the slot had none or outgrew it: send it to the loop's process, then close it)."""
        tensors = [_dense(t) for t in tensors]
        need = sum(_aligned(_bytes(t)) for t in tensors)
        fd, mapping = None, self.maps.get(slot)
        if mapping is None or len(mapping) < need:
            fd, mapping = new_segment(need + need // 4)  # room for a batch a little larger
            self.maps[slot] = mapping
        layouts, offset = [], 0
        for tensor in tensors:
            n = _bytes(tensor)
            if n:
                dst = torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=offset)
                dst.view(tensor.dtype).as_strided(tensor.shape, tensor.stride()).copy_(tensor)
            layouts.append((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tuple(tensor.stride()),
                            offset, n))
            offset += _aligned(n)
        return layouts, fd

    # ---- in the loop's process ---------------------------------------------------------
    def attach(self, slot: int, fd: int) -> None:
        """Maps the child's new segment for `slot` (a batch still holding the old one keeps it)."""
        try:
            self.maps[slot] = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def read(self, slot: int, layouts: list[tuple]) -> list[torch.Tensor]:
        """The slot's tensors as views of it; the slot is given back when all are dropped."""
        mapping, tensors, watched = self.maps[slot], [], []
        for dtype, shape, stride, offset, n in layouts:
            dtype = getattr(torch, dtype)
            if not n:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            buffer = np.frombuffer(mapping, dtype=np.uint8, count=n, offset=offset)
            watched.append(buffer)
            tensors.append(torch.from_numpy(buffer).view(dtype).as_strided(shape, stride))
        if not watched:
            self.give_back(slot)
            return tensors
        with self._lock:
            self._live[slot] = len(watched)
        for buffer in watched:
            weakref.finalize(buffer, self._dropped, slot)
        return tensors

    def _dropped(self, slot: int) -> None:
        with self._lock:
            self._live[slot] -= 1
            if self._live[slot]:
                return
            del self._live[slot]
            self._free.append(slot)
