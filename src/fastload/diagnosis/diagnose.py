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
from pathlib import Path
from typing import Any

import fastload
from fastload.datasets.base import ShardedDataset
from fastload.diagnosis import measure, predict
from fastload.diagnosis.measure import PhaseProgress
from fastload.diagnosis.prices import SPOT_DISCOUNT, price_for
from fastload.diagnosis.report import SCHEMA_VERSION, Applied, Phase, Report
from fastload.diagnosis.steps import Step, model_step
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


class DoctorError(fastload.FastloadError, ValueError):
    """A diagnosis cannot run as asked (nothing to read, a bad setting); says what to do."""


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
    progress: bool | None = None,
    format: str = "auto",
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_bytes: int | None = None,
    **loader_settings: Any,
) -> Report:
    """Where the training step waits for data, what that costs, and the fix.

    ``loader_or_url``: an ``fl.DataLoader`` over a fastload dataset (its settings are
    diagnosed, and a step timed by its ``stats()`` stands in for ``step_ms``), or a URL
    with ``fl.DataLoader`` settings as keyword arguments. The step: ``step`` (called with
    each batch), ``model`` (a real model's training step on the loader's device), or
    ``step_ms`` (a sleep, or with ``step_holds_gil`` a busy loop holding the GIL).
    ``cold``: measure the first epoch from the remote too (None: when the cache does not
    hold the measured samples). ``apply``: re-measure with the top fix applied.
    """
    started = time.perf_counter()
    if phase_s <= 0:
        raise ValueError(f"phase_s must be > 0, got {phase_s}")
    usd = price_for(gpu, price, spot=spot, spot_discount=spot_discount)
    dataset, settings, in_place = _target(
        loader_or_url, format, cache_dir, storage_options, max_bytes, loader_settings
    )
    notes: list[str] = []
    plan = getattr(loader_or_url, "_plan_sampler", None) if in_place else None
    if plan is not None and rank is None and world_size is None:  # the loader's own share
        rank, world_size = plan.rank, plan.world_size
    rank, world_size, lws = _world(rank, world_size, local_world_size)
    batch_size = int(settings.get("batch_size") or 1)
    the_step = _step(
        step, model, step_ms, step_holds_gil, loader_or_url if in_place else None, settings, notes
    )
    bar = PhaseProgress(progress)
    cores = (
        float(len(os.sched_getaffinity(0)))
        if hasattr(os, "sched_getaffinity")
        else float(os.cpu_count() or 1)
    )
    if lws > 1:
        notes.append(
            f"measured in one process on {cores:g} cores; with {lws} ranks on the node each "
            f"has {cores / lws:g}: the verdict's figures are predicted for that share"
        )
    order = _rank_order(dataset, rank, world_size, settings)
    cold_indices = order[: COLD_BATCHES * batch_size]
    cached = _cached_fraction(dataset, cold_indices)
    run_cold = cached < 0.95 if cold is None else cold
    work_dirs: list[Path] = []
    try:
        phases: dict[str, Phase] = {}
        warm_ds = dataset
        if cached < 1.0 or run_cold:
            warm_ds = _on_temporary_cache(dataset, work_dirs)
        if run_cold:
            phases["cold"], _ = measure.run_loader(
                "cold",
                f"loader + step from the remote into an empty cache ({len(cold_indices):,} "
                "samples)",
                _loader(warm_ds, settings, cold_indices),
                step=the_step,
                budget_s=2 * phase_s,
                progress=bar,
            )
        else:
            phases["cold"] = Phase(
                "cold",
                "loader + step from the remote into an empty cache",
                skipped="the cache holds the measured samples (pass --cold to measure a first "
                "epoch anyway: it reads their bytes from the remote)",
            )
        if warm_ds is not dataset and not run_cold:
            _stage(warm_ds, cold_indices)
            notes.append(
                f"staged the {len(cold_indices):,} measured samples into a temporary cache "
                "first: your cache is left as it was"
            )
        warm_indices = measure.repeated(cold_indices, measure.MAX_WARM_BATCHES, batch_size)
        phases["prep"], first = measure.run_loader(
            "prep",
            "the loader alone from a warm cache, batches taken as fast as it makes them",
            _loader(warm_ds, settings, warm_indices),
            step=None,
            budget_s=phase_s,
            progress=bar,
            keep_first=True,
        )
        phases["ceiling"] = measure.run_step_alone(
            the_step, first, batch_size, budget_s=min(phase_s, 3.0), progress=bar
        )
        phases["train"], _ = measure.run_loader(
            "train",
            "loader + step from a warm cache",
            _loader(warm_ds, settings, warm_indices),
            step=the_step,
            budget_s=phase_s,
            progress=bar,
        )
        phases["h2d"] = measure.run_h2d(first, settings.get("device"), batch_size, budget_s=1.0)
        del first
        m = predict.Measured(
            batch_size=batch_size,
            workers=int(settings.get("num_workers") or 0),
            prefetch=_prefetch_depth(settings),
            cores=cores,
            cores_per_rank=cores / lws,
            prep=phases["prep"],
            ceiling=phases["ceiling"],
            train=phases["train"],
            cold=None if phases["cold"].skipped else phases["cold"],
            h2d=None if phases["h2d"].skipped else phases["h2d"],
            cached_fraction=cached,
            dataset_samples=math.ceil(len(dataset) / world_size),
            share_bytes=dataset.store.manifest.total_bytes * lws // world_size,
            cache_budget=dataset.store.cache.config.max_bytes,
            lookahead_bytes=int(settings.get("lookahead_bytes") or _default_lookahead()),
            bytes_per_sample=dataset.store.manifest.total_bytes / max(1, len(dataset)),
            gpus=world_size,
        )
        model_fit = predict.Model(m)
        basis = predict.basis_phase(m)
        neck = predict.bottleneck(m, model_fit, basis)
        dali_rate = None
        if neck == "decode" and settings.get("decode") != "dali":
            dali_rate = _dali_rate(warm_ds, settings, warm_indices, phase_s, bar, notes)
        fixes = (
            []
            if neck == "none"
            else predict.fixes(
                m,
                model_fit,
                basis,
                usd_per_gpu_hour=usd.usd_per_gpu_hour,
                warm_command=_warm_command(dataset, rank, world_size, lws, settings),
                dali_rate=dali_rate,
            )
        )
        if neck == "none":
            notes.append("nothing to fix on the data side: the step keeps the GPU busy")
        verdict = predict.verdict(
            m,
            model_fit,
            basis,
            neck,
            usd_per_gpu_hour=usd.usd_per_gpu_hour,
            epochs_per_day=epochs_per_day,
        )
        report = Report(
            schema=SCHEMA_VERSION,
            fastload_version=fastload.__version__,
            url=dataset.store.url,
            dataset={
                "samples": len(dataset),
                "bytes": dataset.store.manifest.total_bytes,
                "format": dataset.format,
                "cached_fraction": round(cached, 4),
                "measured_samples": len(cold_indices),
            },
            loader={k: _plain(v) for k, v in settings.items()},
            node={
                "cores": cores,
                "local_world_size": lws,
                "world_size": world_size,
                "rank": rank,
                "cores_per_rank": round(cores / lws, 3),
                "loader_cores_beside_step": round(max(0.0, cores / lws - model_fit.step_cores), 3),
                "device": _plain(settings.get("device")),
            },
            step={
                **the_step.to_dict(),
                "alone_ms": round((phases["ceiling"].step_s or 0) * 1000, 3),
                "beside_loader_ms": round((phases["train"].step_s or 0) * 1000, 3),
                "cores": round(model_fit.step_cores, 3),
            },
            price={**usd.to_dict(), "gpus": world_size},
            phases=phases,
            bottleneck=neck,
            verdict=verdict,
            fixes=fixes,
            notes=notes,
        )
        if apply:
            report.applied = _apply(
                report,
                dataset,
                warm_ds,
                settings,
                the_step,
                cold_indices,
                warm_indices,
                phase_s,
                bar,
                work_dirs,
            )
        report.budget_s = round(time.perf_counter() - started, 3)
        return report
    finally:
        for path in work_dirs:
            shutil.rmtree(path, ignore_errors=True)
        if not in_place:  # the dataset this call opened
            dataset.close()


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


