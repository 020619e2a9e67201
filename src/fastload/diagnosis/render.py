"""What ``fastload doctor`` shows: the terminal table, ``doctor.json`` and the PNG.

The table is read by someone deciding what to change: the per-phase measurements come
first as the evidence, then the bottleneck, what it costs, and the fixes' predicted figures.
The chart puts each stage's time per batch beside the step's, so a bar longer than the
step line is a stage the step waits on.
"""

from __future__ import annotations

import importlib
import math
import os
import textwrap
from pathlib import Path
from typing import Any

from fastload.diagnosis.report import Fix, Phase, Report

WIDTH = 100
PHASE_ORDER = ("ceiling", "prep", "train", "cold", "h2d")
# Loader stages as the table and chart name them: "stage" (fetching ahead) is the remote.
STAGE_COLUMNS = (
    ("read", "read"),
    ("decode", "decode"),
    ("collate", "collate"),
    ("transfer", "transfer"),
    ("stage", "fetch"),
)
NOT_APPLICABLE = "(not applicable here)"
NO_MATPLOTLIB = "no chart: matplotlib is not installed (pip install 'fastload[bench]')"


# -- formatting --------------------------------------------------------------------------


def _usd(amount: float | None) -> str:
    """Dollars to three significant figures (cents are noise on a $300 epoch); None: "-"."""
    if amount is None or not math.isfinite(amount):
        return "-"
    if amount == 0:
        return "$0"
    if abs(amount) >= 100:
        return f"${amount:,.0f}"
    if abs(amount) >= 1:
        return f"${amount:,.2f}"
    decimals = 2 - math.floor(math.log10(abs(amount)))
    return "$" + f"{amount:.{decimals}f}".rstrip("0").rstrip(".")


def _rate(samples_per_s: float) -> str:
    """Samples/s for prose: whole numbers unless the rate is small enough that decimals count."""
    return f"{samples_per_s:,.0f}" if samples_per_s >= 100 else f"{samples_per_s:,.3g}"


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def _duration(seconds: float) -> str:
    """An epoch's length in the unit a person would say it in."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(count: float) -> str:
    """Decimal units to three figures, as cloud storage bills them."""
    if abs(count) < 1000:
        return f"{count:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        count /= 1000
        if abs(float(f"{count:.3g}")) < 1000:  # 999.9 rounds up: the next unit says it
            return f"{count:.3g} {unit}"
    return f"{count:,.0f} TB"


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def _wrap(text: str, indent: str = "  ", first: str = "") -> list[str]:
    """Prose kept within the terminal width; continuation lines indented (tables not wrapped)."""
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    ) or [first]


def _pack(parts: list[str], separator: str, indent: str = "  ") -> list[str]:
    """Parts joined within the terminal width, a line breaking only between parts."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(separator) + len(part) <= WIDTH:
            lines[-1] += separator + part
        else:
            lines[-1] += separator.rstrip()
            lines.append(indent + part)
    return [line.rstrip() for line in lines]


def fix_label(fix: Fix) -> str:
    """The settings a fix changes (``num_workers=2``), or its name when it changes none."""
    if not fix.change:
        return fix.name
    return ", ".join(f"{key}={value}" for key, value in fix.change.items())


def _ordered_phases(report: Report) -> list[Phase]:
    """The phases in the order they are measured, then any others as they were stored."""
    known = [report.phases[name] for name in PHASE_ORDER if name in report.phases]
    others = [phase for name, phase in report.phases.items() if name not in PHASE_ORDER]
    return known + others


def _parallelism(loader: dict[str, Any]) -> int:
    """The loader's threads: stage times are summed over them, so wall time is this share."""
    try:
        return max(1, int(loader.get("num_workers") or 1))
    except (TypeError, ValueError):
        return 1


# -- the table ---------------------------------------------------------------------------


