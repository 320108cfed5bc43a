"""A ring of shared-memory batch slots between the isolated loader's process and the loop's.

Use when: reading how `IsolatedLoader` hands a batch over without pickling it: the child
process writes the batch's tensors into a slot (an anonymous shared-memory file, `memfd`), the
loop's process maps the slot once and reads the tensors as views of it, and the slot is given
back when the loop has dropped every tensor of that batch.
Cost: per batch, one copy of its tensors into the slot (a `memcpy` in the child, whose pages
are faulted in once per slot, not once per batch) and a few hundred bytes of layout through
the pipe (tensors under `INLINE_BYTES`, labels and lengths, travel there whole, so a loop that
keeps them does not keep the slot); a slot grows (a new segment) only when a batch outgrows
it; a slot's mapping holds no file descriptor.
Adapt here: `ALIGN` (the bytes each tensor starts on), `INLINE_BYTES`.
Trade-off: a slot is reused only once nothing in the loop's process holds a view of it (a
`weakref.finalize` per tensor's buffer): a loop that keeps its batches makes the ring grow by a
slot per kept batch, as much memory as those batches cost anywhere, never a batch overwritten.
Copy with: nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from typing import Any

import numpy as np
import torch

ALIGN = 64
# Tensors smaller than this travel in the layout, not in the slot: a loop that keeps a batch's
# labels (a metrics list) must not keep its images' slot mapped
INLINE_BYTES = 64 * 1024
_PAGE = mmap.PAGESIZE


def flatten(batch) -> tuple[Any, list[torch.Tensor]]:
    """`(spec, tensors)`: the batch's structure with each tensor (and numpy array) replaced by
    its place in `tensors`; other leaves (ints, strings, None) stay in the spec."""
    tensors: list[torch.Tensor] = []

    def walk(node):
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return ("t", len(tensors) - 1)
        if isinstance(node, np.ndarray) and node.dtype.isnative and node.dtype.kind in "biufc?":
            if not node.flags.c_contiguous:
                node = node.copy(order="C")
            try:  # a dtype torch has (not big-endian, not strings); 0-d stays 0-d
                tensors.append(torch.from_numpy(node))
            except (TypeError, ValueError):  # big-endian, strings: pickled with the layout
                return ("v", node)
            return ("n", len(tensors) - 1)
        if type(node) in (tuple, list):
            return (type(node).__name__, [walk(v) for v in node])
        if isinstance(node, tuple) and hasattr(
            node, "_fields"
        ):  # a namedtuple: its class by reference
            return ("namedtuple", (type(node), [walk(v) for v in node]))
        if type(node) is dict or (
            isinstance(node, dict) and type(node).__module__ == "collections"
        ):
            return ("dict", (type(node), [(k, walk(v)) for k, v in node.items()]))
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
    if kind == "namedtuple":
        return body[0](*(unflatten(s, tensors) for s in body[1]))
    if kind == "dict":
        items = [(k, unflatten(s, tensors)) for k, s in body[1]]
        if body[0] is dict:
            return dict(items)
        return body[0](items)
    return body


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when its elements fill their span in some order of its dimensions
    (contiguous, channels-last as a vision batch is, a transpose); else a contiguous copy."""
    if tensor.is_contiguous():
        return tensor
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.shape[d]))
    expected = 1
    for d in reversed(order):
        if tensor.shape[d] != 1 and tensor.stride(d) != expected:
            return tensor.contiguous()
        expected *= tensor.shape[d]
    return tensor


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def new_segment(size: int):
    """An anonymous shared-memory file of `size` bytes and its mapping: `(fd, mapping)`. No name
    stays behind (a `memfd`, else a temp file unlinked at once): it lives while a process maps
    it or holds its descriptor."""
    size = max(_PAGE, -(-size // _PAGE) * _PAGE)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("recipes-batch-slot", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - macOS
        folder = None
        if os.path.isdir("/dev/shm"):
            folder = "/dev/shm"
        fd, name = tempfile.mkstemp(prefix="recipes-batch-slot-", dir=folder)
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
        return fd, map_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise


def map_shared(fd: int, size: int):
    """A writable shared mapping of `fd` that holds no descriptor (Python's `mmap` keeps a
    duplicate per mapping: a ring of a few hundred slots would use up `ulimit -n`); unmapped
    when the last buffer made from it is gone."""
    libc = _libc()
    if libc is None:  # pragma: no cover - not glibc or macOS libc
        return mmap.mmap(fd, size)
    address = libc.mmap(
        None, ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0
    )
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of a {size}-byte batch slot failed")
    mapping = (ctypes.c_char * size).from_address(address)
    unmap = weakref.finalize(mapping, libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(size))
    unmap.atexit = False  # at exit a tensor may still view it: the process's end unmaps it
    return mapping


def _placed(mapping, tensors: list[torch.Tensor]) -> dict[int, int]:
    """{index: offset} of the tensors whose elements lie in `mapping` (from `slot_tensor`)."""
    if mapping is None or isinstance(mapping, mmap.mmap):
        return {}
    start = ctypes.addressof(mapping)
    size = ctypes.sizeof(mapping)
    found = {}
    for i, tensor in enumerate(tensors):
        low = tensor.data_ptr()
        if (
            _bytes(tensor) >= INLINE_BYTES
            and start <= low
            and low + _bytes(tensor) <= start + size
            and (low - start) % ALIGN == 0
        ):
            found[i] = low - start
    return found


def _size(mapping) -> int:
    return len(mapping) if isinstance(mapping, mmap.mmap) else ctypes.sizeof(mapping)


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.mmap.restype = ctypes.c_void_p
            _LIBC.mmap.argtypes = (
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            )
            _LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        except (OSError, AttributeError):  # pragma: no cover
            _LIBC = False
    return _LIBC or None


_LIBC = None


_TARGET = (
    threading.local()
)  # in the child's pool threads: (ring, slot, bytes used) of the batch being made


def slot_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An empty tensor inside the shared-memory slot the batch being made goes to, so that the
    batch is written in place (no copy into the slot afterwards); None outside the isolated
    loader's child, for a small tensor, or while the slot is too small (its first batch).
    A dataset's `read_batch` calls it for its large output (`torch.empty` when None)."""
    target = getattr(_TARGET, "slot", None)
    if target is None:
        return None
    ring, slot, used = target
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    mapping = ring.maps.get(slot)
    if n < INLINE_BYTES or mapping is None or _size(mapping) < used + _aligned(n):
        return None
    _TARGET.slot = (ring, slot, used + _aligned(n))
    return (
        torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=used).view(dtype).view(shape)
    )


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
        grads = [t.requires_grad for t in tensors]
        tensors = [_dense(t.detach()) for t in tensors]
        mapping = self.maps.get(slot)
        placed = _placed(mapping, tensors)  # made in the slot already (`slot_tensor`): no copy
        used = max(
            (placed[i] + _aligned(_bytes(t)) for i, t in enumerate(tensors) if i in placed),
            default=0,
        )
        need = used + sum(
            _aligned(_bytes(t))
            for i, t in enumerate(tensors)
            if _bytes(t) >= INLINE_BYTES and i not in placed
        )
        fd = None
        if need and (mapping is None or _size(mapping) < need):
            need = sum(_aligned(_bytes(t)) for t in tensors if _bytes(t) >= INLINE_BYTES)
            fd, mapping = new_segment(need + need // 4)  # room for a batch a little larger
            self.maps[slot] = mapping
            # all copied into the new segment
            placed = {}
            used = 0
        layouts = []
        offset = used
        for i, (tensor, grad) in enumerate(zip(tensors, grads, strict=True)):
            n = _bytes(tensor)
            meta = (
                str(tensor.dtype).removeprefix("torch."),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                grad,
            )
            if i in placed:
                layouts.append((*meta, placed[i], n))
                continue
            if n < INLINE_BYTES:  # its bytes in the layout (a label, a length, a mask)
                raw = b""
                if n:
                    flat = tensor.as_strided((tensor.numel(),), (1,))
                    raw = flat.view(torch.uint8).numpy().tobytes()
                layouts.append((*meta, None, raw))
                continue
            dst = torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=offset)
            dst.view(tensor.dtype).as_strided(tensor.shape, tensor.stride()).copy_(tensor)
            layouts.append((*meta, offset, n))
            offset += _aligned(n)
        return layouts, fd

    # ---- in the loop's process ---------------------------------------------------------
    def attach(self, slot: int, fd: int) -> None:
        """Maps the child's new segment for `slot` (a batch still holding the old one keeps it)."""
        try:
            self.maps[slot] = map_shared(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def read(self, slot: int, layouts: list[tuple]) -> list[torch.Tensor]:
        """The slot's tensors as views of it (small ones copied out of the layout); the slot is
        given back when all its views are dropped."""
        mapping = self.maps.get(slot)
        tensors = []
        watched = []
        for dtype, shape, stride, grad, offset, data in layouts:
            dtype = getattr(torch, dtype)
            if offset is None:
                if data:
                    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    tensor = flat.view(dtype).as_strided(shape, stride)
                else:
                    tensor = torch.empty(shape, dtype=dtype)
            else:
                buffer = np.frombuffer(mapping, dtype=np.uint8, count=data, offset=offset)
                watched.append(buffer)
                tensor = torch.from_numpy(buffer).view(dtype).as_strided(shape, stride)
            if grad:
                tensor.requires_grad_(True)
            tensors.append(tensor)
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