def _on_temporary_cache(dataset: ShardedDataset, work_dirs: list[Path]) -> ShardedDataset:
    """The dataset over an empty temporary cache beside the user's (the same disk), with the
    same listing: nothing the user's cache holds is touched."""
    import copy

    parent = dataset.store.cache.dir.parent
    try:
        where = Path(tempfile.mkdtemp(prefix="fastload-doctor-", dir=parent))
    except OSError:
        where = Path(tempfile.mkdtemp(prefix="fastload-doctor-"))
    work_dirs.append(where)
    config = dataclasses.replace(
        dataset.store.config, cache_dir=str(where), max_bytes=None, refresh=False
    )
    clone = copy.copy(dataset)
    clone.store = CachedStore(config, manifest=dataset.store.manifest)
    return clone


def _stage(dataset: ShardedDataset, indices: list[int]) -> None:
    shards = list(dict.fromkeys(dataset.shard_of(i) for i in indices))
    dataset.warm(shards)


def _loader(dataset: ShardedDataset, settings: dict[str, Any], indices: list[int]) -> Any:
    from fastload.loader import DataLoader

    return DataLoader(dataset, sampler=indices, **settings)


def _dali_rate(
    dataset: ShardedDataset,
    settings: dict[str, Any],
    indices: list[int],
    phase_s: float,
    bar: PhaseProgress,
    notes: list[str],
) -> float | None:
    """The loader alone with DALI decoding on the GPU: what decode="dali" would deliver;
    None (with a note) where there is no GPU or no DALI to measure it."""
    from fastload.decode import cuda_available, dali_installed

    device = str(settings.get("device") or "")
    if not (device.startswith("cuda") and cuda_available() and dali_installed()):
        notes.append(
            "decoding binds: on a GPU node decode='dali' moves it to the GPU (nvJPEG); run "
            "the doctor there with --device cuda to measure it"
            + ("" if dali_installed() else " (pip install 'fastload[dali]')")
        )
        return None
    phase, _ = measure.run_loader(
        "dali",
        "the loader alone with decode='dali'",
        _loader(dataset, {**settings, "decode": "dali"}, indices),
        step=None,
        budget_s=phase_s / 2,
        progress=bar,
    )
    return phase.samples_per_s