def _headline(report: Report) -> list[str]:
    """What was measured: the data, the loader's settings, the step and the price."""
    dataset, loader = report.dataset, report.loader
    about: list[str] = []
    if dataset.get("samples") is not None:
        about.append(_plural(int(dataset["samples"]), "sample"))
    if dataset.get("bytes") is not None:
        about.append(_bytes(float(dataset["bytes"])))
    if dataset.get("format"):
        about.append(str(dataset["format"]))
    if dataset.get("cached_fraction") is not None:
        about.append(f"{_percent(float(dataset['cached_fraction']))} cached")
    settings: list[str] = []
    if loader.get("batch_size") is not None:
        settings.append(f"batch {loader['batch_size']}")
    if loader.get("num_workers") is not None:
        settings.append(_plural(int(loader["num_workers"]), "thread"))
    if loader.get("decode"):
        decode = str(loader["decode"])
        if loader.get("transform"):
            decode += f"/{loader['transform']}"
        settings.append(f"decode {decode}")
    head = f"fastload doctor: {report.url}"
    if about:
        head += f" ({', '.join(about)})"
    lines = _wrap(head)
    if settings:
        lines += _pack([f"loader: {settings[0]}", *settings[1:]], ", ")

    step = report.step
    what = str(step.get("kind") or "step")
    if step.get("model"):
        what += f" {step['model']}"
    if step.get("ms") is not None:
        what += f" {float(step['ms']):g} ms"
    lines += _wrap(f"step: {what} ({_price_text(report)})")
    if step.get("note"):
        lines += _wrap(str(step["note"]), first="  ")
    return lines


def _price_text(report: Report) -> str:
    price = report.price
    hourly = price.get("usd_per_gpu_hour")
    if hourly is None:
        return "no GPU price (--gpu or --price): costs not shown"
    gpu = price.get("gpu") or report.node.get("gpu") or "GPU"
    text = f"{gpu} at {_usd(float(hourly))}/GPU-hour"
    if price.get("spot"):
        text += " spot"
    if price.get("gpus"):
        text += f", {_plural(int(price['gpus']), 'GPU')}"
    if price.get("source"):
        text += f"; {price['source']}"
    return text


def _phase_table(report: Report) -> list[str]:
    """One row per phase; a stage column only where some phase measured that stage."""
    phases = _ordered_phases(report)
    stages = [
        (key, label)
        for key, label in STAGE_COLUMNS
        if any(key in phase.stage_s for phase in phases if phase.skipped is None)
    ]
    headers = ["samples/s", "step ms", "wait ms", *(f"{label} ms" for _, label in stages)]
    headers.append("cores")
    cells: dict[str, list[str]] = {}  # the measured phases' figures, by phase name
    for phase in phases:
        if phase.skipped is None:
            figures = [f"{phase.samples_per_s:,.1f}", _ms(phase.step_s), _ms(phase.wait_s)]
            figures += [_ms(phase.stage_s.get(key)) for key, _ in stages]
            cells[phase.name] = [*figures, f"{phase.cpu_cores:.2f}"]
    widths = [
        max([len(header), *(len(row[i]) for row in cells.values())])
        for i, header in enumerate(headers)
    ]
    name_width = max([len("phase"), *(len(phase.name) for phase in phases)])
    header_cells = [h.rjust(w) for h, w in zip(headers, widths, strict=True)]
    lines = ["  ".join(["phase".ljust(name_width), *header_cells])]
    for phase in phases:
        name = phase.name.ljust(name_width)
        if phase.skipped is not None:
            lines += _wrap(f"{name}  skipped: {phase.skipped}", indent=" " * (name_width + 2))
        else:
            row = [c.rjust(w) for c, w in zip(cells[phase.name], widths, strict=True)]
            lines.append("  ".join([name, *row]))
    if stages:
        lines.append("  (stage ms: per batch, summed over the loader's threads)")
    return lines


def _verdict_lines(report: Report) -> list[str]:
    verdict = report.verdict
    head = f"bottleneck: {report.bottleneck}"  # the summary says what it means
    lines = _wrap(f"{head} — {verdict.summary}" if verdict.summary else head)
    figures = [
        f"confidence {_percent(verdict.confidence)}",
        f"utilization {_percent(verdict.utilization)}",
        f"{_rate(verdict.samples_per_s)} samples/s ({verdict.basis})",
        f"epoch {_duration(verdict.epoch_s)}",
    ]
    if verdict.epoch_usd is None:
        figures.append("cost - (no GPU price)")
    else:
        cost = f"{_usd(verdict.epoch_usd)} an epoch"
        if verdict.lost_usd_per_epoch is not None:
            cost += f", {_usd(verdict.lost_usd_per_epoch)} of it waiting"
        if verdict.lost_usd_per_day is not None:
            cost += f" ({_usd(verdict.lost_usd_per_day)} a day)"
        figures.append(cost)
    lines += _pack(figures, "  ·  ")
    return lines


