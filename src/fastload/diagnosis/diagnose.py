"""``fl.doctor``: runs the phases on a loader's settings, predicts, and with ``apply`` checks.

The diagnosis never touches what the user's cache holds: where the measured samples are
not all cached, the phases run on a temporary cache beside it (the cold phase fills it,
or the samples are staged into it first), removed at the end.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastload.datasets.base import ShardedDataset
from fastload.diagnosis import cache_advice, measure, node_ranks, predict
from fastload.diagnosis.measure import PhaseProgress
from fastload.diagnosis.prices import SPOT_DISCOUNT, Price, price_for
from fastload.diagnosis.report import SCHEMA_VERSION, Applied, Fix, Phase, Ranks, Report
from fastload.diagnosis.steps import Step, model_step
from fastload.errors import FastloadError
from fastload.resources import container_note, resources, usable_cpus
from fastload.store import CachedStore

# Seconds each measured phase runs for (it may run over to reach MIN_BATCHES batches).
DEFAULT_PHASE_S = 4.0
# Batches the cold phase measures at most: it reads only their bytes.
COLD_BATCHES = 16
# Settings of fl.DataLoader a diagnosis carries over from the loader it is given.
_LOADER_SETTINGS = (
    "batch_size",
    "num_workers",
    "decode",
    "transform",
    "device",
    "seed",
    "on_error",
    "prefetch_batches",
    "lookahead_bytes",
    "ring_slots",
    "thread_nice",
    "drop_last",
)


class DoctorError(FastloadError, ValueError):
    """A diagnosis cannot run as asked (nothing to read, a bad setting); says what to do."""


def _fastload_version() -> str:
    """``fastload.__version__``, read as the package's top reads it: diagnosis imports the
    modules it needs, never the top-level package (which imports the doctor)."""
    try:
        return version("fastload")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def doctor(
    loader_or_url: Any,
    *,
    step_ms: float | None = None,
    step_holds_gil: bool = False,
    model: str | None = None,
    step: Callable[[Any], object] | None = None,
    gpu: str | None = None,
    price: float | None = None,
    spot: bool = False,
    spot_discount: float = SPOT_DISCOUNT,
    epochs_per_day: float | None = None,
    cold: bool | None = None,
    apply: bool = False,
    phase_s: float = DEFAULT_PHASE_S,
    rank: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    measure_ranks: bool | None = None,
    progress: bool | None = None,
    format: str = "auto",
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_bytes: int | None = None,
    usd_per_gb: float | None = None,
    **loader_settings: Any,
) -> Report:
    """Where the training step waits for data, what that costs, and the fix.

    ``loader_or_url``: an ``fl.DataLoader`` over a fastload dataset (its settings are
    diagnosed, and a step timed by its ``stats()`` stands in for ``step_ms``), or a URL
    with ``fl.DataLoader`` settings as keyword arguments. The step: ``step`` (called with
    each batch), ``model`` (a real model's training step on the loader's device), or
    ``step_ms`` (a sleep, or with ``step_holds_gil`` a busy loop holding the GIL).
    ``cold``: measure the first epoch from the remote too (None: when the cache does not
    hold the measured samples). ``apply``: re-measure with each fix that runs here applied
    (``report.applied_fixes``; ``report.applied`` is the top one). ``usd_per_gb``: the
    remote's price per GB read, for the cache advice's cost of an epoch.
    ``measure_ranks``: with a local world size above 1, run a loader process per rank of
    the node at once and measure each rank's rate against the prediction
    (``report.ranks``); None: when ``local_world_size`` is given here (not when it comes
    from ``LOCAL_WORLD_SIZE``: each rank of a running job would start N more).
    """
    started = time.perf_counter()
    if phase_s <= 0:
        raise ValueError(f"phase_s must be > 0, got {phase_s}")
    usd = price_for(gpu, price, spot=spot, spot_discount=spot_discount)
    dataset, settings, in_place = _target(
        loader_or_url, format, cache_dir, storage_options, max_bytes, loader_settings
    )
    try:
        plan = getattr(loader_or_url, "_plan_sampler", None) if in_place else None
        if plan is not None and rank is None and world_size is None:  # the loader's share
            rank, world_size = plan.rank, plan.world_size
        notes: list[str] = []
        running = loader_or_url if in_place else None
        the_step = _step(step, model, step_ms, step_holds_gil, running, settings, notes)
        world = _world(rank, world_size, local_world_size)
        bar = PhaseProgress(progress)
        # The order the job reads in, for the warm command: a loader's own plan; for a URL,
        # a training job's (shuffled, every sample).
        job_order = (plan.seed, plan.shuffle, plan.drop_last) if plan is not None else None
        with _Diagnosis(
            dataset,
            settings,
            the_step,
            world,
            phase_s,
            bar,
            notes,
            job_order=job_order,
            usd_per_gb=usd_per_gb,
        ) as diagnosis:
            diagnosis.run_phases(cold)
            report = diagnosis.report(usd, epochs_per_day)
            if apply:
                report.applied_fixes = diagnosis.apply_all(report)
                report.applied = report.applied_fixes[0] if report.applied_fixes else None
            if measure_ranks is None:
                measure_ranks = local_world_size is not None
            if measure_ranks and diagnosis.lws > 1:
                report.ranks = diagnosis.measure_ranks(_step_spec(the_step, model, step))
                _note_ranks(report)
        report.budget_s = round(time.perf_counter() - started, 3)
        return report
    finally:
        if not in_place:  # the dataset this call opened
            dataset.close()


class _Diagnosis:
    """One diagnosis: the samples it measures, the phases, the temporary caches they use
    (removed on exit), the report."""

    def __init__(
        self,
        dataset: ShardedDataset,
        settings: dict[str, Any],
        step: Step,
        world: tuple[int, int, int],
        phase_s: float,
        progress: PhaseProgress,
        notes: list[str],
        *,
        job_order: tuple[int, bool, bool] | None = None,
        usd_per_gb: float | None = None,
    ) -> None:
        self.dataset, self.settings, self.step = dataset, settings, step
        self.usd_per_gb = usd_per_gb
        self.job_order = job_order  # (seed, shuffle, drop_last) of the job's plan, if known
        self.rank, self.world_size, self.lws = world
        self.phase_s, self.bar, self.notes = phase_s, progress, notes
        self.batch_size = int(settings.get("batch_size") or 1)
        self.cores = float(usable_cpus())  # affinity and the cgroup's quota
        if note := container_note():
            notes.append(note)
        if self.lws > 1:
            notes.append(
                f"measured in one process on {self.cores:g} cores; with {self.lws} ranks on the "
                f"node each has {self.cores / self.lws:g}: the verdict's figures are predicted "
                "for that share"
            )
        # The measured samples: this rank's first batches of epoch 0, read cold once (at
        # most their bytes), then over and over from the warm cache.
        order = _rank_order(dataset, self.rank, self.world_size, settings)
        self.cold_indices = order[: COLD_BATCHES * self.batch_size]
        self.warm_indices = measure.repeated(
            self.cold_indices, measure.MAX_WARM_BATCHES, self.batch_size
        )
        self.cached = _cached_fraction(dataset, self.cold_indices)
        total = dataset.store.manifest.total_bytes
        self.share_bytes = total * self.lws // self.world_size
        self.budget = dataset.store.config.max_bytes
        self.policy = str(dataset.store.config.policy)
        self.warm_ds = dataset  # the dataset over the cache the warm phases read
        self.phases: dict[str, Phase] = {}
        self.work_dirs: list[Path] = []

    def __enter__(self) -> _Diagnosis:
        return self

    def __exit__(self, *exc: object) -> None:
        # A closed loader's fetch in flight (a slow remote's) may still land in its cache:
        # remove again until it stays removed.
        for attempt in range(20):
            for path in self.work_dirs:
                shutil.rmtree(path, ignore_errors=True)
            if not any(path.exists() for path in self.work_dirs):
                return
            time.sleep(0.1 * (attempt + 1))

    def _run(
        self,
        name: str,
        what: str,
        dataset: ShardedDataset,
        indices: list[int],
        *,
        settings: dict[str, Any] | None = None,
        step: bool = True,
        budget: float = 1.0,
        keep_first: bool = False,
    ) -> tuple[Phase, Any]:
        """A phase of the loader over ``indices`` for ``budget`` phases' time."""
        return measure.run_loader(
            name,
            what,
            _loader(dataset, settings or self.settings, indices),
            step=self.step if step else None,
            budget_s=budget * self.phase_s,
            progress=self.bar,
            keep_first=keep_first,
        )

    def run_phases(self, cold: bool | None) -> None:
        run_cold = self.cached < 0.95 if cold is None else cold
        if self.cached < 1.0 or run_cold:
            self.warm_ds = self._temporary_cache()
        if run_cold:
            self.phases["cold"], _ = self._run(
                "cold",
                "loader + step from the remote into an empty cache "
                f"({len(self.cold_indices):,} samples)",
                self.warm_ds,
                self.cold_indices,
                budget=2,
            )
        else:
            self.phases["cold"] = Phase(
                "cold",
                "loader + step from the remote into an empty cache",
                skipped="the cache holds the measured samples (pass --cold to measure a first "
                "epoch anyway: it reads their bytes from the remote)",
            )
            if self.warm_ds is not self.dataset:
                _stage(self.warm_ds, self.cold_indices)
                self.notes.append(
                    f"staged the {len(self.cold_indices):,} measured samples into a temporary "
                    "cache first: your cache is left as it was"
                )
        self.phases["prep"], first = self._run(
            "prep",
            "the loader alone from a warm cache, batches taken as fast as it makes them",
            self.warm_ds,
            self.warm_indices,
            step=False,
            keep_first=True,
        )
        self.phases["ceiling"] = measure.run_step_alone(
            self.step, first, self.batch_size, budget_s=min(self.phase_s, 3.0), progress=self.bar
        )
        self.phases["train"], _ = self._run(
            "train", "loader + step from a warm cache", self.warm_ds, self.warm_indices
        )
        device = self.settings.get("device")
        self.phases["h2d"] = measure.run_h2d(first, device, self.batch_size, budget_s=1.0)
        if self.budget is not None and self.budget < self.share_bytes:
            self.phases["budget"] = self._steady_epoch(
                "budget", self.budget, self.policy, first=self.phases["cold"].skipped is not None
            )

    def _steady_epoch(
        self, name: str, max_bytes: int | None, policy: str, *, first: bool = False
    ) -> Phase:
        """An epoch after the first with a cache of ``max_bytes`` for the share (scaled to
        the measured samples) under ``policy``: the first epoch staged into it, the next
        read (with the step) in another order, as a shuffled job's next epoch is."""
        import numpy as np

        scale = len(self.cold_indices) / max(1, len(self.dataset) * self.lws // self.world_size)
        budget = None if max_bytes is None else max(1, int(max_bytes * min(1.0, scale)))
        target = self._temporary_cache(max_bytes=budget, policy=policy)
        if first:  # the first epoch measured too: the rate at which every batch misses
            self.phases["first"], _ = self._run(
                "first",
                "loader + step from the remote into an empty cache with the budget",
                target,
                self.cold_indices,
                budget=1.0,
            )
        _stage(target, self.cold_indices)
        # Epochs after the first, each in a new order: enough batches that the rate is not
        # the prefetch queue draining (one epoch of a small share is a few batches).
        rng = np.random.default_rng(len(self.phases))
        order = np.concatenate([rng.permutation(self.cold_indices) for _ in range(3)])
        held = "no budget" if budget is None else f"a budget of {budget:,} bytes"
        phase, _ = self._run(
            name,
            f"loader + step, an epoch after the first, {held}, policy {policy}",
            target,
            [int(i) for i in order],
            budget=2.0,
        )
        return phase

    def measured(self) -> predict.Measured:
        phases, dataset = self.phases, self.dataset
        total = dataset.store.manifest.total_bytes
        return predict.Measured(
            batch_size=self.batch_size,
            workers=int(self.settings.get("num_workers") or 0),
            prefetch=_prefetch_depth(self.settings),
            cores=self.cores,
            cores_per_rank=self.cores / self.lws,
            prep=phases["prep"],
            ceiling=phases["ceiling"],
            train=phases["train"],
            cold=None if phases["cold"].skipped else phases["cold"],
            h2d=None if phases["h2d"].skipped else phases["h2d"],
            budget=phases.get("budget"),
            first=phases.get("first"),
            cached_fraction=self.cached,
            dataset_samples=math.ceil(len(dataset) / self.world_size),
            share_bytes=self.share_bytes,
            cache_budget=self.budget,
            budget_policy=self.policy,
            lookahead_bytes=int(self.settings.get("lookahead_bytes") or _default_lookahead()),
            bytes_per_sample=total / max(1, len(dataset)),
            gpus=self.world_size,
        )

    def report(self, usd: Price, epochs_per_day: float | None) -> Report:
        for phase in self.phases.values():
            if phase.too_few is not None:
                self.notes.append(
                    f"the {phase.name} phase's rate ({phase.samples_per_s:,.0f} samples/s) "
                    f"decides no verdict: {phase.too_few}; run with a longer phase_s"
                )
        m = self.measured()
        model = predict.Model(m)
        basis = predict.basis_phase(m)
        neck = predict.bottleneck(m, model, basis)
        advice = cache_advice.advise(
            share_bytes=self.share_bytes,
            free=cache_advice.free_bytes(
                self.dataset.store.cache.dir, self.dataset.store.cache.used_bytes()
            ),
            budget=self.budget,
            policy=self.policy,
            order_known=self.job_order is not None,
            usd_per_gb=self.usd_per_gb,
        )
        fixes = []
        if neck == "none":
            self.notes.append("nothing to fix on the data side: the step keeps the GPU busy")
        else:
            seed, shuffle, drop_last = self.job_order or (
                int(self.settings.get("seed") or 0),
                True,
                False,
            )
            warm = _warm_command(
                self.dataset, self.rank, self.world_size, self.lws, seed, shuffle, drop_last
            )
            fixes = predict.fixes(
                m,
                model,
                basis,
                usd_per_gpu_hour=usd.usd_per_gpu_hour,
                warm_command=warm,
                dali_rate=self._dali_rate() if neck == "decode" else None,
                advice=advice,
            )
        verdict = predict.verdict(
            m,
            model,
            basis,
            neck,
            usd_per_gpu_hour=usd.usd_per_gpu_hour,
            epochs_per_day=epochs_per_day,
        )
        phases, dataset, per_rank = self.phases, self.dataset, self.cores / self.lws
        return Report(
            schema=SCHEMA_VERSION,
            fastload_version=_fastload_version(),
            url=dataset.store.url,
            dataset={
                "samples": len(dataset),
                "bytes": dataset.store.manifest.total_bytes,
                "format": dataset.format,
                "cached_fraction": round(self.cached, 4),
                "measured_samples": len(self.cold_indices),
            },
            loader={k: _plain(v) for k, v in self.settings.items()},
            node={
                "cores": self.cores,
                "local_world_size": self.lws,
                "world_size": self.world_size,
                "rank": self.rank,
                "cores_per_rank": round(per_rank, 3),
                "loader_cores_beside_step": round(max(0.0, per_rank - model.step_cores), 3),
                # cores other processes kept busy while the loader ran (left out of the model)
                "others_cores": round(model.others, 3),
                "device": _plain(self.settings.get("device")),
                "resources": resources().as_dict(),
            },
            step={
                **self.step.to_dict(),
                "alone_ms": round((phases["ceiling"].step_s or 0) * 1000, 3),
                "beside_loader_ms": round((phases["train"].step_s or 0) * 1000, 3),
                "cores": round(model.step_cores, 3),
            },
            price={**usd.to_dict(), "gpus": self.world_size},
            phases=phases,
            bottleneck=neck,
            verdict=verdict,
            fixes=fixes,
            cache=advice.to_dict(),
            notes=self.notes,
        )

    def measure_ranks(self, step: tuple[Any, ...] | None) -> Ranks:
        """A loader process per rank of this node, all at once, each over its rank's
        first batches of epoch 0 from a warm temporary cache, against the model's rate for
        a rank with the node's cores over the local world size."""
        m = self.measured()
        model = predict.Model(m)
        predicted = self.batch_size / predict.current_s(m, model, m.train)
        ranks, world = node_ranks.node_ranks(self.rank, self.world_size, self.lws)
        if step is None:
            return node_ranks.not_measured(
                ranks,
                predicted_samples_per_s=predicted,
                alone_samples_per_s=self.phases["train"].samples_per_s,
                cores_per_rank=self.cores / self.lws,
                why="the step is a function that does not pickle: pass step_ms (or model) "
                "to measure the node's ranks",
            )
        target = self._temporary_cache()
        jobs = []
        for local, rank in enumerate(ranks):
            order = _rank_order(self.dataset, rank, world, self.settings)
            _stage(target, order)
            jobs.append(
                node_ranks.RankJob(
                    rank=rank,
                    world_size=world,
                    local_rank=local,
                    local_world_size=self.lws,
                    dataset=target,
                    indices=measure.repeated(order, measure.MAX_WARM_BATCHES, self.batch_size),
                    settings=self.settings,
                    step=step,
                    phase_s=self.phase_s,
                )
            )
        return node_ranks.run(
            jobs,
            predicted_samples_per_s=predicted,
            alone_samples_per_s=self.phases["train"].samples_per_s,
            cores_per_rank=self.cores / self.lws,
        )

    def _dali_rate(self) -> float | None:
        """The loader alone with DALI decoding on the GPU: what decode="dali" would deliver;
        None (with a note) where there is no GPU or no DALI to measure it."""
        from fastload.decode import cuda_available, dali_installed

        if self.settings.get("decode") == "dali":
            return None
        device = str(self.settings.get("device") or "")
        if not (device.startswith("cuda") and cuda_available() and dali_installed()):
            self.notes.append(
                "decoding binds: on a GPU node decode='dali' moves it to the GPU (nvJPEG); run "
                "the doctor there with --device cuda to measure it"
                + ("" if dali_installed() else " (pip install 'fastload[dali]')")
            )
            return None
        phase, _ = self._run(
            "dali",
            "the loader alone with decode='dali'",
            self.warm_ds,
            self.warm_indices,
            settings={**self.settings, "decode": "dali"},
            step=False,
            budget=0.5,
        )
        return phase.samples_per_s

    def apply_all(self, report: Report) -> list[Applied]:
        """Re-measures each fix that can run here (best predicted first), each as the
        figure it improves was measured."""
        runnable = [f for f in report.fixes if f.applicable]
        if not runnable:
            why = (
                f" (the top one, {report.fixes[0].name}, needs the node changed)"
                if report.fixes
                else ""
            )
            report.notes.append(f"--apply: no fix to apply here{why}")
        return [self.apply(report, fix) for fix in runnable]

    def apply(self, report: Report, fix: Fix) -> Applied:
        """Re-measures with ``fix``, as the figure it improves was."""
        changed = {
            **self.settings,
            **{k: v for k, v in fix.change.items() if k in _LOADER_SETTINGS},
        }
        phase: Phase | None = None
        if fix.name in ("max_bytes", "policy"):
            phase = self._steady_epoch(
                "applied",
                _int_or_none(fix.change.get("max_bytes", self.budget)),
                str(fix.change.get("policy", self.policy)),
            )
        elif fix.name == "warm":
            target, indices, budget = self._temporary_cache(), self.warm_indices, 1.0
            _stage(target, self.cold_indices)
            what = "after warming the measured samples"
        elif fix.name == "lookahead_bytes":
            target, indices, budget = self._temporary_cache(), self.cold_indices, 2.0
            what = "from the remote into an empty cache"
        else:
            target, indices, budget = self.warm_ds, self.warm_indices, 1.0
            what = "from a warm cache"
        if phase is None:
            phase, _ = self._run(
                "applied",
                f"loader + step {what}, with {fix.name} changed ({fix.change})",
                target,
                indices,
                settings=changed,
                budget=budget,
            )
        ceiling = report.phases["ceiling"].step_s or 0.0
        batch_s = self.batch_size / max(phase.samples_per_s, 1e-9)
        return Applied(
            fix=fix.name,
            change=dict(fix.change),
            predicted_samples_per_s=fix.predicted_samples_per_s,
            measured_samples_per_s=phase.samples_per_s,
            predicted_utilization=fix.predicted_utilization,
            measured_utilization=round(min(1.0, ceiling / batch_s), 4),
            error=round(phase.samples_per_s / max(fix.predicted_samples_per_s, 1e-9) - 1, 4),
            phase=phase,
        )

    def _temporary_cache(
        self, *, max_bytes: int | None = None, policy: str = "lru"
    ) -> ShardedDataset:
        """The dataset over an empty temporary cache beside the user's (the same disk), with
        the same listing: nothing the user's cache holds is touched."""
        import copy

        parent = self.dataset.store.cache.dir.parent
        try:
            where = Path(tempfile.mkdtemp(prefix="fastload-doctor-", dir=parent))
        except OSError:
            where = Path(tempfile.mkdtemp(prefix="fastload-doctor-"))
        self.work_dirs.append(where)
        config = dataclasses.replace(
            self.dataset.store.config,
            cache_dir=str(where),
            max_bytes=max_bytes,
            policy=policy,  # type: ignore[arg-type]  # one of POLICIES: the store's own, or a fix's
            # a trial of a budget share for the data: the entries' bytes, not the metadata
            budget_counts="entries",
            refresh=False,
        )
        clone = copy.copy(self.dataset)
        clone.store = CachedStore(config, manifest=self.dataset.store.manifest)
        return clone


def _target(
    loader_or_url: Any,
    format: str,
    cache_dir: str | None,
    storage_options: dict[str, Any] | None,
    max_bytes: int | None,
    loader_settings: dict[str, Any],
) -> tuple[ShardedDataset, dict[str, Any], bool]:
    """(dataset, fl.DataLoader settings, whether it is a loader the job is running)."""
    if isinstance(loader_or_url, str | os.PathLike):
        from fastload.datasets import open_dataset

        url = os.fspath(loader_or_url)
        dataset = open_dataset(
            url,
            format=format,
            cache_dir=cache_dir,
            storage_options=storage_options,
            max_bytes=max_bytes,
        )
        settings: dict[str, Any] = {"batch_size": 64, "num_workers": 2, **loader_settings}
        if "decode" not in loader_settings:
            from fastload.loader.batches import decodable

            settings["decode"] = "auto" if decodable(dataset) else None
        if settings.get("decode") is not None and "transform" not in loader_settings:
            from fastload.decode import TrainPreset

            settings["transform"] = TrainPreset(224)
        unknown = set(settings) - set(_LOADER_SETTINGS)
        if unknown:
            raise TypeError(f"doctor() got settings fl.DataLoader does not take here: {unknown}")
        return dataset, settings, False
    from fastload.loader import DataLoader

    if not isinstance(loader_or_url, DataLoader):
        raise TypeError(
            f"fl.doctor takes an fl.DataLoader or a dataset URL, got {type(loader_or_url).__name__}"
        )
    if not isinstance(loader_or_url.dataset, ShardedDataset):
        raise DoctorError(
            "fl.doctor diagnoses loaders over fastload datasets (fl.open_dataset); this one "
            f"reads a {type(loader_or_url.dataset).__name__}, which torch's workers load"
        )
    if loader_settings or cache_dir or storage_options or max_bytes:
        raise TypeError("give loader settings when diagnosing a URL; a loader has its own")
    settings = {k: getattr(loader_or_url, k) for k in _LOADER_SETTINGS}
    return loader_or_url.dataset, settings, True


def _world(
    rank: int | None, world_size: int | None, local_world_size: int | None
) -> tuple[int, int, int]:
    from fastload.sampler import resolve_world

    r, w = resolve_world(rank, world_size)
    lws = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or 1
    if lws < 1:
        raise ValueError(f"local_world_size must be >= 1, got {lws}")
    return r, w, lws


def _step(
    fn: Callable[[Any], object] | None,
    model: str | None,
    step_ms: float | None,
    holds_gil: bool,
    in_place: Any,
    settings: dict[str, Any],
    notes: list[str],
) -> Step:
    given = [x is not None for x in (fn, model, step_ms)]
    if sum(given) > 1:
        raise ValueError("give one of step, model and step_ms")
    if fn is not None:
        return Step("callable", fn=fn)
    if model is not None:
        device = str(settings.get("device") or "cpu")
        if device == "cpu":
            notes.append(
                f"{model} runs on the CPU here: its step time is the CPU's, and the loader "
                "shares the cores with it; run on the training node for the GPU's figures"
            )
        size = getattr(settings.get("transform"), "size", 224) or 224
        return model_step(
            model, batch_size=int(settings.get("batch_size") or 1), device=device, image_size=size
        )
    ran = in_place.stats() if in_place is not None else {}
    if step_ms is None and ran.get("step_s_mean"):
        step_ms = ran["step_s_mean"] * 1000
        notes.append(
            f"the step as it ran in this loader ({step_ms:,.1f} ms a batch over "
            f"{ran['batches']:,} batches) is run as a sleep: pass step= to run your own"
        )
    if step_ms is None:
        raise ValueError(
            "say what the training step is: step_ms (its time in ms, as a sleep; with "
            "step_holds_gil a busy loop), model (e.g. resnet50) or step (your function)"
        )
    if step_ms <= 0:
        raise ValueError(f"step_ms must be > 0 (the training step's time), got {step_ms:g}")
    if not (settings.get("device") and str(settings["device"]).startswith("cuda")):
        notes.append(
            f"no GPU step ran: the figures are for a {step_ms:g} ms step "
            + ("holding the GIL" if holds_gil else "that leaves the GIL free")
        )
    return Step("gil" if holds_gil else "sleep", step_ms / 1000)


def _step_spec(
    step: Step, model: str | None, fn: Callable[[Any], object] | None
) -> tuple[Any, ...] | None:
    """How a rank process builds the same step (rank_process.build_step); None where it
    cannot (a function that does not pickle)."""
    if step.kind in ("sleep", "gil"):
        return (step.kind, step.seconds)
    if step.kind == "model" and model is not None:
        run = step.fn
        return (
            "model",
            model,
            getattr(run, "batch_size", 1),
            str(getattr(run, "device", "cpu")),
            getattr(run, "image_size", 224),
        )
    import pickle

    try:
        pickle.dumps(fn)
    except Exception:
        return None
    return ("callable", fn)


def _note_ranks(report: Report) -> None:
    ranks = report.ranks
    if ranks is None:
        return
    if ranks.skipped is not None:
        report.notes.append(f"the node's ranks were not measured: {ranks.skipped}")
        return
    measured = ", ".join(f"{x:,.0f}" for x in ranks.measured_samples_per_s)
    report.notes.append(
        f"{ranks.local_world_size} ranks measured at once, a loader process each: "
        f"{measured} samples/s per rank against {ranks.predicted_samples_per_s:,.0f} "
        f"predicted ({ranks.error:+.0%}; {ranks.alone_samples_per_s:,.0f} alone)"
    )


def _rank_order(
    dataset: ShardedDataset, rank: int, world_size: int, settings: dict[str, Any]
) -> list[int]:
    from fastload.sampler import ShardedSampler

    sampler = ShardedSampler(
        dataset, rank=rank, world_size=world_size, seed=int(settings.get("seed") or 0)
    )
    wanted = COLD_BATCHES * int(settings.get("batch_size") or 1)
    order = []
    for index in sampler:
        order.append(int(index))
        if len(order) >= wanted:
            break
    if not order:
        raise DoctorError(f"{dataset.store.url}: rank {rank} of {world_size} has no samples")
    return order


def _keys(dataset: ShardedDataset, indices: list[int]) -> list[str]:
    shards = dict.fromkeys(dataset.shard_of(i) for i in indices)
    return list(dict.fromkeys(k for s in shards for k in dataset.shard_keys[s]))


def _cached_fraction(dataset: ShardedDataset, indices: list[int]) -> float:
    """The share of the measured samples' objects the cache holds."""
    keys = _keys(dataset, indices)
    located = dataset.store.local_paths(keys)
    return sum(p is not None for p in located) / max(1, len(keys))


def _stage(dataset: ShardedDataset, indices: list[int]) -> None:
    shards = list(dict.fromkeys(dataset.shard_of(i) for i in indices))
    dataset.warm(shards)


def _loader(dataset: ShardedDataset, settings: dict[str, Any], indices: list[int]) -> Any:
    from fastload.loader import DataLoader

    return DataLoader(dataset, sampler=indices, **settings)


def _prefetch_depth(settings: dict[str, Any]) -> int:
    given = settings.get("prefetch_batches")
    return int(given) if given else 2 * max(1, int(settings.get("num_workers") or 0))


def _default_lookahead() -> int:
    from fastload.loader.dataloader import DEFAULT_LOOKAHEAD_BYTES

    return DEFAULT_LOOKAHEAD_BYTES


def _warm_command(
    dataset: ShardedDataset,
    rank: int,
    world_size: int,
    lws: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
) -> str:
    """``fastload warm`` of this node's share, with the plan settings of the job's sampler
    (another order would stage other shards)."""
    first = rank - rank % lws
    ranks = str(first) if lws == 1 else f"{first}..{first + lws - 1}"
    plan = (f" --seed {seed}" if seed else "") + ("" if shuffle else " --no-shuffle")
    plan += " --drop-last" if drop_last else ""
    return (
        f"fastload warm {dataset.store.url} --format {dataset.format} --rank {ranks} "
        f"--world-size {world_size} --epochs 0{plan} --cache-dir {dataset.store.cache.dir}"
    )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _plain(value: Any) -> Any:
    """A setting as JSON takes it (a preset or device as its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    size = getattr(value, "size", None)
    if isinstance(size, int):  # a decode preset: TrainPreset(224) -> "train(224)"
        return f"{type(value).__name__.removesuffix('Preset').lower()}({size})"
    return str(value)
