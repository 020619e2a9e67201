"""The end-to-end benchmark's report: figures per run, ratios, the table, JSON and a chart.

Each (system, layout, training step) may be measured several times (``repeats``); its row
gives the median of each figure over the repeats that ran, and the JSON keeps every repeat.
Ratios between systems are taken with the same step; each system's rates with the
GIL-holding step are also set against its own with the sleeping step."""

from __future__ import annotations

import importlib
import os
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from fastload.bench.e2e.e2e_data import GeneratedData
from fastload.bench.runner import STEP_NAMES, Measurement, Report, machine_info, step_lost

FASTLOAD = "fastload"
LAYOUT_NAMES = {
    "folder": "folder",
    "tar": "tar shards",
    "zarr": "zarr",
    "parquet": "parquet",
    "mds": "MDS (from folder)",
    "litdata": "litdata (from folder)",
}
STEP_LABELS = {"sleep": "sleep", "gil": "GIL"}  # the table's step column
# Targets by layout: (fastload's warm epoch over the best peer's with the same step, its
# cold epoch over its own warm one). Parquet: issue 17 (the Parquet component benchmark
# checks the same).
TARGETS: dict[str, tuple[float, float]] = {"parquet": (1.3, 0.8)}
LAYOUT_DESCRIPTIONS = {
    "folder": "ImageFolder of the JPEGs",
    "tar": "WebDataset tar shards (.jpg + .cls), shuffled order",
    "zarr": "Zarr v3: images (N, 256, 256, 3) uint8 resized pixels, labels int64",
    "parquet": "Parquet as the HF Hub has images: image struct {bytes, path} + label int64, "
    "4 files of ~100-row row groups, shuffled order",
    "mds": "mosaicml-streaming's MDS, converted from the folder (JPEG bytes + label)",
    "litdata": "litdata's optimize() output, converted from the folder (JPEG bytes + label)",
}


@dataclass
class Run:
    """One (system, layout, step): what the child measured, and what the parent saw of it."""

    system: str
    layout: str
    status: str = "ok"  # ok | skipped | failed
    note: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    marks: list[dict[str, Any]] = field(default_factory=list)  # server counters per mark
    remote_bytes: int | None = None
    remote_requests: int | None = None
    server_cpu_s: float | None = None
    peak_tree_pss_bytes: int | None = None
    prep_s: float | None = None  # conversion (mosaicml-streaming, litdata)
    wall_s: float | None = None
    repeat: int = 0  # which measurement of this (system, layout), from 0
    step: str = "sleep"  # the training step's kind (runner.TrainingStep)


@dataclass
class Row:
    """Every repeat of one (system, layout, step): the table's row gives their medians."""

    system: str
    layout: str
    step: str
    runs: list[Run]

    @property
    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.status == "ok"]

    @property
    def status(self) -> str:
        return "ok" if self.ok else self.runs[0].status

    @property
    def first(self) -> Run:
        """The repeat that stands for the row's details: the first that ran, else the first."""
        return (self.ok or self.runs)[0]

    def figures(self) -> dict[str, Any]:
        return median_figures([figures(r) for r in self.ok]) if self.ok else {}


def rows(runs: Sequence[Run]) -> list[Row]:
    """The runs grouped by (system, layout, step), in the order each first appears."""
    found: dict[tuple[str, str, str], Row] = {}
    for r in runs:
        row = found.setdefault((r.system, r.layout, r.step), Row(r.system, r.layout, r.step, []))
        row.runs.append(r)
    return list(found.values())