def _fix_lines(report: Report) -> list[str]:
    if not report.fixes:
        return ["fixes: none found"]
    lines = ["fixes (ranked by predicted gain):"]
    number_width = len(str(len(report.fixes)))
    label_width = max(len(fix_label(fix)) for fix in report.fixes)
    indent = " " * (2 + number_width + 2)
    for rank, fix in enumerate(report.fixes, 1):
        cost = (
            "" if fix.predicted_epoch_usd is None else f", {_usd(fix.predicted_epoch_usd)} an epoch"
        )
        line = (
            f"  {rank:>{number_width}}. {fix_label(fix):<{label_width}}  {fix.gain:.2f}x"
            f"  -> {_rate(fix.predicted_samples_per_s)} samples/s,"
            f" utilization {_percent(fix.predicted_utilization)}{cost}"
        )
        why = fix.why
        if not fix.applicable:
            if len(line) + len(NOT_APPLICABLE) + 2 <= WIDTH:
                line += f"  {NOT_APPLICABLE}"
            else:
                why = f"{NOT_APPLICABLE} {why}"
        lines.append(line)
        lines += _wrap(why, indent=indent, first=indent)
        if fix.command:
            lines += _wrap(f"run: {fix.command}", indent=indent, first=indent)
    return lines


def _applied_line(report: Report) -> list[str]:
    lines: list[str] = []
    for applied in report.applied_fixes or ([report.applied] if report.applied else []):
        label = ", ".join(f"{k}={v}" for k, v in applied.change.items()) or applied.fix
        rates = (
            f"applied {label}: predicted {_rate(applied.predicted_samples_per_s)} samples/s,"
            f" measured {_rate(applied.measured_samples_per_s)} ({applied.error * 100:+.1f}%)"
        )
        utilization = (
            f"utilization predicted {_percent(applied.predicted_utilization)},"
            f" measured {_percent(applied.measured_utilization)}"
        )
        lines += _pack([rates, utilization], "; ")
    return lines


def _cache_lines(report: Report) -> list[str]:
    advice = report.cache
    if not advice or (advice["hit_rate"] >= 1.0 and report.phases.get("budget") is None):
        return []
    cost = "" if advice.get("usd_per_epoch") is None else f", {_usd(advice['usd_per_epoch'])}"
    head = (
        f"cache: max_bytes={advice['max_bytes']:,} policy={advice['policy']}: hit rate "
        f"{_percent(advice['hit_rate'])}, {advice['remote_bytes_per_epoch']:,} bytes from "
        f"the remote an epoch{cost}"
    )
    return _wrap(f"{head} — {advice['why']}")


def _ranks_lines(report: Report) -> list[str]:
    ranks = report.ranks
    if ranks is None or ranks.skipped is not None:
        return []  # (a skip is among the notes)
    each = ", ".join(_rate(x) for x in ranks.measured_samples_per_s)
    return _wrap(
        f"{ranks.local_world_size} ranks on the node, a loader process each "
        f"({ranks.cores_per_rank:g} core{'' if ranks.cores_per_rank == 1 else 's'} a rank): "
        f"predicted "
        f"{_rate(ranks.predicted_samples_per_s)} samples/s per rank, measured {each} "
        f"({ranks.error * 100:+.1f}%; alone {_rate(ranks.alone_samples_per_s)}; the ranks "
        f"overlapped {_percent(ranks.overlap)} of the time)"
    )


def table(report: Report) -> str:
    """The short terminal report: what ran, the phases, the verdict, the fixes, the notes."""
    lines = _headline(report) + _phase_table(report) + _verdict_lines(report)
    lines += _fix_lines(report) + _applied_line(report) + _cache_lines(report)
    lines += _ranks_lines(report)
    if report.chart:
        lines.append(f"chart: {report.chart}")
    if report.budget_s > 0:
        lines.append(f"diagnosed in {_duration(report.budget_s)}")
    for note in report.notes:
        lines += _wrap(f"note: {note}")
    return "\n".join(line.rstrip() for line in lines)


# -- the chart ---------------------------------------------------------------------------

ChartBars = dict[str, float]  # bar label -> ms per batch


def _stage_bars(stage_s: dict[str, float], parallelism: int) -> ChartBars:
    """A stage's wall time per batch: its thread-summed time shared over the threads."""
    return {
        label: stage_s[key] * 1000 / parallelism
        for key, label in STAGE_COLUMNS
        if key in stage_s and key != "stage"
    }


def _now_bars(report: Report) -> ChartBars:
    """Each stage's time per batch as measured, from the phase that isolates it."""
    phases = {name: p for name, p in report.phases.items() if p.skipped is None}
    parallelism = _parallelism(report.loader)
    bars: ChartBars = {}
    ceiling = phases.get("ceiling")
    if ceiling is not None and ceiling.step_s is not None:
        bars["step"] = ceiling.step_s * 1000
    cold = phases.get("cold")
    if cold is not None and "stage" in cold.stage_s:
        bars["fetch"] = cold.stage_s["stage"] * 1000 / parallelism
    prep = phases.get("prep")
    if prep is not None:
        bars.update(_stage_bars(prep.stage_s, parallelism))
    h2d = phases.get("h2d")
    if h2d is not None and h2d.step_s is not None:
        bars["h2d"] = h2d.step_s * 1000
    batch_size = report.loader.get("batch_size")
    basis = phases.get(report.verdict.basis)
    rate = basis.samples_per_s if basis is not None else report.verdict.samples_per_s
    if batch_size and rate > 0:
        bars["per batch"] = float(batch_size) * 1000 / rate
    return bars