def _prefetch_depth(settings: dict[str, Any]) -> int:
    given = settings.get("prefetch_batches")
    return int(given) if given else 2 * max(1, int(settings.get("num_workers") or 0))


def _default_lookahead() -> int:
    from fastload.loader.dataloader import DEFAULT_LOOKAHEAD_BYTES

    return DEFAULT_LOOKAHEAD_BYTES


def _warm_command(
    dataset: ShardedDataset, rank: int, world_size: int, lws: int, settings: dict[str, Any]
) -> str:
    first = rank - rank % lws
    ranks = str(first) if lws == 1 else f"{first}..{first + lws - 1}"
    seed = int(settings.get("seed") or 0)
    cache = f" --cache-dir {dataset.store.cache.dir}"
    return (
        f"fastload warm {dataset.store.url} --format {dataset.format} --rank {ranks} "
        f"--world-size {world_size} --epochs 0" + (f" --seed {seed}" if seed else "") + cache
    )


def _plain(value: Any) -> Any:
    """A setting as JSON takes it (a preset or device as its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    size = getattr(value, "size", None)
    if isinstance(size, int):  # a decode preset: TrainPreset(224) -> "train(224)"
        return f"{type(value).__name__.removesuffix('Preset').lower()}({size})"
    return str(value)


def _apply(
    report: Report,
    dataset: ShardedDataset,
    warm_ds: ShardedDataset,
    settings: dict[str, Any],
    step: Step,
    cold_indices: list[int],
    warm_indices: list[int],
    phase_s: float,
    bar: PhaseProgress,
    work_dirs: list[Path],
) -> Applied | None:
    """Re-measures with the top fix that can run here, as the figure it improves was."""
    fix = next((f for f in report.fixes if f.applicable), None)
    if fix is None:
        report.notes.append(
            "--apply: no fix to apply here"
            + (
                f" (the top one, {report.fixes[0].name}, needs the node changed)"
                if report.fixes
                else ""
            )
        )
        return None
    changed = {**settings, **{k: v for k, v in fix.change.items() if k in _LOADER_SETTINGS}}
    if fix.name == "warm":
        target = _on_temporary_cache(dataset, work_dirs)
        _stage(target, cold_indices)
        indices, budget, what = warm_indices, phase_s, "after warming the measured samples"
    elif fix.name == "lookahead_bytes":
        target = _on_temporary_cache(dataset, work_dirs)
        indices, budget, what = cold_indices, 2 * phase_s, "from the remote into an empty cache"
    else:
        target, indices, budget, what = warm_ds, warm_indices, phase_s, "from a warm cache"
    phase, _ = measure.run_loader(
        "applied",
        f"loader + step {what}, with {fix.name} changed ({fix.change})",
        _loader(target, changed, indices),
        step=step,
        budget_s=budget,
        progress=bar,
    )
    ceiling = report.phases["ceiling"].step_s or 0.0
    batch_s = report.loader.get("batch_size", 1) / max(phase.samples_per_s, 1e-9)
    measured_util = min(1.0, ceiling / batch_s) if batch_s > 0 else 0.0
    return Applied(
        fix=fix.name,
        change=dict(fix.change),
        predicted_samples_per_s=fix.predicted_samples_per_s,
        measured_samples_per_s=phase.samples_per_s,
        predicted_utilization=fix.predicted_utilization,
        measured_utilization=round(measured_util, 4),
        error=round(phase.samples_per_s / max(fix.predicted_samples_per_s, 1e-9) - 1, 4),
        phase=phase,
    )
