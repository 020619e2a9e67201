"""``fl.DataLoader``: torch's DataLoader, plus fastload's pipeline, device ring and resume.

It *is* a ``torch.utils.data.DataLoader`` (same arguments, defaults, validation errors and
attributes, and ``isinstance`` holds), so a training script changes one import. Then:

- a plain torch dataset iterates exactly as with torch (torch does the work), with batches
  delivered to ``device`` through the pinned ring and an exact ``state_dict()``;
- a fastload dataset (``fl.open_dataset``) takes the fast path: the plan's order for this
  rank, shards staged ahead of use, native reads, ``decode``, collate and the device copy
  on threads (``num_workers`` of them; no worker processes, no CUDA context per worker).

Resume: ``state_dict()`` anywhere mid-epoch; ``load_state_dict()`` makes the next iteration
deliver the rest of that epoch. Through the plan the rest is exact at any world size or
number of workers; for other samplers the sampler's random state is replayed and consumed
batches are skipped without loading them (as torchdata's ``StatefulDataLoader`` does).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud
from torch.utils.data import IterableDataset

from fastload.datasets import open_dataset
from fastload.datasets.base import ShardedDataset
from fastload.decode import choose_backend, make_decoder
from fastload.decode.base import Decoder
from fastload.errors import DatasetMismatchError
from fastload.loader import autotune as tuning
from fastload.loader import prefetch_memory
from fastload.loader.agreement import check_same_dataset
from fastload.loader.batches import BatchBuilder, decodable
from fastload.loader.device_decode import dali_options, decodes_into_slots
from fastload.loader.lookahead import batches_ahead
from fastload.loader.pipeline import Pipeline
from fastload.loader.preemption import PreemptionHandler
from fastload.loader.resume import ResumableIndex, replaying, rng_state, set_rng_state
from fastload.loader.stats import LoaderStats
from fastload.manifest import save_snapshot
from fastload.plan import ResumeState, num_batches
from fastload.remote import public_url
from fastload.resources import memory_share, resources
from fastload.sampler import ShardedSampler

log = logging.getLogger(__name__)

STATE_VERSION = 1
# Steps whose state ``state_dict(step=k)`` can still give (a checkpoint callback may run a
# step or two after the batch it checkpoints was delivered).
DEFAULT_STATE_STEPS = 8
# Bytes of samples staged ahead of the training step, by default.
DEFAULT_LOOKAHEAD_BYTES = 1 << 30
# The loader's threads (and the native ones they start) run this much below the training
# step's: on a machine short of cores the step keeps its core, the loader takes what is left.
DEFAULT_THREAD_NICE = 10
# Objects one staging round asks for at most (the stager keeps 64 in flight).
_STAGE_ROUND_OBJECTS = 512
# The holding area (objects a full pin cache turns away, fetched ahead into memory) holds at
# least this many bytes when the loader sizes it to its staging window.
_MIN_HOLD_BYTES = 64 << 20
_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(tud.DataLoader.__init__).parameters

_live_iterations: weakref.WeakSet[_Iteration] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for iteration in list(_live_iterations):
        iteration.close()


class DataLoader(tud.DataLoader[Any]):
    """A drop-in ``torch.utils.data.DataLoader``; see the module docstring.

    Keyword-only extras: ``device`` (batches arrive there), ``decode`` (None: samples as the
    dataset gives them; "auto"/"dali"/"cpu": decode images, see ``fastload.decode``) with
    ``transform`` (a preset or a callable) and ``on_error``; ``on_change`` ("raise": an
    object changed on the remote since the listing fails its batch, naming it; "skip": its
    samples are left out as ``on_error="skip"`` leaves bad images, counted in
    ``stats()["changed_objects"]``); ``seed`` (the plan's shuffle
    and the augmentations); ``rank``/``world_size`` (default: torch.distributed, else
    torchrun's environment); ``shard`` (None: shard fastload datasets by the plan, leave
    others as torch would); cache settings used when ``dataset`` is a URL; prefetch depth
    (``prefetch_batches``), staging look-ahead (``lookahead_bytes``; at most a quarter of
    an ``lru``/``plan`` cache's ``max_bytes``: ``fastload.loader.lookahead``), ring depth
    (``ring_slots``); ``autotune`` (True, or a dict of bounds: the loader tunes those three
    as it runs, see ``fastload.loader.autotune``).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        decode: str | None = None,
        transform: Any = None,
        seed: int = 0,
        on_error: str = "raise",
        on_change: str = "raise",
        rank: int | None = None,
        world_size: int | None = None,
        shard: bool | None = None,
        cache_dir: str | None = None,
        max_bytes: int | None = None,
        policy: str | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch_batches: int | None = None,
        lookahead_bytes: int | None = None,
        ring_slots: int | None = None,
        thread_nice: int = DEFAULT_THREAD_NICE,
        state_steps: int = DEFAULT_STATE_STEPS,
        on_preempt: str | os.PathLike[str] | None = None,
        autotune: bool | Mapping[str, Any] = False,
    ) -> None:
        cache_settings: dict[str, Any] = {
            "cache_dir": cache_dir,
            "max_bytes": max_bytes,
            "policy": policy,
            "storage_options": storage_options,
        }
        given = {k: v for k, v in cache_settings.items() if v is not None}
        if isinstance(dataset, str):
            dataset = open_dataset(dataset, **given)
        elif given:
            raise ValueError(
                f"{', '.join(given)} apply when the loader opens a dataset from a URL; this "
                "dataset is already open: pass them to fl.open_dataset(url, ...) instead"
            )
        fastload_dataset = isinstance(dataset, ShardedDataset)
        # worker_init_fn and a multiprocessing context ask for worker processes: torch's.
        fast = fastload_dataset and worker_init_fn is None and multiprocessing_context is None
        if decode is not None:
            if not (fast and decodable(dataset)):
                raise ValueError(
                    "decode= decodes the images of a fastload file-folder, tar or Parquet dataset "
                    "(fl.open_dataset) on fastload's threads; "
                    + (
                        "drop worker_init_fn/multiprocessing_context to use it"
                        if fastload_dataset and decodable(dataset)
                        else f"{type(dataset).__name__} is not one: decode in the dataset instead"
                    )
                )
            target = "cpu" if device is None else str(torch.device(device))
            choose_backend(decode, target)  # type: ignore[arg-type]  # raises naming the package
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_change not in ("raise", "skip"):
            raise ValueError(f"on_change must be 'raise' or 'skip', got {on_change!r}")
        if shard is None:
            shard = fastload_dataset
        plan_sampler: ShardedSampler | None = None
        if shard and sampler is None and batch_sampler is None:
            if isinstance(dataset, IterableDataset):
                raise ValueError(
                    "shard=True shards a map-style dataset by fastload's plan; an "
                    "IterableDataset shards itself (get_worker_info, torch.distributed)"
                )
            plan_sampler = ShardedSampler(
                dataset, rank=rank, world_size=world_size, seed=seed, shuffle=bool(shuffle)
            )
            sampler, shuffle = plan_sampler, None
        self._fast = fast  # before torch's __init__, which warns about worker processes
        extra: dict[str, Any] = {}
        if _TORCH_HAS_IN_ORDER:
            extra["in_order"] = in_order
        elif not in_order:
            raise TypeError("in_order needs torch >= 2.6")
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            **extra,
        )
        if prefetch_batches is not None and prefetch_batches < 1:
            raise ValueError(f"prefetch_batches must be >= 1, got {prefetch_batches}")
        if ring_slots is not None and ring_slots < 1:
            raise ValueError(f"ring_slots must be >= 1, got {ring_slots}")
        if state_steps < 1:
            raise ValueError(f"state_steps must be >= 1, got {state_steps}")
        if not 0 <= thread_nice <= 19:
            raise ValueError(
                f"thread_nice must be within 0..19 (a nice increment), got {thread_nice}"
            )
        self.thread_nice = thread_nice
        self.device = None if device is None else torch.device(device)
        self.decode = decode
        self.transform = transform
        self.seed = seed
        self.on_error = on_error
        self.on_change = on_change
        self.prefetch_batches = prefetch_batches
        self.lookahead_bytes = (
            DEFAULT_LOOKAHEAD_BYTES if lookahead_bytes is None else lookahead_bytes
        )
        self.ring_slots = ring_slots
        self._plan_sampler = plan_sampler
        if fast and plan_sampler is not None:
            # Hugging Face accelerate: prepare() keeps this loader as it is (the plan shards
            # by rank, device= places batches; its rebuild would be a plain torch loader) and
            # save_state()/load_state() carry its state_dict().
            self._is_accelerate_prepared = True
            self.use_stateful_dataloader = True
        self._resumable = ResumableIndex(super()._index_sampler, generator)
        self._epoch = 0
        self._pending: dict[str, Any] | None = None
        self._fast_forward = 0  # batches an IterableDataset replays after a resume
        self._agreed = False  # whether the ranks agreed on the dataset (loader/agreement.py)
        self._stats = LoaderStats()
        self._batch_bytes_seen = 0  # the largest first batch of a pass (prefetch_memory)
        self._decoder: Decoder | None = None
        self._builder: BatchBuilder | None = None
        self._ring: Any = None
        self._ring_lock = threading.Lock()  # loader threads make the ring on their first batch
        self._live: weakref.ref[_Iteration] | None = None
        self._closed = False
        self.step = 0  # batches delivered to the training loop so far, across epochs
        # The last state_steps deliveries: (step, where its pass started, its batches and
        # samples then). Where it started, not the pass: a pass dropped (a loop left with
        # break, on SIGTERM) must stop its threads, and its steps' states must stay.
        self._recent: collections.deque[tuple[int, _PassStart, int, int]] = collections.deque(
            maxlen=state_steps
        )
        self._last_start: _PassStart | None = None  # the latest pass's
        self._last_over = False  # whether the latest pass ran to its end
        self._manifest_snapshot: dict[str, str] | None = None
        if autotune and not self._fast:
            raise ValueError("autotune tunes fastload's own threads: give it a fastload dataset")
        self._prefetch_given = prefetch_batches  # the user's (the tuner moves prefetch_batches)
        self._autotune = tuning.make(autotune, self)
        if self._autotune is not None:  # the tuner owns the depth, within its memory bound
            self._fit_memory(None)
        self._preemption: PreemptionHandler | None = None
        if on_preempt is not None:
            self._preemption = PreemptionHandler(on_preempt, _state_of(weakref.ref(self)))
            if isinstance(self.dataset, ShardedDataset):
                # Beside the state, once: the state's handler has only its JSON to write.
                self.save_manifest(self._preemption.path.parent)
            self._preemption.install()

    # --- torch's hooks -------------------------------------------------------------------------

    @property
    def _index_sampler(self) -> Any:
        resumable = self.__dict__.get("_resumable")
        return resumable if resumable is not None else super()._index_sampler

    def check_worker_number_rationality(self) -> None:
        if not self.__dict__.get("_fast"):  # the fast path's workers are threads
            super().check_worker_number_rationality()

    # --- epochs --------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch (the plan's order and the augmentations); the sampler's
        ``set_epoch`` is called too, if it has one. Without calls, each complete pass over a
        fastload dataset moves to the next epoch, as a shuffling torch loader reshuffles."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self._epoch = epoch
        self._last_over = True  # a dropped pass's position no longer says where we are
        set_sampler_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_sampler_epoch):
            set_sampler_epoch(epoch)

    def __len__(self) -> int:
        """Batches in an epoch (samples without batching), a resumed epoch included: the
        whole epoch's count, as torch's loader and torchdata's ``StatefulDataLoader`` give
        after ``load_state_dict``. Trainers count a resumed epoch's batches on from the
        checkpoint's up to ``len()`` (Lightning does), so the rest would end it early."""
        plan: ShardedSampler | None = self.__dict__.get("_plan_sampler")
        if plan is None:
            return super().__len__()
        if self.batch_size is None:
            return plan.num_samples
        return num_batches(plan.num_samples, self.batch_size, drop_last=self.drop_last)

    def _finished(self, iteration: _Iteration) -> None:
        if iteration.start is self._last_start:
            self._last_over = True
        if self._live is not None and self._live() is iteration and self._plan_sampler:
            self.set_epoch(self._epoch + 1)

    # --- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> _Iteration:  # type: ignore[override]
        if self._closed:
            raise ValueError("this DataLoader is closed; make a new one")
        if not self._agreed:  # once, before the first plan: every rank the same dataset
            check_same_dataset(self.dataset)
            self._agreed = True
        pending, self._pending = self._pending, None
        if self._plan_sampler is not None:  # trainers set the sampler's epoch, not the loader's
            self._epoch = self._plan_sampler.epoch
        iteration = self._iter_fast(pending) if self._fast else self._iter_torch(pending)
        self._live = weakref.ref(iteration)
        self._last_start = iteration.start
        self._last_over = False
        _live_iterations.add(iteration)
        return iteration

    def _iter_torch(self, pending: dict[str, Any] | None) -> _Iteration:
        plan_start = self._plan_start()
        start_rng = rng_state(self.generator)  # before the iterator draws its base seed
        sampler_state = self._sampler_state(pending)  # before the iterator moves it
        replay = None if pending is None else pending.get("rng_iter")
        skip = 0 if pending is None or self._fast_forward else int(pending.get("batches", 0))
        index_replay = None if pending is None else pending.get("rng_index")
        with replaying(self.generator, replay), self._resumable.resuming(skip, index_replay):
            source: Iterator[Any] = super().__iter__()
        iteration = _Iteration(
            self,
            source,
            plan_start=plan_start,
            torch_state={
                "rng_iter": replay if replay is not None else start_rng,
                "sampler": sampler_state,
            },
            batches_before=0 if pending is None else int(pending.get("batches", 0)),
        )
        for _ in range(self._fast_forward):  # an IterableDataset: replay what was consumed
            if next(source, None) is None:
                break
        self._fast_forward = 0
        return iteration

    def _iter_fast(self, pending: dict[str, Any] | None) -> _Iteration:
        plan_start = self._plan_start()
        batches_before = 0 if pending is None else int(pending.get("batches", 0))
        index_replay = None if pending is None else pending.get("rng_index")
        with self._resumable.resuming(batches_before, index_replay):
            items = iter(self._resumable)
        builder = self._batch_builder()
        builder.new_pass(self._plan_sampler)
        epoch = self._epoch
        batched = self._auto_collation
        workers = self.num_workers

        def load(seq: int, item: Any) -> tuple[int, Any]:
            return (len(item) if batched else 1), builder.load(item, epoch)

        per_batch = max(1, self._bytes_per_sample() * (self.batch_size or 1))
        ahead = self._batches_ahead(self.lookahead_bytes, per_batch)  # 0: none
        round_batches = max(1, _STAGE_ROUND_OBJECTS // (self.batch_size or 1))
        prefetch = self._prefetch_depth()
        self._size_holding(ahead, prefetch)
        staging = workers > 0 and ahead > 0
        if self._autotune is not None:
            self._autotune.new_pass()
        pipeline = Pipeline(
            items,
            load,
            workers=workers,
            prefetch=prefetch,
            stage=builder.stage if staging else None,
            lookahead=ahead,
            stage_round=round_batches,
            timeout_s=float(self.timeout),
            load_after_stage=staging and builder.holds,
            stats=self._stats,
            nice=self.thread_nice,
        )
        return _Iteration(
            self,
            pipeline,
            plan_start=plan_start,
            torch_state={"rng_iter": None, "sampler": None},
            batches_before=batches_before,
            counted=True,
        )

    def _plan_start(self) -> ResumeState | None:
        return None if self._plan_sampler is None else self._plan_sampler.upcoming_state()

    def _sampler_state(self, pending: dict[str, Any] | None) -> Any:
        if self._plan_sampler is not None:
            return None
        if pending is not None:
            return pending.get("sampler")
        state_dict = getattr(self.sampler, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _size_holding(self, ahead: int, prefetch: int) -> None:
        """Holds what the staging window holds (unless the user sized it)."""
        assert isinstance(self.dataset, ShardedDataset)  # the fast path's datasets
        store = self.dataset.store
        if store.config.fetch.hold_bytes is None:
            per_batch = max(1, self._bytes_per_sample() * (self.batch_size or 1))
            round_batches = max(1, _STAGE_ROUND_OBJECTS // (self.batch_size or 1))
            window = (max(ahead, prefetch) + round_batches) * per_batch
            store.holding.resize(memory_share(max(window, _MIN_HOLD_BYTES), 1 / 8))

    def _batches_ahead(self, lookahead_bytes: int, per_batch: int) -> int:
        """Batches staged ahead: the look-ahead within what the cache's budget keeps."""
        assert isinstance(self.dataset, ShardedDataset)  # the fast path's datasets
        config = self.dataset.store.config
        return batches_ahead(lookahead_bytes, per_batch, config.max_bytes, config.policy)

    def _bytes_per_sample(self) -> int:
        assert isinstance(self.dataset, ShardedDataset)  # the fast path's datasets
        return max(1, self.dataset.store.manifest.total_bytes // len(self.dataset))

    def _batch_builder(self) -> BatchBuilder:
        if self._builder is None:
            assert isinstance(self.dataset, ShardedDataset)
            into_slots = False
            if self.decode is not None:
                target = "cpu" if self.device is None else str(self.device)
                into_slots = decodes_into_slots(
                    self.decode, self.transform, self.device, through_ring=self._moves_to_device()
                )
                if into_slots:  # decoded on the host into the ring's pinned slots
                    target = "cpu"
                self._decoder = make_decoder(
                    self.decode,  # type: ignore[arg-type]
                    transform=self.transform,
                    seed=self.seed,
                    device=target,
                    on_error=self.on_error,
                    num_threads=max(1, self.num_workers),
                    **dali_options(self.decode, target, self.thread_nice),
                )
                self._stats.set_info("decode_backend", self._decoder.backend)
                if into_slots:
                    self._decoder.write_into(self._device_ring().empty)  # type: ignore[attr-defined]
            self._builder = BatchBuilder(
                self.dataset,
                collate_fn=self.collate_fn,
                batched=self._auto_collation,
                decoder=self._decoder,
                stats=self._stats,
                on_device=self._on_device(),
                cuda_device=self._load_stream_device(),
                on_change=self.on_change,
            )
        return self._builder

    # --- the device ----------------------------------------------------------------------------

    def _load_stream_device(self) -> torch.device | None:
        """The CUDA device whose work the loading threads queue on streams of their own: the
        decoder's, when it decodes or transforms there (with the ring, which orders each
        batch before the consumer's use); None when loading does no device work."""
        if self._decoder is None or self.device is None or self.device.type != "cuda":
            return None  # (a CUDA device always goes through the ring)
        target = torch.device(self._decoder.config.device)
        if target.type != "cuda":
            return None
        return (
            target
            if target.index is not None
            else torch.device("cuda", torch.cuda.current_device())
        )

    def _moves_to_device(self) -> bool:
        """Batches go through the ring to an accelerator; on the CPU only when ``ring_slots``
        is given (the same ring, unpinned: it bounds the memory batches in flight hold)."""
        if self.device is None:
            return False
        return self.device.type != "cpu" or self.ring_slots is not None

    def _prefetch_depth(self) -> int:
        """Batches loaded ahead of the training step. Each holds a ring slot until taken, so
        the ring's depth bounds it (a deeper prefetch would wait on the ring forever)."""
        depth = self.prefetch_batches or (self.prefetch_factor or 2) * max(1, self.num_workers)
        if self.prefetch_batches is None:  # the default depth fits the container's memory
            depth = prefetch_memory.bounded_depth(depth, self._batch_bytes())
        if self.ring_slots is not None and self._moves_to_device():
            depth = min(depth, self.ring_slots)
        return depth

    def _batch_bytes(self) -> int:
        """A batch's host bytes: the largest a pass's first batch held, else the estimate
        (batches a decoder leaves on the GPU hold their encoded bytes on the host)."""
        if self._batch_bytes_seen or not isinstance(self.dataset, ShardedDataset):
            return self._batch_bytes_seen
        on_host = self._decoder is None or self._decoder.config.device == "cpu"
        transform = self.transform if self.decode is not None and on_host else None
        return prefetch_memory.estimated_batch_bytes(
            transform, self.batch_size or 1, self._bytes_per_sample()
        )

    def _memory_share(self) -> int | None:
        """The memory the batches loaded ahead (and the one the step holds) may take: the
        container's share for the default depth, autotune's ``max_prefetch_bytes`` for a tuned
        one; None for a depth the user gave, or where no limit is set."""
        if self._autotune is not None:
            return self._autotune.bounds.max_prefetch_bytes
        if self.prefetch_batches is not None:
            return None
        return prefetch_memory.memory_share_bytes()

    def _weigh(self, batch: Any, source: Iterator[Any]) -> None:
        """A pass's first batch says what a batch holds (on its way to the device: the bytes
        its ring slot carries): where the depth is more than such batches fit in the memory
        share, the running pass, the ring and the tuner's bound go shallower too."""
        if self._memory_share() is None:
            return
        if self._decoder is not None and self._decoder.config.device != "cpu":
            return  # decoded on the device: the host holds the encoded bytes (the estimate)
        if isinstance(batch, _InTransfer):
            nbytes = batch.transfer.nbytes
        else:
            nbytes = prefetch_memory.batch_nbytes(batch)
        if nbytes > self._batch_bytes_seen:
            self._batch_bytes_seen = nbytes
            self._fit_memory(source)

    def _fit_memory(self, source: Iterator[Any] | None) -> None:
        """The depth within the memory share for what a batch is now known to hold: the
        tuner's bound and knobs, the running pass, and the ring's slots (one a batch ahead and
        one for the step's, unless ``ring_slots`` was given)."""
        tuner = self._autotune
        deepest = None
        if tuner is not None:
            tuning.fit_memory(tuner, self._batch_bytes(), floor=self._prefetch_given or 1)
            self.prefetch_batches = tuner.knobs.prefetch_batches
            deepest = tuner.bounds.max_prefetch  # the tuner may go deeper, up to this
        depth = self._prefetch_depth()
        if isinstance(source, Pipeline):
            source.limit_prefetch(depth)
        if self._ring is not None and self.ring_slots is None:
            self._ring.limit_slots(max(depth, deepest or depth) + 1)

    def _device_ring(self) -> Any:
        with self._ring_lock:  # one ring: two threads' first batches used to make two
            if self._ring is None:
                from fastload.loader.ring import DeviceRing

                slots = self.ring_slots or self._prefetch_depth() + 1
                self._ring = DeviceRing(self.device, slots=slots)  # type: ignore[arg-type]
            return self._ring

    def _put(self, batch: Any) -> Any:
        return _InTransfer(self._device_ring().put(batch))

    def _deliver(self, batch: Any) -> Any:
        if isinstance(batch, _InTransfer):
            return self._device_ring().get(batch.transfer)
        return batch

    def _on_device(self) -> Callable[[Any], Any] | None:
        """What the fast path's threads do with a finished batch: start its device copy, or
        pin it (``pin_memory`` without ``device``, as torch does), or nothing."""
        if self._moves_to_device():
            return self._put
        if self.pin_memory and torch.cuda.is_available():
            from torch.utils.data._utils.pin_memory import pin_memory

            def pin(batch: Any) -> Any:
                return pin_memory(batch, self.pin_memory_device or None)  # type: ignore[no-untyped-call]

            return pin
        return None

    # --- state ---------------------------------------------------------------------------------

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Where the loader is, as JSON-serializable values: load it into a loader over the
        same dataset (any world size or workers, for a fastload dataset) to continue. A
        fastload dataset's fingerprint goes with it: loading it over another listing fails.

        ``step``: where it was right after delivering step ``step`` (``loader.step`` counts
        the batches delivered), for any of the last ``state_steps`` steps of this pass, so
        that a checkpoint of the model at step k saves the loader at k, whatever the
        loader has prefetched or delivered since."""
        state = self._position(step)
        if self._autotune is not None:
            state["autotune"] = self._autotune.state_dict()
        if isinstance(self.dataset, ShardedDataset):
            state["fingerprint"] = self.dataset.fingerprint
            state["objects"] = len(self.dataset.store.manifest)
        return state

    def _position(self, step: int | None) -> dict[str, Any]:
        state: dict[str, Any] = {"fastload_loader": STATE_VERSION, "epoch": self._epoch}
        state["step"] = self.step
        state["batch_size"] = self.batch_size  # how far ahead `warm --from-state` stages
        if isinstance(self.dataset, ShardedDataset):
            state["dataset"] = self._dataset_state()
        if self._pending is not None:
            return {**self._pending, **state}
        live = None if self._live is None else self._live()
        running = live is not None and not live.finished
        start = None if live is None else live.start
        batches = samples = 0
        if live is not None and running:
            batches, samples = live.batches, live.samples
        if step is None and live is None and self._dropped_mid_pass():
            # A loop left with break (on SIGTERM, say) dropped its pass: the checkpoint
            # taken next is of the batches it delivered, not of the epoch's start again.
            step = self.step
        if step is not None:
            start, batches, samples = self._delivery_at(step)
            running = True
            state["step"] = step
        if self._plan_sampler is not None:
            if running:
                assert start is not None
                assert start.plan_start is not None
                consumed = samples if start.counted else self._consumed_by(start, batches)
                resume = start.plan_start.then(self._plan_sampler.world_size, consumed)
                state["world_size"] = self._plan_sampler.world_size  # the same on every rank
            else:
                resume = self._plan_sampler.upcoming_state()
            state["plan"] = resume.to_dict()
            return state
        if running:
            assert start is not None
            state["batches"] = start.batches_before + batches
            state.update(start.torch_state)
            state["rng_index"] = None if start.index_pass is None else start.index_pass.started_from
        else:
            state["batches"] = 0
            state["rng_iter"] = None if self.generator is None else rng_state(self.generator)
            state["rng_index"] = None
            state["sampler"] = self._sampler_state(None)
        return state

    def _consumed_by(self, start: _PassStart, batches: int) -> int:
        assert self._plan_sampler is not None
        total = start.batches_before + batches
        return min(total * (self.batch_size or 1), len(self._plan_sampler))

    def _dropped_mid_pass(self) -> bool:
        """Whether the latest pass was dropped before its end after delivering this
        loader's latest step."""
        if self._last_over or not self._recent:
            return False
        at, start, _, _ = self._recent[-1]
        return at == self.step and start is self._last_start

    def _delivery_at(self, step: int) -> tuple[_PassStart, int, int]:
        """(where the pass started, its batches, its samples) right after step was
        delivered, in the latest pass (running, over, or dropped by a loop's break)."""
        last = self._last_start
        for at, start, batches, samples in self._recent:
            if at == step and last is not None and start is last:
                return start, batches, samples
        kept = [at for at, start, _, _ in self._recent if start is last]
        where = f"steps {kept[0]}..{kept[-1]}" if kept else "no step of this pass yet"
        raise ValueError(
            f"the loader keeps the state of its last {self._recent.maxlen} steps of the "
            f"running pass ({where}), not step {step}: ask for it sooner, or raise "
            "state_steps"
        )

    def _delivered(self, iteration: _Iteration) -> None:
        self.step += 1
        self._recent.append((self.step, iteration.start, iteration.batches, iteration.samples))

    def _dataset_state(self) -> dict[str, Any]:
        """What a restart needs to find the dataset again without listing it: its URL (no
        credentials), its format and the manifest snapshot saved beside the state, if any."""
        dataset = self.dataset
        assert isinstance(dataset, ShardedDataset)
        state: dict[str, Any] = {
            "url": public_url(dataset.store.config.url),
            "format": dataset.format,
        }
        if self._manifest_snapshot is not None:
            state["manifest"] = self._manifest_snapshot
        return state

    def save_manifest(self, directory: str | os.PathLike[str]) -> dict[str, str]:
        """Saves the dataset's listing into directory (beside a checkpoint) and names it in
        this loader's ``state_dict()``, so that a restart on a node whose cache lacks it
        (``fastload warm --from-state``) does not list the remote again."""
        if not isinstance(self.dataset, ShardedDataset):
            raise ValueError("save_manifest() is for a fastload dataset (fl.open_dataset)")
        self._manifest_snapshot = save_snapshot(self.dataset.store.manifest, Path(directory))
        return self._manifest_snapshot

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next iteration continues from ``state`` (from ``state_dict()``)."""
        if not isinstance(state, Mapping) or state.get("fastload_loader") != STATE_VERSION:
            raise ValueError(
                "not a fastload DataLoader state (expected the dict from loader.state_dict() "
                f"with fastload_loader={STATE_VERSION})"
            )
        saved = state.get("fingerprint")
        dataset = self.dataset
        if (
            saved is not None
            and isinstance(dataset, ShardedDataset)
            and saved != dataset.fingerprint
        ):
            raise DatasetMismatchError(
                f"this state was saved over another listing of the dataset than "
                f"{dataset.store.url} now has ({state.get('objects', '?')} objects "
                f"then, {len(dataset.store.manifest)} now; fingerprint "
                f"{str(saved)[:12]}… then, {dataset.fingerprint[:12]}… now): its "
                "position would be in another plan. Resume over the listing it was "
                "saved with (the same cache directory, without refresh), or start the "
                "epoch again"
            )
        self._drop_iterations()
        if self._autotune is not None and "autotune" in state:  # a resumed job starts tuned
            tuning.resume(self._autotune, self, state["autotune"])
        epoch = int(state.get("epoch", 0))
        self.step = int(state.get("step", 0))
        self._recent.clear()
        if self._plan_sampler is not None:
            if "plan" not in state:
                raise ValueError(
                    "this state comes from a loader without fastload's plan (a custom sampler "
                    "or a plain torch dataset); load it into a loader built the same way"
                )
            self._plan_sampler.load_state_dict(state["plan"])
            self._epoch = self._plan_sampler.epoch
            return
        if "plan" in state:
            raise ValueError(
                "this state comes from a loader sharded by fastload's plan; this loader has "
                "its own sampler: build it the same way as the one that saved the state"
            )
        self._epoch = epoch
        batches = int(state.get("batches", 0))
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])  # type: ignore[attr-defined]
        if batches == 0:  # at an epoch's start: the generator's stream continues from there
            if self.generator is not None and state.get("rng_iter") is not None:
                set_rng_state(self.generator, state["rng_iter"])
            return
        if isinstance(self.dataset, IterableDataset):
            self._fast_forward = batches
        self._pending = dict(state)

    def _drop_iterations(self) -> None:
        live = None if self._live is None else self._live()
        if live is not None:
            live.close()
        self._live = None
        iterator = getattr(self, "_iterator", None)
        if iterator is not None:  # persistent workers: the resumed pass needs fresh ones
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            self._iterator = None

    # --- stats and lifetime ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Per-stage seconds and counts, waits, cache hits and misses, bytes fetched, the
        decode backend: plain values (JSON-serializable)."""
        snapshot = self._stats.snapshot()
        snapshot["path"] = "fastload" if self._fast else "torch"
        snapshot["epoch"] = self._epoch
        snapshot["num_workers"] = self.num_workers
        if self._autotune is not None:
            snapshot["autotune"] = self._autotune.report()
        snapshot["device"] = None if self.device is None else str(self.device)
        snapshot["decode"] = self.decode
        snapshot["resources"] = resources().as_dict()  # the CPUs and memory the defaults read
        if self._fast:
            snapshot["prefetch"] = {
                "batches": self._prefetch_depth(),
                "batch_bytes": self._batch_bytes(),
                "memory_share_bytes": self._memory_share(),  # the share applied to it
            }
        if self._ring is not None:
            snapshot["ring"] = self._ring.stats()
        if self._builder is not None and self._builder.holds:
            snapshot["held"] = self._builder.dataset.store.holding.stats()
        return snapshot

    def close(self) -> None:
        """Stops every thread and worker of this loader and frees its buffers; idempotent."""
        if self.__dict__.get("_closed", True):
            return
        self._closed = True
        if self._preemption is not None:
            self._preemption.uninstall()
        self._drop_iterations()
        if self._decoder is not None:
            self._decoder.close()
        if self._ring is not None:
            self._ring.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit modules may be gone
            self.close()


class _InTransfer:
    """A batch on its way to the device (marks it for the consumer's side of the ring)."""

    def __init__(self, transfer: Any) -> None:
        self.transfer = transfer


@dataclass(frozen=True)
class _PassStart:
    """Where a pass started: with its batches and samples, the state after any of its
    steps, kept after the pass itself is dropped (it holds nothing of its threads)."""

    plan_start: ResumeState | None
    torch_state: dict[str, Any]
    index_pass: Any
    batches_before: int
    counted: bool


class _Iteration:
    """One pass over the loader, as the training loop sees it: counts what was delivered
    (for ``state_dict``), times the waits, and stops its threads when dropped."""

    def __init__(
        self,
        loader: DataLoader,
        source: Iterator[Any],
        *,
        plan_start: ResumeState | None,
        torch_state: dict[str, Any],
        batches_before: int,
        counted: bool = False,
    ) -> None:
        self._loader = loader
        self._source = source
        self._stats = loader._stats
        # The fast path starts the device copy on its threads; torch's batches start it here.
        self._put_here = loader._moves_to_device() and not loader._fast
        self.plan_start = plan_start
        self.torch_state = torch_state
        self.index_pass = loader._resumable.current
        self.batches_before = batches_before
        self.counted = counted  # the source yields (samples, batch) pairs
        self.start = _PassStart(plan_start, torch_state, self.index_pass, batches_before, counted)
        self._batched = loader._auto_collation
        self.batches = 0
        self.samples = 0
        self.finished = False
        self._returned_at: float | None = None

    def __iter__(self) -> _Iteration:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> Any:
        now = time.perf_counter()
        if self._returned_at is not None:
            self._stats.add("step", now - self._returned_at)
        try:
            item = next(self._source)
        except StopIteration:
            self._finish()
            raise
        except BaseException:
            self.close()
            raise
        if self.counted:
            samples, batch = item
        else:
            samples, batch = batch_length(item, self._batched), item
            self._stats.count("batches")
            self._stats.count("samples", samples)
        if self._put_here:
            batch = self._loader._put(batch)
        if self.batches == 0:
            self._loader._weigh(batch, self._source)
        batch = self._loader._deliver(batch)
        self.batches += 1
        self.samples += samples
        self._loader._delivered(self)
        done = time.perf_counter()
        self._stats.add("wait", done - now)
        self._returned_at = done
        if self._loader._autotune is not None:
            tuning.follow(self._loader._autotune, self._loader, self._source, now, done, batch)
        return batch

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.close()
            self._loader._finished(self)

    def close(self) -> None:
        """Stops this pass's threads, or torch's worker processes (unless persistent): now,
        not whenever the garbage collector runs, which may be inside a forked worker."""
        source = self._source
        if isinstance(source, Pipeline):
            source.close()
            return
        persistent = self._loader.__dict__.get("_iterator") is source
        shutdown = getattr(source, "_shutdown_workers", None)
        if not persistent and callable(shutdown):
            shutdown()

    def __del__(self) -> None:
        self.close()


def _state_of(loader: weakref.ref[DataLoader]) -> Callable[[], dict[str, Any] | None]:
    """The loader's state while it lives (the signal handler must not keep it alive)."""

    def state() -> dict[str, Any] | None:
        alive = loader()
        return None if alive is None else alive.state_dict()

    return state


def batch_length(batch: Any, batched: bool) -> int:
    """Samples in a torch-path batch (for stats): the leading size of its first tensor, or
    the length of its first list; 1 without auto-batching."""
    if not batched:
        return 1
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, list | tuple) and batch:
            first = batch[0]
            if not isinstance(first, torch.Tensor | Mapping | list | tuple):
                return len(batch)
            batch = first
        else:
            return 0


__all__ = ["DataLoader", "batch_length"]
