"""The doctor on its held-out grid (:mod:`doctor_grid`): each fix it recommends, applied
and measured, against its prediction.

Each configuration is one ``fl.doctor(url, apply=True, ...)`` on the bench's generated
ImageFolder (600 JPEGs of about 105 KB, :mod:`fastload.bench.doctor_data`) served over S3
by a loopback server in its own process with the configuration's latency per request,
batches of 64 decoded to ``TrainPreset(224)``, a fresh cache directory; ``cold``: the
cold phase measured, ``warm``: not (the measured samples staged first), ``budget``: the
cache's ``max_bytes`` at half the dataset (an epoch after the first measured). ``--apply``
re-measures every fix that runs here; per fix: predicted and measured samples/s and the
error (measured / predicted - 1). Figures: median, p90 and worst |error| per fix type;
how often the top fix is the one with the largest measured gain; the verdict's
confidence. Written as JSON lines as each configuration ends (a cut-short run keeps what
it measured).

The verdict's stability (``verdict_repeats``): each configuration diagnosed that many more
times without ``--apply`` (the phases only, of ``verdict_phase_s``), one after another on
the same machine; per configuration the share of runs naming the most common bottleneck,
and how many configurations name the same one in at least 9 of 10 runs (the target).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastload.bench.components.doctor_grid import (
    BUDGET_SHARE,
    DEVELOPMENT_SEED,
    GridPoint,
    draw,
    grid_commit,
    seed_of_commit,
)

BATCH = 64
SAMPLES = 600


@dataclass(frozen=True, kw_only=True)
class GridBenchConfig:
    seed: int | None = None  # None: the held-out seed, from the grid's commit
    points: int | None = None  # the first this many of the grid (None: all)
    phase_s: float = 1.5
    repeats: int = 1  # runs of each configuration with every fix applied (0: none)
    verdict_repeats: int = 0  # runs of each configuration's diagnosis alone (its stability)
    verdict_phase_s: float | None = None  # their phases' seconds (None: phase_s)
    development: bool = False  # the development grid (DEVELOPMENT_SEED) instead
    cache: str | None = None  # only the configurations with this cache state


def resolve_seed(config: GridBenchConfig) -> tuple[int, str]:
    """(seed, where it came from)."""
    if config.development:
        return DEVELOPMENT_SEED, "the development grid"
    if config.seed is not None:
        return config.seed, "given"
    commit = grid_commit()
    if commit is None:
        raise RuntimeError(
            "the held-out seed comes from the commit that added doctor_grid.py: run from a "
            "git checkout, or pass --seed (the first 8 hex digits of that commit)"
        )
    return seed_of_commit(commit), f"commit {commit[:12]}"


def run_point(
    point: GridPoint, work: Path, phase_s: float, *, apply: bool = True
) -> dict[str, Any]:
    """One configuration's diagnosis (with every fix applied, unless not ``apply``): its
    record."""
    from fastload.bench.doctor_data import builtin_remote
    from fastload.diagnosis import doctor

    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    with builtin_remote(work, samples=SAMPLES, latency_s=point.latency_ms / 1000) as (
        url,
        options,
    ):
        max_bytes = None
        if point.cache == "budget":
            from fastload.datasets import open_dataset

            probe = open_dataset(url, storage_options=options, cache_dir=str(work / "probe"))
            max_bytes = int(probe.store.manifest.total_bytes * BUDGET_SHARE)
            probe.close()
        report = doctor(
            url,
            progress=False,
            phase_s=phase_s,
            cache_dir=str(cache),
            storage_options=options,
            max_bytes=max_bytes,
            batch_size=BATCH,
            num_workers=point.threads,
            step_ms=point.step_ms,
            step_holds_gil=point.holds_gil,
            cold=point.cache == "cold",
            apply=apply,
        )
    shutil.rmtree(cache, ignore_errors=True)
    now = report.verdict.samples_per_s
    applied: list[dict[str, Any]] = [
        {
            "fix": a.fix,
            "change": a.change,
            "predicted": a.predicted_samples_per_s,
            "measured": a.measured_samples_per_s,
            "error": a.error,
            "measured_gain": round(a.measured_samples_per_s / now, 4) if now > 0 else None,
        }
        for a in report.applied_fixes
    ]
    best = max(applied, key=lambda a: a["measured"], default=None)
    top = next((f for f in report.fixes if f.applicable), None)
    return {
        "point": point.to_dict(),
        "name": point.name,
        "seconds": round(time.perf_counter() - started, 2),
        "bottleneck": report.bottleneck,
        "once_warm": report.verdict.once_warm,
        "confidence": report.verdict.confidence,
        "basis": report.verdict.basis,
        "now_samples_per_s": now,
        "fixes": [f.name for f in report.fixes],
        "top_applicable": None if top is None else top.name,
        "best_measured": None if best is None else best["fix"],
        "applied": applied,
        "cache": report.cache,
        "phases": {
            name: {
                "samples_per_s": p.samples_per_s,
                "others_cores": p.others_cores,
                "hit_rate": p.hit_rate,
                "rate_se": p.rate_se,
                "too_few": p.too_few,
            }
            for name, p in report.phases.items()
            if p.skipped is None
        },
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fix type: n, median, p90 and worst |error|; the top fix's hit rate; the
    verdicts' agreement over repeats."""
    by_fix: dict[str, list[float]] = {}
    for r in records:
        for a in r["applied"]:
            by_fix.setdefault(a["fix"], []).append(abs(a["error"]))
    errors = {
        fix: {
            "n": len(v),
            "median": round(float(np.median(v)), 4),
            "p90": round(float(np.percentile(v, 90)), 4),
            "worst": round(max(v), 4),
        }
        for fix, v in sorted(by_fix.items())
    }
    every = [abs(a["error"]) for r in records for a in r["applied"]]
    if every:
        errors["all"] = {
            "n": len(every),
            "median": round(float(np.median(every)), 4),
            "p90": round(float(np.percentile(every, 90)), 4),
            "worst": round(max(every), 4),
        }
    judged = [r for r in records if r["best_measured"] is not None]
    top_right = sum(r["top_applicable"] == r["best_measured"] for r in judged)
    verdicts: dict[str, list[str]] = {}
    for r in records:
        verdicts.setdefault(r["name"], []).append(r["bottleneck"])
    same = [max(v.count(x) for x in v) / len(v) for v in verdicts.values() if len(v) > 1]
    return {
        "configurations": len(verdicts),
        "runs": len(records),
        "errors": errors,
        "top_fix_is_best_measured": f"{top_right} of {len(judged)}",
        "verdict_agreement_over_repeats": (round(float(np.mean(same)), 3) if same else None),
        "confidence_median": round(float(np.median([r["confidence"] for r in records])), 3)
        if records
        else None,
    }