def _after_bars(report: Report) -> ChartBars:
    """The stages re-measured with the top fix (if its phase was kept), and the batch time."""
    applied = report.applied
    if applied is None:
        return {}
    bars: ChartBars = {}
    parallelism = _parallelism({**report.loader, **applied.change})
    if applied.phase is not None:
        if applied.phase.step_s is not None:
            bars["step"] = applied.phase.step_s * 1000
        if "stage" in applied.phase.stage_s:
            bars["fetch"] = applied.phase.stage_s["stage"] * 1000 / parallelism
        bars.update(_stage_bars(applied.phase.stage_s, parallelism))
    batch_size = report.loader.get("batch_size")
    if batch_size and applied.measured_samples_per_s > 0:
        bars["per batch"] = float(batch_size) * 1000 / applied.measured_samples_per_s
    return bars


def _chart_title(report: Report) -> str:
    title = (
        f"fastload doctor: bottleneck {report.bottleneck}, "
        f"utilization {_percent(report.verdict.utilization)}"
    )
    if report.applied is not None:
        title += (
            f" → {_percent(report.applied.measured_utilization)}"
            f" after {', '.join(f'{k}={v}' for k, v in report.applied.change.items())}"
        )
    return textwrap.fill(title, 90)


def chart(report: Report, path: Path) -> str | None:
    """A PNG of each stage's time per batch against the step; None when drawn, else a note."""
    try:  # optional (the bench extra); untyped here
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return NO_MATPLOTLIB
    now, after = _now_bars(report), _after_bars(report)
    order = ["step", "fetch", *(label for _, label in STAGE_COLUMNS[:4]), "h2d", "per batch"]
    labels = [label for label in order if label in now or label in after]
    if not labels:
        return "no chart: no phase measured a time per batch"
    groups: list[tuple[str, ChartBars, str]] = [("now", now, "#3182bd")]
    if report.applied is not None:
        top = ", ".join(f"{k}={v}" for k, v in report.applied.change.items())
        groups.append((f"after {top or report.applied.fix}", after, "#e6550d"))
    height = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) * len(groups) + 1.8))
    try:
        for index, (name, bars, color) in enumerate(groups):
            offset = (index - (len(groups) - 1) / 2) * height
            ys = [row + offset for row, label in enumerate(labels) if label in bars]
            widths = [bars[label] for label in labels if label in bars]
            drawn = ax.barh(ys, widths, height, color=color, label=name)
            ax.bar_label(drawn, labels=[f"{w:,.1f}" for w in widths], padding=3, fontsize=7)
        step_ms = now.get("step")
        if step_ms is not None:
            ax.axvline(step_ms, color="#636363", linestyle="--", linewidth=1, label="the step")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.margins(x=0.08)  # room for the bars' labels
        ax.set_xlabel(f"ms per batch (batch {report.loader.get('batch_size', '?')})")
        ax.set_title(_chart_title(report), fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fig.savefig(tmp, dpi=110, format="png")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    finally:
        plt.close(fig)
    return None


# -- the files ---------------------------------------------------------------------------


def _write_text(path: Path, text: str) -> None:
    """Whole or not at all: a reader never sees half a doctor.json."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write(report: Report, out_dir: Path, *, with_chart: bool = True) -> list[str]:
    """doctor.json and doctor.png in out_dir; returns what was written (or why not), a line each.

    The chart is drawn first so the JSON's ``chart`` names it only when it exists."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    chart_line: str | None = None
    if with_chart:
        png = out_dir / "doctor.png"
        report.chart = str(png)
        try:
            chart_line = chart(report, png)
        except Exception as exc:  # the chart is an extra: the JSON must still be written
            chart_line = f"no chart: {type(exc).__name__}: {exc}"
        if chart_line is not None:
            report.chart = None
        else:
            chart_line = f"wrote {png}"
    json_path = out_dir / "doctor.json"
    _write_text(json_path, report.to_json())
    lines.append(f"wrote {json_path}")
    if chart_line is not None:
        lines.append(chart_line)
    return lines