def median_figures(each: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One figure per key over repeats: the median of numbers; for flags, whether any
    repeat was cut (``*_cut``), and whether every checked resume was exact."""
    out: dict[str, Any] = {}
    for key in each[0]:
        values = [f[key] for f in each if f.get(key) is not None]
        if not values:
            out[key] = None
        elif key == "resume_exact":
            out[key] = all(values)
        elif isinstance(values[0], bool):
            out[key] = any(values)
        elif key == "warm_epochs_cut":
            out[key] = max(values)
        else:
            out[key] = statistics.median(values)
    return out


def figures(run: Run) -> dict[str, Any]:
    """The headline figures of one run (None where it has none)."""
    r = run.result
    epochs = r.get("epochs", [])
    cold = epochs[0] if epochs else None
    warm = epochs[1:]

    def rate(es: list[dict[str, Any]]) -> float | None:
        seconds = sum(e["seconds"] for e in es)
        return sum(e["samples"] for e in es) / seconds if es and seconds > 0 else None

    def wait(es: list[dict[str, Any]]) -> float | None:
        seconds = sum(e["seconds"] for e in es)
        return sum(e["wait_s"] for e in es) / seconds if es and seconds > 0 else None

    def lost(es: list[dict[str, Any]]) -> float | None:
        waited = sum(e.get("step_waited_s", 0.0) for e in es)
        return step_lost(waited, sum(e.get("step_s", 0.0) for e in es))

    prep = run.prep_s
    return {
        "cold_samples_per_s": rate([cold]) if cold else None,
        "warm_samples_per_s": rate(warm),
        "first_batch_s": cold["first_batch_s"] if cold else None,
        "resume_s": r.get("resume_s"),
        "resume_exact": r.get("resume_exact"),
        "wait_fraction_cold": wait([cold]) if cold else None,
        "wait_fraction_warm": wait(warm),
        "step_lost_cold": lost([cold]) if cold else None,
        "step_lost_warm": lost(warm),
        "remote_bytes": run.remote_bytes,
        "remote_requests": run.remote_requests,
        "cpu_s": r.get("cpu_s"),
        "server_cpu_s": run.server_cpu_s,
        "peak_rss_bytes": r.get("peak_rss_bytes"),
        "peak_tree_pss_bytes": run.peak_tree_pss_bytes,
        "prep_s": prep,
        "download_s": r.get("extra", {}).get("download_s"),
        "table_read_s": r.get("extra", {}).get("table_read_s"),
        "load_dataset_s": r.get("extra", {}).get("load_dataset_s"),
        "cold_epoch_cut": bool(cold and cold["partial"]),
        "warm_epochs_cut": sum(1 for e in warm if e["partial"]),
    }


def _note(row: Row) -> str:
    run = row.first
    if row.status != "ok":
        return f"{run.status}: {run.note}"
    f = row.figures()
    parts = []
    failed = [r for r in row.runs if r.status != "ok"]
    if failed:
        parts.append(
            f"{len(failed)} of {len(row.runs)} repeats {failed[0].status}: {failed[0].note}"
        )
    if f["download_s"] is not None:
        parts.append(f"cold epoch includes the download ({f['download_s']:.1f} s)")
    if f.get("table_read_s") is not None:
        parts.append(f"cold epoch includes reading the whole table ({f['table_read_s']:.1f} s)")
    if f.get("load_dataset_s") is not None:
        parts.append(
            "cold epoch includes load_dataset's download and conversion to Arrow "
            f"({f['load_dataset_s']:.1f} s)"
        )
    if run.prep_s is not None:
        parts.append("prep = its conversion of the folder")
    if f["cold_epoch_cut"]:
        parts.append("cold epoch stopped at its time budget")
    if f["warm_epochs_cut"]:
        parts.append(f"{f['warm_epochs_cut']} warm epoch(s) stopped at the time budget")
    resume = run.result
    if resume.get("resume_note") == "not measured" and row.step != "sleep":
        parts.append("resume measured with the sleeping step")
    elif resume.get("resume_note"):
        parts.append(str(resume["resume_note"]))
    elif f["resume_exact"] is False:
        bad = next(r.result for r in row.ok if r.result.get("resume_exact") is False)
        parts.append(
            "resume did not deliver exactly the rest of the epoch"
            + (
                f" ({bad['resume_replayed']} replayed, {bad['resume_dropped']} dropped)"
                if "resume_replayed" in bad
                else ""
            )
        )
    elif str(resume.get("resume_check", "")).startswith("sample count"):
        parts.append("resume checked by " + str(resume["resume_check"]))
    elif resume.get("resume_check") in ("labels", "labels in order"):
        parts.append(f"resume checked by {resume['resume_check']} (batches carry no sample ids)")
    return "; ".join(parts)


def case_name(layout: str, step: str) -> str:
    """A layout's name, with the step where it is not the sleeping one."""
    name = LAYOUT_NAMES.get(layout, layout)
    return name if step == "sleep" else f"{name}, {STEP_NAMES.get(step, step)}"


def _measurement(row: Row) -> Measurement:
    f = row.figures()
    warm_s, rates = [], []
    for r in row.ok:
        warm = r.result.get("epochs", [])[1:] or r.result.get("epochs", [])[:1]
        seconds = sum(e["seconds"] for e in warm)
        warm_s.append(seconds)
        if seconds > 0:
            rates.append(sum(e["samples"] for e in warm) / seconds)
    seconds = statistics.median(warm_s) if warm_s else 0.0
    extra = {
        "cold samples/s": f.get("cold_samples_per_s"),
        "first batch s": f.get("first_batch_s"),
        "resume s": f.get("resume_s"),
        "wait % warm": None
        if f.get("wait_fraction_warm") is None
        else 100 * f["wait_fraction_warm"],
        "step lost % warm": None if f.get("step_lost_warm") is None else 100 * f["step_lost_warm"],
        "remote MB": None if f.get("remote_bytes") is None else f["remote_bytes"] / 1e6,
        "CPU s": f.get("cpu_s"),
        "peak RSS MB": None if f.get("peak_rss_bytes") is None else f["peak_rss_bytes"] / 1e6,
        "prep s": f.get("prep_s"),
    }
    return Measurement(
        benchmark="e2e",
        case=case_name(row.layout, row.step),
        system=row.system,
        seconds=seconds,
        repeats=warm_s,
        items=round(statistics.median(rates) * seconds) if rates else 0,
        note=_note(row),
        extra={k: float(v) for k, v in extra.items() if v is not None},
    )


def ratios(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """fastload's figures over each peer's (medians over repeats), with the same training
    step: on the same layout, and for the conversion peers against fastload on the folder
    they were converted from."""
    grouped = rows(runs)
    fast = {
        (r.layout, r.step): r.figures()
        for r in grouped
        if r.system == FASTLOAD and r.status == "ok"
    }
    out = []
    for r in grouped:
        if r.system == FASTLOAD or r.status != "ok":
            continue
        base_layout = "folder" if r.layout in ("mds", "litdata") else r.layout
        mine, theirs = fast.get((base_layout, r.step)), r.figures()
        if mine is None:
            continue
        entry: dict[str, Any] = {
            "peer": r.system,
            "layout": r.layout,
            "fastload_layout": base_layout,
            "step": r.step,
        }
        for key in ("warm_samples_per_s", "cold_samples_per_s"):
            a, b = mine[key], theirs[key]
            entry[key] = a / b if a and b else None
        a, b = mine["first_batch_s"], theirs["first_batch_s"]
        entry["first_batch_speedup"] = b / a if a and b else None
        out.append(entry)
    return out


def gil_vs_sleep(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Each system's rates with the GIL-holding step over its own with the sleeping step
    (medians over repeats), on each layout measured with both, and the share of the
    GIL-holding step's time the system took from it."""
    grouped = rows(runs)
    sleeping = {(r.system, r.layout): r.figures() for r in grouped if r.step == "sleep"}
    out = []
    for r in grouped:
        base = sleeping.get((r.system, r.layout))
        if r.step != "gil" or r.status != "ok" or not base:
            continue
        busy = r.figures()
        entry: dict[str, Any] = {"system": r.system, "layout": r.layout}
        for key in ("warm_samples_per_s", "cold_samples_per_s"):
            a, b = busy[key], base[key]
            entry[key] = a / b if a and b else None
        entry["step_lost_warm"] = busy["step_lost_warm"]
        entry["step_lost_cold"] = busy["step_lost_cold"]
        out.append(entry)
    return out


def gil_lines(report: Report) -> list[str]:
    """A line per system run with both steps: what holding the GIL in the step cost it,
    under a line saying what that includes on this machine's cores."""
    entries = report.params.get("gil_vs_sleep", [])
    cores = report.machine.get("usable_cores") or report.machine.get("cores")
    lines = [
        f"With the GIL-holding step, each system's rates over its own with the sleeping step "
        f"(on {cores or '?'} cores the busy step keeps one busy, so what a system took from "
        "it is the GIL its threads held and the CPU its threads and processes used):"
    ]
    for e in entries:
        text = f"  {e['system']} ({LAYOUT_NAMES.get(e['layout'], e['layout'])}): "
        text += ", ".join(_rate_ratios(e))
        if e.get("step_lost_warm") is not None:
            text += f"; it took {100 * e['step_lost_warm']:.0f}% of the step's time (warm)"
        lines.append(text)
    return lines if entries else []


def _rate_ratios(entry: dict[str, Any]) -> list[str]:
    """'warm 1.20x', 'cold 0.90x' from a ratio entry, where it has them."""
    return [
        f"{label} {entry[key]:.2f}x"
        for key, label in (("warm_samples_per_s", "warm"), ("cold_samples_per_s", "cold"))
        if entry.get(key)
    ]


def ratio_lines(report: Report) -> list[str]:
    """A line per peer and step: fastload's warm and cold samples/s over the peer's."""
    lines = []
    for e in report.params.get("ratios", []):
        where = LAYOUT_NAMES.get(e["layout"], e["layout"])
        if e["layout"] != e["fastload_layout"]:
            where += f" vs fastload on {e['fastload_layout']}"
        if e.get("step", "sleep") != "sleep":
            where += f", {STEP_NAMES.get(e['step'], e['step'])}"
        parts = _rate_ratios(e)
        if e.get("first_batch_speedup"):
            parts.append(f"first batch {e['first_batch_speedup']:.1f}x sooner")
        lines.append(f"fastload vs {e['peer']} ({where}): " + ", ".join(parts))
    return lines


def target_lines(report: Report) -> list[str]:
    """A line per layout with :data:`TARGETS` and training step that fastload ran: its warm
    epoch over the best peer's (the fastest warm epoch of the peers on that layout), its
    cold epoch over its warm one, each met or missed."""
    lines = []
    for run in report.params.get("runs", []):
        target = TARGETS.get(run["layout"])
        if run["system"] != FASTLOAD or run["status"] != "ok" or target is None:
            continue
        warm_target, cold_target = target
        step = run.get("step", "sleep")
        where = case_name(run["layout"], step)
        f = run["figures"]
        warm, cold = f.get("warm_samples_per_s"), f.get("cold_samples_per_s")
        peers = [
            e
            for e in report.params.get("ratios", [])
            if (e["fastload_layout"], e.get("step", "sleep")) == (run["layout"], step)
            and e["warm_samples_per_s"]
        ]
        best = min(peers, key=lambda e: e["warm_samples_per_s"], default=None)
        if best is None or not warm:
            lines.append(f"target ({where}): warm >= {warm_target}x the best peer: no peer ran")
        else:
            ratio = best["warm_samples_per_s"]
            lines.append(
                f"target ({where}): warm >= {warm_target}x the best peer ({best['peer']}, "
                f"{warm / ratio:,.0f} samples/s): {warm:,.0f} samples/s, {ratio:.2f}x: "
                + ("met" if ratio >= warm_target else "missed")
            )
        if warm and cold:
            ratio = cold / warm
            lines.append(
                f"target ({where}): cold >= {cold_target}x warm: {cold:,.0f} vs {warm:,.0f} "
                f"samples/s, {ratio:.2f}x: " + ("met" if ratio >= cold_target else "missed")
            )
    return lines


def table(report: Report) -> str:
    headers = [
        "layout", "system", "step", "cold/s", "warm/s", "1st batch s", "resume s", "wait %",
        "step lost %", "remote MB", "CPU s", "RSS MB", "PSS MB", "prep s", "note",
    ]  # fmt: skip
    body = []
    for run in report.params["runs"]:
        f = run["figures"]

        def num(key: str, fmt: str, scale: float = 1.0, f: dict[str, Any] = f) -> str:
            value = f.get(key)
            return "" if value is None else format(value * scale, fmt)

        body.append(
            [
                LAYOUT_NAMES.get(run["layout"], run["layout"]),
                run["system"],
                STEP_LABELS.get(run.get("step", "sleep"), "") if run["status"] == "ok" else "",
                num("cold_samples_per_s", ",.0f"),
                num("warm_samples_per_s", ",.0f"),
                num("first_batch_s", ".2f"),
                num("resume_s", ".2f") or ("n/a" if run["status"] == "ok" else ""),
                num("wait_fraction_warm", ".0f", 100),
                num("step_lost_warm", ".0f", 100),
                num("remote_bytes", ",.0f", 1e-6),
                num("cpu_s", ".1f"),
                num("peak_rss_bytes", ",.0f", 1e-6),
                num("peak_tree_pss_bytes", ",.0f", 1e-6),
                num("prep_s", ".1f"),
                run["note"],
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
    n = max((run.get("repeats_measured", 1) for run in report.params["runs"]), default=1)
    lines = [f"each figure: the median of {n} run{'s' if n != 1 else ''} of its system and layout"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(line.rstrip() for line in lines)


def chart(report: Report, path: Path) -> str:
    """A PNG of cold and warm samples/s per (system, layout); returns what happened."""
    try:  # optional (the bench extra); untyped here
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "no chart: matplotlib is not installed (pip install 'fastload[bench]')"
    runs = [r for r in report.params["runs"] if r["status"] == "ok"]
    if not runs:
        return "no chart: no system ran"
    labels = [f"{r['system']}\n{case_name(r['layout'], r.get('step', 'sleep'))}" for r in runs]
    cold = [r["figures"]["cold_samples_per_s"] or 0 for r in runs]
    warm = [r["figures"]["warm_samples_per_s"] or 0 for r in runs]
    y = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(runs) + 1.5))
    ours = [r["system"] == FASTLOAD for r in runs]  # fastload in orange, peers in blue
    light = ["#fdae6b" if mine else "#9ecae1" for mine in ours]
    dark = ["#e6550d" if mine else "#3182bd" for mine in ours]
    hatch = ["//" if r.get("step") == "gil" else "" for r in runs]  # the GIL-holding step
    ax.barh(y - 0.2, cold, 0.4, color=light, hatch=hatch, edgecolor="white")
    ax.barh(y + 0.2, warm, 0.4, color=dark, hatch=hatch, edgecolor="white")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"samples/s (train preset, batch {report.params['batch_size']})")
    title = textwrap.fill(report.params.get("title", "fastload bench"), 100)
    ax.set_title(title, fontsize=9)
    patches: Any = importlib.import_module("matplotlib.patches")
    keys = [("#bdbdbd", "cold epoch (empty cache)"), ("#636363", "warm epochs")]
    handles = [patches.Patch(color=c, label=text) for c, text in keys]
    if any(hatch):
        gil = patches.Patch(facecolor="#bdbdbd", hatch="//", edgecolor="white")
        gil.set_label("GIL-holding step")
        handles.append(gil)
    ax.legend(handles=handles, loc="lower right", fontsize=8, title="fastload orange, peers blue")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return f"chart: {path}"


def build(
    params: dict[str, Any],
    title: str,
    data: GeneratedData | None,
    runs: Sequence[Run],
    peers: dict[str, Any] | None,
) -> Report:
    """The report: a row per run (warm-epoch rate, the rest as figures), every figure and
    the machine (with the peers' environment) in its JSON."""
    machine = machine_info(".")
    for name in ("zarr", "moto", "matplotlib", "simplejpeg", "pillow"):
        try:
            machine["libraries"][name] = version(name)
        except PackageNotFoundError:
            continue
    machine["peers_environment"] = peers
    grouped = rows(runs)
    params = {
        **params,
        "title": title,
        "dataset": None
        if data is None
        else {
            "root": str(data.root),
            "samples": data.samples,
            "classes": data.classes,
            "bytes": data.nbytes,
            "mean_jpeg_bytes": data.nbytes.get("folder", 0) // max(1, data.samples),
            "layouts": LAYOUT_DESCRIPTIONS,
        },
        "runs": [
            {
                "system": row.system,
                "layout": row.layout,
                "step": row.step,
                "status": row.status,
                "note": _note(row),
                "figures": row.figures(),  # medians over the repeats that ran
                "repeats_measured": len(row.runs),
                **_details(row.first),  # of the first repeat that ran
                "repeats": [
                    {
                        "repeat": r.repeat,
                        "status": r.status,
                        "note": r.note,
                        "figures": figures(r) if r.status == "ok" else {},
                        **_details(r),
                    }
                    for r in row.runs
                ],
            }
            for row in grouped
        ],
        "ratios": ratios(runs),
        "gil_vs_sleep": gil_vs_sleep(runs),
    }
    measurements = [_measurement(row) for row in grouped]
    return Report(name="e2e", rows=measurements, machine=machine, params=params)


def _details(r: Run) -> dict[str, Any]:
    return {
        "epochs": r.result.get("epochs", []),
        "open_s": r.result.get("open_s"),
        "training_step": r.result.get("step"),  # its kind, its work, its rate alone
        "delivers": r.result.get("delivers"),
        "resume": {k: v for k, v in r.result.items() if k.startswith("resume")},
        "marks": r.marks,
        "loader_stats": r.result.get("loader_stats"),
        "wall_s": r.wall_s,
    }


def write(report: Report, out_dir: str | os.PathLike[str], *, with_chart: bool = True) -> list[str]:
    """Writes the JSON (and the chart); returns lines saying where."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    if with_chart:
        note = chart(report, out / f"{report.name}.png")
        report.params["chart"] = note
        lines.append(note)
    lines.insert(0, f"wrote {report.write_json(out)}")
    return lines


def summary(report: Report) -> str:
    """The table, then the ratio lines, then what the GIL-holding step cost each system."""
    parts = [report.params["title"], table(report), "", *ratio_lines(report)]
    targets = target_lines(report)
    if targets:
        parts += ["", *targets]
    gil = gil_lines(report)
    if gil:
        parts += ["", *gil]
    return "\n".join(parts)