def stability(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration, the bottlenecks its repeated diagnoses named and the share that
    named the most common one; overall, the configurations at 9 of 10 or better."""
    named: dict[str, list[str]] = {}
    for r in records:
        named.setdefault(r["name"], []).append(r["bottleneck"])
    shares = {name: round(max(v.count(x) for x in v) / len(v), 3) for name, v in named.items()}
    per = {
        name: {
            "runs": len(v),
            "named": {x: v.count(x) for x in sorted(set(v))},
            "identical": shares[name],
        }
        for name, v in named.items()
    }
    return {
        "configurations": len(per),
        "stable_9_of_10": sum(x >= 0.9 for x in shares.values()),
        "mean_identical": round(float(np.mean(list(shares.values()))), 3) if shares else None,
        "per_configuration": per,
    }


def lines(summary: dict[str, Any]) -> list[str]:
    out = [
        f"{summary['configurations']} configurations, {summary['runs']} runs; top fix = best "
        f"measured in {summary['top_fix_is_best_measured']}; median confidence "
        f"{summary['confidence_median']}; verdict agreement over repeats "
        f"{summary['verdict_agreement_over_repeats']}"
    ]
    out.append(f"{'fix':<18}{'n':>4}{'median':>9}{'p90':>9}{'worst':>9}")
    for fix, e in summary["errors"].items():
        out.append(f"{fix:<18}{e['n']:>4}{e['median']:>9.1%}{e['p90']:>9.1%}{e['worst']:>9.1%}")
    held = summary.get("verdict_stability")
    if held:
        out.append(
            f"verdict identical in >= 9 of 10 runs: {held['stable_9_of_10']} of "
            f"{held['configurations']} configurations (mean share {held['mean_identical']})"
        )
        for name, p in held["per_configuration"].items():
            named = ", ".join(f"{k} {n}" for k, n in p["named"].items())
            out.append(f"  {name:<32} {p['identical']:.0%} of {p['runs']}: {named}")
    return out


def run(out_dir: str | os.PathLike[str], config: GridBenchConfig) -> dict[str, Any]:
    seed, source = resolve_seed(config)
    points = [p for p in draw(seed) if config.cache in (None, p.cache)][: config.points]
    out = Path(out_dir)
    work = out / "data" / "doctor-grid"
    work.mkdir(parents=True, exist_ok=True)
    records_path = (
        out / f"doctor-grid-{seed}{'' if config.cache is None else '-' + config.cache}.jsonl"
    )
    records: list[dict[str, Any]] = []
    with records_path.open("w") as f:
        for point in points:
            for _ in range(config.repeats):
                record = run_point(point, work, config.phase_s)
                record["load1"] = os.getloadavg()[0]
                records.append(record)
                f.write(json.dumps(record) + "\n")
                f.flush()
                print(_point_line(record), flush=True)
    verdicts: list[dict[str, Any]] = []
    if config.verdict_repeats:
        phase_s = config.verdict_phase_s or config.phase_s
        with (out / f"doctor-verdicts-{seed}.jsonl").open("w") as f:
            for point in points:
                for _ in range(config.verdict_repeats):
                    record = run_point(point, work, phase_s, apply=False)
                    record["load1"] = os.getloadavg()[0]
                    verdicts.append(record)
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    print(_point_line(record), flush=True)
    summary = {"seed": seed, "seed_from": source, **summarize(records)}
    if verdicts:
        summary["verdict_stability"] = stability(verdicts)
    (out / f"doctor-grid-{seed}.json").write_text(json.dumps(summary, indent=2))
    return summary


def _point_line(r: dict[str, Any]) -> str:
    fixes = ", ".join(
        f"{a['fix']} {a['predicted']:,.0f}->{a['measured']:,.0f} ({a['error']:+.0%})"
        for a in r["applied"]
    )
    return (
        f"{r['name']:<32} {r['bottleneck']:<7} ({r['confidence']:.2f}) now "
        f"{r['now_samples_per_s']:,.0f}/s; {fixes or 'nothing applied'}; load {r['load1']:.1f}"
    )
