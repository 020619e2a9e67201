"""The device stage: batches of CPU tensors to the GPU through a ring of pinned host slots.

::

    producer (loader thread)                            consumer (training thread)
    put(batch) ─► free slot ─► pack every CPU tensor ─► one H2D copy      get(transfer)
                  ▲            into it (page-aligned,    on a side stream,  │ its stream waits on
                  │            pinned)                   event recorded ─►──┤ the event (no host
                  │                                                         │ sync); record_stream
                  └── released by get(); reused only once its event fired ◄─┘

Why a ring of our own rather than ``tensor.pin_memory()`` then ``.to(device)`` per tensor:

* one host->device copy per batch, not one per tensor (a batch's labels are a tiny copy
  that costs as much launch overhead as the images);
* bounded memory: ``slots`` host buffers, each as large as the largest batch it carried
  (or ``slot_bytes``), and at most ``slots`` batches put but not yet taken, so the producer
  cannot run ahead and fill the GPU;
* page-aligned buffers from :func:`fastload.aligned_empty`, registered with
  ``cudaHostRegister`` (the native reader can fill such memory directly), unregistered on
  close; torch's pinned allocator only when registration fails.

No pack at all where the producer writes the batch into the slot itself: :meth:`DeviceRing.empty`
lends the calling thread a tensor inside a free slot (a CPU decoder's output buffer); its
next ``put`` finds the batch's tensors in that slot and copies the slot as it is, packing
only the rest (labels) after them. On an H200 the pack bound the ring at 0.37x a pinned
copy's GB/s even on 8 threads.

A large batch that was not written into a slot is packed by a few threads at once
(``pack_threads``): one thread's copy_ ran at ~5 GB/s, a tenth of what the copy engine takes.
Tensors already on the ring's device (a GPU decoder's output) are not packed: they pass
through, and the consumer's stream waits for an event recorded on the producer's stream when
it put them.

The batch arrives on the device as views into one device buffer per batch (released when
all of them are dropped). On a CPU target the same ring runs unpinned and ``get`` hands out
a copy, so a slot's reuse never touches a batch the consumer still holds; this is how the
ring runs without CUDA and how it is tested there. What touches CUDA (the side stream, events,
the copy, the consumer's wait) goes through a copy engine (:class:`CudaEngine`); tests run the
slot logic on the CPU with an engine whose copies complete only when they say so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fastload.errors import FastloadError
from fastload.reader import aligned_empty
from fastload.resources import usable_cpus

__all__ = [
    "CudaEngine",
    "DeviceRing",
    "HostEngine",
    "RingClosedError",
    "RingTimeoutError",
    "Transfer",
]

log = logging.getLogger(__name__)

_ALIGN = 256  # each tensor's offset in a slot: what cudaMalloc guarantees, ample for any dtype
_GROW_STEP = 64 << 10  # slots grow in 64 KiB steps, so nearly equal batches do not regrow
_COPY_TIMEOUT_S = 120.0  # a host->device copy not done by then means a hung device
_POLL_S = 0.0002
_RECLAIM_S = 0.05  # how often a waiting producer looks for slots of dropped transfers
# A single-threaded copy_ into a slot ran at ~5 GB/s on an H200 host (28 ms for a 154 MB
# batch, on the critical path): large packs are split into pieces copied on a few threads.
_PACK_PIECE_BYTES = 8 << 20
# Room a slot lent by empty() keeps after the batch written into it: the small tensors put
# with it (labels) are packed there.
_LEASE_SPARE = 64 << 10

_FREE, _FILLING, _IN_FLIGHT, _RETIRED = "free", "filling", "in flight", "retired"
# Out of use after limit_slots(), its memory kept until its last copy has completed.
_RETIRING = "retiring"


class RingClosedError(FastloadError, RuntimeError):
    """The ring was closed while a producer waited for a slot, or before a batch was taken."""


class RingTimeoutError(FastloadError, TimeoutError):
    """No slot came free in time, or a host->device copy did not complete in time."""


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True, slots=True)
class _Placed:
    """Where one tensor lives in a slot (and in the batch's device buffer)."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass(frozen=True, slots=True)
class _Packed:
    """Placeholder for the k-th packed tensor in a batch's structure."""

    k: int


@dataclass(frozen=True, slots=True)
class _Direct:
    """Placeholder for a CPU tensor without a plain strided layout (sparse, quantized,
    nested): moved on its own by ``get``, on the consumer's stream."""

    tensor: torch.Tensor


def _map(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with every non-container value replaced by ``leaf(value)``.

    Containers: tuple, list, namedtuple, dict (subclasses keep their type); anything else,
    including strings, is a leaf.
    """
    if isinstance(obj, tuple):
        items = [_map(x, leaf) for x in obj]
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        items = [_map(x, leaf) for x in obj]
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return {k: _map(v, leaf) for k, v in obj.items()}
        try:  # OrderedDict, defaultdict, ...: a copy keeps the type and its extras
            clone = obj.copy()  # type: ignore[attr-defined]
            clone.update({k: _map(v, leaf) for k, v in obj.items()})
            return clone
        except (AttributeError, TypeError):
            return {k: _map(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _regular(t: torch.Tensor) -> bool:
    """Whether a tensor's bytes can be packed into a slot and viewed back."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested


def _view(buffer: torch.Tensor, p: _Placed) -> torch.Tensor:
    return buffer[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)


class _Slot:
    """One host buffer of the ring and the event of the last copy out of it."""

    def __init__(self, index: int, event: Any) -> None:
        self.index = index
        self.state = _FREE
        self.capacity = 0
        self.array: npt.NDArray[np.uint8] | None = None  # aligned_empty memory, if ours
        self.host = torch.empty(0, dtype=torch.uint8)
        self.registered = False  # cudaHostRegister'd: unregister before the memory goes
        self.event = event  # torch.cuda.Event, or None on a CPU target


class Transfer:
    """A batch on its way to the device: hand it to :meth:`DeviceRing.get` exactly once."""

    __slots__ = (
        "_buffer",
        "_layout",
        "_on_device",
        "_ready",
        "_ring",
        "_slot",
        "_taken",
        "_template",
        "nbytes",
    )

    def __init__(
        self,
        ring: DeviceRing,
        slot: _Slot | None,
        template: Any,
        layout: list[_Placed],
        buffer: torch.Tensor | None,
        nbytes: int,
        on_device: list[torch.Tensor] | None = None,
        ready: Any = None,
    ) -> None:
        self._ring = ring
        self._slot = slot
        self._template = template
        self._layout = layout
        self._buffer = buffer
        self._taken = False
        self.nbytes = nbytes  # bytes of tensor data moved for this batch
        # Tensors already on the ring's device (not packed) and the event that follows their
        # making on the producer's stream: the consumer's stream waits for it in get().
        self._on_device = on_device or []
        self._ready = ready

    def __del__(self) -> None:
        # Dropped without get() (a consumer that stopped early): its slot must not be lost,
        # or producers would wait for it forever. deque.append needs no lock, so this is
        # safe whichever thread the garbage collector runs it on.
        if not self._taken and self._slot is not None:
            with contextlib.suppress(Exception):  # at interpreter exit, anything may be gone
                self._ring._dropped.append(self._slot)

    def __repr__(self) -> str:
        where = "taken" if self._taken else "pending"
        return f"Transfer({self.nbytes} bytes, {len(self._layout)} tensors, {where})"


class CudaEngine:
    """The ring's CUDA work: a side stream, an event per slot, the copy out of a slot on that
    stream, and the consumer's stream waiting for it (no host synchronization anywhere)."""

    def __init__(self, device: torch.device) -> None:
        cuda: Any = torch.cuda  # its Stream and Event constructors are untyped
        self.device = device
        self.stream: Any = cuda.Stream(device=device)

    def event(self) -> Any:
        cuda: Any = torch.cuda
        return cuda.Event()

    def copy_out(self, host: torch.Tensor, event: Any) -> torch.Tensor:
        """Starts the copy of ``host`` to the device; ``event`` follows it."""
        # Allocated on the side stream; consumer_waits records the consumer's stream on it, so
        # the caching allocator does not hand the memory out again while the consumer uses it.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            try:
                buffer = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
                buffer.copy_(host, non_blocking=True)
            finally:
                event.record(self.stream)
        return buffer

    def consumer_waits(self, event: Any, buffer: torch.Tensor) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        buffer.record_stream(consumer)


class HostEngine:
    """A CPU target's: the copy out of a slot is a clone, done when it returns."""

    stream: Any = None

    def event(self) -> Any:
        return None

    def copy_out(self, host: torch.Tensor, event: Any) -> torch.Tensor:
        return host.clone()

    def consumer_waits(self, event: Any, buffer: torch.Tensor) -> None:
        pass


def _resolve(device: str | torch.device) -> torch.device:
    want = torch.device(device)
    if want.type == "cpu":
        return torch.device("cpu")
    if want.type != "cuda":
        raise ValueError(f"DeviceRing moves batches to 'cpu' or 'cuda[:k]', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"DeviceRing(device={str(device)!r}) needs a CUDA device, but torch "
            f"{torch.__version__} sees none; install a CUDA build of torch on a GPU machine, "
            "or use device='cpu'"
        )
    index = torch.cuda.current_device() if want.index is None else want.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"DeviceRing(device={str(device)!r}): torch sees {torch.cuda.device_count()} "
            "CUDA devices"
        )
    return torch.device("cuda", index)


def _cudart() -> Any:
    cuda: Any = torch.cuda  # cudart() is untyped
    return cuda.cudart()


def _host_register(ptr: int, nbytes: int, device: torch.device) -> tuple[int, str]:
    """cudaHostRegister on a throwaway thread: (error code, its name).

    A failed call leaves CUDA's per-thread "last error" set, and torch's check after the
    next kernel launch in that thread would report it as its own; the thread takes it away.
    """
    result: list[tuple[int, str]] = [(-1, "not run")]

    def call() -> None:
        try:
            with torch.cuda.device(device):  # not device 0's context on a multi-GPU node
                cudart = _cudart()
                err = cudart.cudaHostRegister(ptr, nbytes, 1)  # 1: cudaHostRegisterPortable
                code = int(err)
                result[0] = (code, "" if code == 0 else str(cudart.cudaGetErrorString(err)))
        except Exception as e:
            result[0] = (-1, f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=call, name="fastload-pin", daemon=True)
    thread.start()
    thread.join()
    return result[0]


def _default_pack_threads() -> int:
    """Half the usable cores, at most 8: enough to beat one thread's memcpy several times
    over, leaving the rest to decoding and the training step."""
    return max(1, min(8, usable_cpus() // 2))


def _layout(tensors: list[torch.Tensor], in_slot: list[int | None]) -> tuple[list[_Placed], int]:
    """Where each tensor goes in a slot, and the bytes used: those already in it stay where
    they are; the others follow the last of them, each aligned."""
    total = 0
    for t, at in zip(tensors, in_slot, strict=True):
        if at is not None:
            total = max(total, at + t.numel() * t.element_size())
    total = _round_up(total, _ALIGN)
    layout = []
    for t, at in zip(tensors, in_slot, strict=True):
        nbytes = t.numel() * t.element_size()
        if at is not None:
            layout.append(_Placed(at, nbytes, t.dtype, t.shape))
        else:
            layout.append(_Placed(total, nbytes, t.dtype, t.shape))
            total += _round_up(nbytes, _ALIGN)
    return layout, total


def _copy_piece(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)


def _offset_in(slot: _Slot | None, t: torch.Tensor) -> int | None:
    """Where a contiguous tensor lies in the slot's memory (bytes from its start), or None."""
    if slot is None or not slot.capacity or not t.is_contiguous():
        return None
    base, ptr = slot.host.data_ptr(), t.data_ptr()
    nbytes = t.numel() * t.element_size()
    if (
        base <= ptr
        and ptr + nbytes <= base + slot.capacity
        and (ptr - base) % t.element_size() == 0
    ):
        return ptr - base
    return None


def _copy_done(slot: _Slot, timeout_s: float) -> float:
    """Waits until the slot's last copy has completed; returns the seconds waited."""
    event = slot.event
    if event is None or event.query():
        return 0.0
    start = time.monotonic()
    while not event.query():
        if time.monotonic() - start > timeout_s:
            raise RingTimeoutError(
                f"a host->device copy out of ring slot {slot.index} has not completed in "
                f"{timeout_s:.0f} s; the GPU may be hung (check nvidia-smi)"
            )
        time.sleep(_POLL_S)
    return time.monotonic() - start


_LEAKED: list[_Slot] = []  # slots whose copy never finished: their memory must stay mapped


def _retire(slot: _Slot) -> None:
    """Takes a slot out of use and frees its memory once no copy reads it; idempotent."""
    if slot.state == _RETIRED:
        return
    slot.state = _RETIRED
    try:
        _copy_done(slot, _COPY_TIMEOUT_S)
    except Exception:  # a hung or lost device: keep the memory mapped, and say so
        log.warning("fastload ring: slot %d is still being copied; its memory is kept", slot.index)
        _LEAKED.append(slot)
        return
    _drop_memory(slot)


def _drop_memory(slot: _Slot) -> None:
    """Unregisters and drops the slot's buffer; its last copy must have completed."""
    if slot.registered and slot.array is not None:
        # At interpreter exit CUDA may be gone already; the process's end unpins anyway.
        with contextlib.suppress(Exception):
            _cudart().cudaHostUnregister(slot.array.ctypes.data)
    slot.registered = False
    slot.array = None
    slot.host = torch.empty(0, dtype=torch.uint8)
    slot.capacity = 0


def _retire_all(slots: list[_Slot]) -> None:
    for slot in slots:
        _retire(slot)


class DeviceRing:
    """Moves (nested) batches of CPU tensors to ``device`` through a ring of page-aligned
    host slots (see the module docstring).

    ``slots``: how many batches may be put and not yet taken. ``slot_bytes``: 0 lets the
    slots grow to the largest batch the ring has carried (host memory stays within
    ``slots`` x that); a positive value fixes every slot at that size and refuses larger
    batches. ``pin``: None pins when the device is CUDA. ``pack_threads``: threads that pack
    a large batch (None: half the usable cores, at most 8; 1: put's thread alone).

    A batch is any nesting of tuples, lists, namedtuples and dicts; CPU tensors in it are
    moved (dtype, shape and values kept; non-contiguous ones too), tensors on another
    device and non-tensor values pass through untouched; CUDA tensors on the ring's device
    pass through too, ordered before the consumer's use of them (see ``get``).

    ``put`` and ``get`` may run on different threads; ``put`` on several. ``close()`` wakes
    a producer waiting for a slot (it raises :class:`RingClosedError`). ``engine``: what does
    the copies (None: :class:`CudaEngine` for a CUDA device, :class:`HostEngine` otherwise;
    tests pass their own).
    """

    def __init__(
        self,
        device: str | torch.device,
        *,
        slots: int = 4,
        slot_bytes: int = 0,
        pin: bool | None = None,
        pack_threads: int | None = None,
        engine: Any = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if slot_bytes < 0:
            raise ValueError(f"slot_bytes must be >= 0 (0: grow as needed), got {slot_bytes}")
        self.device = _resolve(device)
        self._cuda = self.device.type == "cuda"
        if pin and not torch.cuda.is_available():
            raise ValueError(
                "pin=True needs CUDA (torch.cuda.is_available() is False); pass pin=None"
            )
        self.pinned = self._cuda if pin is None else bool(pin)
        if pack_threads is not None and pack_threads < 1:
            raise ValueError(
                f"pack_threads must be >= 1 (1: pack on put's thread), got {pack_threads}"
            )
        self._pack_threads = _default_pack_threads() if pack_threads is None else pack_threads
        self._pool: ThreadPoolExecutor | None = None
        self.slot_bytes = slot_bytes
        if engine is None:
            engine = CudaEngine(self.device) if self._cuda else HostEngine()
        self._engine = engine
        self._stream: Any = engine.stream
        self._slots = [_Slot(i, engine.event()) for i in range(slots)]
        self._lent = threading.local()  # .slot: the slot empty() lent this thread
        self._free: deque[_Slot] = deque(self._slots)
        self._limit = slots  # slots in use at most (limit_slots lowers it)
        self._retiring: list[_Slot] = []  # out of use, their last copy maybe still running
        self._taken_out = 0  # slots limit_slots() took out of use
        self._dropped: deque[_Slot] = deque()  # slots of transfers dropped without get()
        self._cond = threading.Condition()
        self._closed = False
        self._warned_pin = False
        self._stats = {
            "batches": 0,
            "delivered": 0,
            "bytes_moved": 0,
            "wait_slot_s": 0.0,
            "wait_copy_s": 0.0,
            "pack_s": 0.0,
            "grows": 0,
            "packs_split": 0,  # packs spread over the pack threads
            "on_device_tensors": 0,  # tensors already on the device: passed, not packed
            "written_in_slot": 0,  # tensors the producer wrote into a lent slot: not packed
        }
        # Memory registered with CUDA must be unregistered even if close() is never called;
        # not at interpreter exit, though, when CUDA may be half torn down (the process's
        # end unpins its memory anyway).
        self._finalizer = weakref.finalize(self, _retire_all, self._slots)
        self._finalizer.atexit = False

    @property
    def stream(self) -> Any:
        """The side stream the copies run on (None on a CPU target)."""
        return self._stream

    # -- producer -----------------------------------------------------------------------------

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        *,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """A tensor in a free slot's host memory (pinned on CUDA) for the calling thread to
        write a batch into: its next :meth:`put` of a batch holding it (or contiguous views
        of it) copies the slot as it is, without packing.

        The slot is the thread's until that ``put`` (a thread that gives up calls
        :meth:`release`; its next ``empty`` reuses the slot anyway). Waits for a free slot
        as ``put`` does, and for the slot's previous copy to be done.
        """
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        need = _round_up(nbytes, _ALIGN) + _LEASE_SPARE
        if self.slot_bytes and need > self.slot_bytes:
            raise ValueError(
                f"a batch of {nbytes:,} bytes (with room for its labels) does not fit "
                f"DeviceRing's slot_bytes={self.slot_bytes:,}; raise slot_bytes, or pass 0"
            )
        slot: _Slot | None = getattr(self._lent, "slot", None)
        if slot is None or slot.state != _FILLING:
            slot = self._acquire(timeout_s)
        self._lent.slot = None
        try:
            waited = _copy_done(slot, _COPY_TIMEOUT_S)
            grow = need > slot.capacity
            if grow:
                self._grow(slot, need)
        except BaseException:
            with self._cond:
                self._give_back(slot)
            raise
        with self._cond:
            self._stats["wait_copy_s"] += waited
            self._stats["grows"] += grow
        self._lent.slot = slot
        return slot.host[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Gives back the slot :meth:`empty` lent the calling thread, if it holds one."""
        slot: _Slot | None = getattr(self._lent, "slot", None)
        self._lent.slot = None
        if slot is not None and slot.state == _FILLING:
            with self._cond:
                self._give_back(slot)

    def put(self, batch: Any, *, timeout_s: float | None = None) -> Transfer:
        """Packs the batch's CPU tensors into a free slot and starts their copy to the device.

        Waits for a free slot (one whose batch was taken by :meth:`get`) up to ``timeout_s``
        (None: until one frees or the ring is closed), and, if that slot's previous copy is
        still running, for that copy. Returns once the copy is issued, not done.
        """
        tensors: list[torch.Tensor] = []
        on_device: list[torch.Tensor] = []
        lent: _Slot | None = getattr(self._lent, "slot", None)  # this thread's, from empty()
        self._lent.slot = None
        if lent is not None and lent.state != _FILLING:
            lent = None

        def collect(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if value.device.type != "cpu":
                if self._cuda and value.device == self.device:
                    on_device.append(value)  # not packed: already there (a GPU decode's)
                return value
            if not _regular(value):
                return _Direct(value)
            tensors.append(value)
            return _Packed(len(tensors) - 1)

        template = _map(batch, collect)
        ready = None
        if on_device:
            # They were made on this thread's stream; the consumer's stream waits for this
            # point of it (no host sync), as it waits for the copy of the packed ones.
            cuda: Any = torch.cuda
            ready = cuda.Event()
            ready.record(cuda.current_stream(self.device))
        in_slot = [_offset_in(lent, t) for t in tensors]  # written there by the producer
        layout, total = _layout(tensors, in_slot)
        if lent is not None and total > lent.capacity:  # the rest does not fit beside them
            tensors = [
                t.clone() if at is not None else t for t, at in zip(tensors, in_slot, strict=True)
            ]
            in_slot = [None] * len(tensors)
            layout, total = _layout(tensors, in_slot)
        if self.slot_bytes and total > self.slot_bytes:
            raise ValueError(
                f"a batch of {total:,} bytes (with alignment) does not fit DeviceRing's "
                f"slot_bytes={self.slot_bytes:,}; raise slot_bytes, or pass 0 to let slots grow"
            )
        moved = sum(p.nbytes for p in layout)
        if total == 0:  # nothing to copy: no slot needed
            with self._cond:
                if lent is not None:
                    self._give_back(lent)
                if self._closed:
                    raise RingClosedError("put on a closed DeviceRing")
                self._stats["batches"] += 1
                self._stats["on_device_tensors"] += len(on_device)
            return Transfer(self, None, template, layout, None, 0, on_device, ready)
        slot = lent if lent is not None else self._acquire(timeout_s)
        try:
            waited = _copy_done(slot, _COPY_TIMEOUT_S)
            grow = total > slot.capacity
            if grow:
                self._grow(slot, total)
            start = time.perf_counter()
            packing = [k for k, at in enumerate(in_slot) if at is None]
            split = self._pack(
                slot.host, [tensors[k] for k in packing], [layout[k] for k in packing]
            )
            packed = time.perf_counter()
            buffer = self._issue(slot, total)
        except BaseException:
            with self._cond:
                self._give_back(slot)
            raise
        with self._cond:
            self._stats["wait_copy_s"] += waited
            self._stats["pack_s"] += packed - start
            self._stats["grows"] += grow
            self._stats["packs_split"] += split
            self._stats["on_device_tensors"] += len(on_device)
            self._stats["written_in_slot"] += len(tensors) - len(packing)
            if self._closed:
                self._give_back(slot)
                raise RingClosedError("the DeviceRing was closed while this batch was packed")
            slot.state = _IN_FLIGHT
            self._stats["batches"] += 1
            self._stats["bytes_moved"] += moved
        return Transfer(self, slot, template, layout, buffer, moved, on_device, ready)

    def _pack(self, host: torch.Tensor, tensors: list[torch.Tensor], layout: list[_Placed]) -> bool:
        """Copies the tensors into the slot; large ones in pieces along their first dimension
        on the pack threads too (copy_ releases the GIL). Whether it was split."""
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # big: for the pack threads
        with torch.no_grad():
            for t, p in zip(tensors, layout, strict=True):
                if not p.nbytes:
                    continue
                dst = _view(host, p)
                rows = t.shape[0] if t.dim() else 1
                k = min(rows, p.nbytes // _PACK_PIECE_BYTES) if self._pack_threads > 1 else 1
                if k < 2:
                    dst.copy_(t)
                    continue
                step = -(-rows // k)
                pieces += [(dst[a : a + step], t[a : a + step]) for a in range(0, rows, step)]
            if not pieces:
                return False
            futures = []
            pool = self._pack_pool()
            for dst, src in pieces[1:]:
                try:
                    if pool is None:
                        raise RuntimeError("closed")
                    futures.append(pool.submit(_copy_piece, dst, src))
                except RuntimeError:  # the ring was closed meanwhile: copy here
                    dst.copy_(src)
            pieces[0][0].copy_(pieces[0][1])
            for future in futures:
                future.result()
        return True

    def _pack_pool(self) -> ThreadPoolExecutor | None:
        with self._cond:
            if self._pool is None and not self._closed:
                # Started from a producer thread, so the threads inherit its priority.
                self._pool = ThreadPoolExecutor(
                    self._pack_threads - 1, thread_name_prefix="fastload-pack"
                )
            return self._pool

    def _acquire(self, timeout_s: float | None) -> _Slot:
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        with self._cond:
            try:
                while not self._reclaim() and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise RingTimeoutError(
                            f"no DeviceRing slot came free in {timeout_s} s: all "
                            f"{self._in_use()} hold batches not yet taken by get()"
                        )
                    # Woken by get() and close(); the period catches dropped transfers.
                    self._cond.wait(_RECLAIM_S if remaining is None else min(remaining, _RECLAIM_S))
                if self._closed:
                    raise RingClosedError(
                        "the DeviceRing was closed while put() waited for a free slot"
                    )
                slot = self._free.popleft()
                slot.state = _FILLING
                return slot
            finally:
                self._stats["wait_slot_s"] += time.monotonic() - start

    def _grow(self, slot: _Slot, need: int) -> None:
        """Replaces the slot's buffer with one of at least ``need`` bytes (its copy is done).

        A growing slot takes the size of the largest slot too: the batches of one loader are
        alike, and each regrowth costs an allocation and a registration with CUDA.
        """
        largest = max(s.capacity for s in self._slots)
        capacity = self.slot_bytes or max(_round_up(need, _GROW_STEP), largest)
        _drop_memory(slot)
        array = aligned_empty(capacity)
        host = torch.from_numpy(array)
        if self.pinned:
            code, why = _host_register(array.ctypes.data, capacity, self._pin_device())
            if code == 0:
                slot.registered = True
            else:
                if not self._warned_pin:
                    self._warned_pin = True
                    log.warning(
                        "fastload ring: cudaHostRegister of %d bytes failed (%s); using "
                        "torch's pinned allocator instead",
                        capacity,
                        why,
                    )
                host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        # The aligned array stays referenced while it backs the slot (and its registration).
        slot.array = array if slot.registered or not self.pinned else None
        slot.host, slot.capacity = host, capacity

    def _pin_device(self) -> torch.device:
        return self.device if self._cuda else torch.device("cuda", torch.cuda.current_device())

    def _issue(self, slot: _Slot, total: int) -> torch.Tensor:
        """Starts the copy of the slot's first ``total`` bytes; the slot's event follows it
        (on a CPU target the copy is done on return: the slot is free to reuse)."""
        buffer: torch.Tensor = self._engine.copy_out(slot.host[:total], slot.event)
        return buffer

    def _reclaim(self) -> bool:
        """Under the lock: frees the slots of dropped transfers; whether any slot is free."""
        self._sweep()
        while self._dropped:
            slot = self._dropped.popleft()
            if slot.state == _IN_FLIGHT:
                self._give_back(slot)
        return bool(self._free)

    def _give_back(self, slot: _Slot) -> None:
        """Under the lock: the slot is free again (or retired, after close)."""
        if self._closed:
            _retire(slot)
            return
        if self._in_use() > self._limit:  # over limit_slots(): this one leaves
            self._take_out(slot)
            return
        slot.state = _FREE
        self._free.append(slot)
        self._cond.notify()

    # -- how many slots -----------------------------------------------------------------------

    def limit_slots(self, slots: int) -> None:
        """Uses at most ``slots`` slots from now on (never more than before): a loader whose
        prefetch depth was lowered (its batches weigh more than estimated) must not keep the
        memory of the slots it no longer needs. Free slots over the limit leave now (those
        holding no memory first), slots holding a batch as their batch is taken; a slot's
        memory is freed once its last copy has completed. Producers then wait for one of the
        slots that stay."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        with self._cond:
            if self._closed or slots >= self._limit:
                return
            self._limit = slots
            for slot in sorted(self._free, key=lambda s: s.capacity):
                if self._in_use() <= self._limit:
                    break
                self._free.remove(slot)
                self._take_out(slot)
            self._sweep()

    def _in_use(self) -> int:
        """Under the lock: the slots not taken out by limit_slots()."""
        return len(self._slots) - self._taken_out

    def _take_out(self, slot: _Slot) -> None:
        """Under the lock: the slot leaves the ring; its memory goes once its copy is done."""
        slot.state = _RETIRING
        self._taken_out += 1
        self._retiring.append(slot)
        self._sweep()

    def _sweep(self) -> None:
        """Under the lock: frees the memory of taken-out slots whose last copy completed
        (without waiting: a copy still running is looked at again later)."""
        for slot in list(self._retiring):
            if slot.state != _RETIRING:  # retired by close()
                self._retiring.remove(slot)
            elif slot.event is None or slot.event.query():
                slot.state = _RETIRED
                _drop_memory(slot)
                self._retiring.remove(slot)

    # -- consumer -----------------------------------------------------------------------------

    def get(self, transfer: Transfer) -> Any:
        """The batch on the device, with the structure it was put with.

        On CUDA the caller's current stream waits for the copy (no host synchronization) and
        the batch's memory is recorded as used by that stream.
        """
        if transfer._ring is not self:
            raise ValueError("this Transfer was made by another DeviceRing")
        with self._cond:
            if transfer._taken:
                raise ValueError("this Transfer was already taken by get()")
            if self._closed:
                raise RingClosedError("get on a closed DeviceRing; its batches were dropped")
            transfer._taken = True
            self._stats["delivered"] += 1
        slot, buffer = transfer._slot, transfer._buffer
        consumer = torch.cuda.current_stream(self.device) if self._cuda else None
        if consumer is not None and transfer._ready is not None:
            consumer.wait_event(transfer._ready)
            for t in transfer._on_device:  # no reuse by the allocator while the consumer reads
                t.record_stream(consumer)
        if slot is not None:
            try:
                if buffer is not None and slot.event is not None:
                    self._engine.consumer_waits(slot.event, buffer)
            finally:
                with self._cond:
                    self._give_back(slot)
        views = [_view(buffer, p) for p in transfer._layout] if buffer is not None else []

        def unpack(value: Any) -> Any:
            if isinstance(value, _Packed):
                return views[value.k]
            if isinstance(value, _Direct):  # ordered on the consumer's stream
                return value.tensor.to(self.device) if self._cuda else value.tensor.clone()
            return value

        return _map(transfer._template, unpack)

    def discard(self, transfer: Transfer) -> None:
        """Frees the slot of a batch that will never be taken (a consumer stopping early).

        Dropping the last reference to a transfer does the same, a little later.
        """
        if transfer._ring is not self:
            raise ValueError("this Transfer was made by another DeviceRing")
        with self._cond:
            if transfer._taken:
                return
            transfer._taken = True
            if transfer._slot is not None and transfer._slot.state == _IN_FLIGHT:
                self._give_back(transfer._slot)

    # -- lifetime -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since construction (JSON-serializable)."""
        with self._cond:
            self._reclaim()
            return {
                "device": str(self.device),
                "slots": self._in_use(),
                "slots_taken_out": self._taken_out,
                "pinned": self.pinned,
                **self._stats,
                "in_flight": sum(s.state == _IN_FLIGHT for s in self._slots),
                "slot_bytes_held": sum(s.capacity for s in self._slots),
            }

    def slot_buffers(self) -> list[torch.Tensor]:
        """The host buffers of the slots that hold memory (for inspection and tests)."""
        with self._cond:
            return [s.host for s in self._slots if s.capacity]

    def close(self) -> None:
        """Wakes waiting producers, frees every slot once its copy is done; idempotent.

        Batches already taken stay valid. A slot a producer is packing is freed by that
        producer when it finishes.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = [s for s in self._slots if s.state != _FILLING]
            self._free.clear()
            self._cond.notify_all()
            pool, self._pool = self._pool, None
        if pool is not None:  # a pack in progress finishes its pieces
            pool.shutdown(wait=False)
        _retire_all(idle)

    def __enter__(self) -> DeviceRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._in_use()} slots"
        return f"DeviceRing(device={str(self.device)!r}, {state}, pinned={self.pinned})"
