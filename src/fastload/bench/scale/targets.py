"""P11's targets for the scale benchmark (at 1.28 M samples, 2 cores, 20 ms a request):
checked against the cases' figures into ``report.params["targets"]`` and printed."""

from __future__ import annotations

from typing import Any

from fastload.bench.runner import Report
from fastload.bench.scale.cases import Case
from fastload.bench.scale.config import (
    TARGET_CACHED_OPEN_S,
    TARGET_CPU_US_PER_OBJECT,
    TARGET_FIRST_BATCH_S,
    TARGET_FIRST_OPEN_S,
    TARGET_PICKLED_BYTES,
    TARGET_PLAN_S,
    TARGET_USS_PER_SAMPLE,
    ScaleBenchConfig,
)


def checked_targets(folder: Case, tar: Case, config: ScaleBenchConfig) -> list[dict[str, Any]]:
    """P11's targets against the figures: each {target, bound, measured, met}."""
    f, t = folder.figures, tar.figures
    rows: list[tuple[str, float | None, float, str]] = [
        ("folder first open s", f.get("first_open_s"), TARGET_FIRST_OPEN_S, "<="),
        (
            "folder first open client CPU us/object",
            f.get("first_open_cpu_us"),
            TARGET_CPU_US_PER_OBJECT,
            "<=",
        ),
        ("folder cached open s", f.get("cached_open_s"), TARGET_CACHED_OPEN_S, "<="),
        ("folder USS B/sample per process", f.get("uss_per_sample"), TARGET_USS_PER_SAMPLE, "<="),
        (
            "folder USS B/sample of the process that listed",
            f.get("first_open_uss_per_sample"),
            TARGET_USS_PER_SAMPLE,
            "<=",
        ),
        ("folder pickled bytes", f.get("pickled_bytes"), TARGET_PICKLED_BYTES, "<="),
        (
            "folder USS B/sample per DataLoader worker process",
            f.get("worker_uss_per_sample"),
            TARGET_USS_PER_SAMPLE,
            "<=",
        ),
        (
            "folder first batch s after a cached open",
            f.get("first_batch_s"),
            TARGET_FIRST_BATCH_S,
            "<=",
        ),
        ("folder plan s per rank-epoch", f.get("plan_s"), TARGET_PLAN_S, "<="),
        ("tar first open s (shardindex.json)", t.get("first_open_s"), TARGET_FIRST_OPEN_S, "<="),
        ("tar cached open s", t.get("cached_open_s"), TARGET_CACHED_OPEN_S, "<="),
        ("tar pickled bytes", t.get("pickled_bytes"), TARGET_PICKLED_BYTES, "<="),
        ("tar first batch s after open", t.get("first_batch_s"), TARGET_FIRST_BATCH_S, "<="),
        ("tar plan s per rank-epoch", t.get("plan_s"), TARGET_PLAN_S, "<="),
        *(
            [
                (
                    "tar first batch s after open, fastload's index",
                    t.get("first_batch_s_fastload_index"),
                    TARGET_FIRST_BATCH_S,
                    "<=",
                ),
                (
                    "tar pickled bytes, fastload's index",
                    t.get("pickled_bytes_fastload_index"),
                    TARGET_PICKLED_BYTES,
                    "<=",
                ),
            ]
            if config.fastload_index
            else []
        ),
        (
            f"tar node share: fraction of shard bytes fetched (1/{config.node_share})",
            t.get("share_fraction"),
            1 / config.node_share,
            "<=",
        ),
    ]
    if "node_cold_listings" in f:
        rows += [
            (
                f"folder: {config.processes} processes list once (pages, vs one process's)",
                f["node_cold_listings"],
                f["listings"],
                "==",
            ),
            (
                f"folder: {config.processes} processes' PSS MB",
                f["node_cold_pss"] / 1e6,
                f["node_cold_pss_bound"] / 1e6,
                "<=",
            ),
        ]
    found = []
    for name, measured, bound, op in rows:
        met = None if measured is None else (measured == bound if op == "==" else measured <= bound)
        found.append({"target": name, "op": op, "bound": bound, "measured": measured, "met": met})
    return found


def target_lines(report: Report) -> list[str]:
    """P11's targets, one line each: measured, bound, met or missed."""
    lines = [f"P11 at {report.params.get('objects', 0):,} objects:"]
    for t in report.params.get("targets", []):
        measured = "n/a" if t["measured"] is None else _short(t["measured"])
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  {t['target']}: {measured} ({t['op']} {_short(t['bound'])}) {verdict}")
    return lines


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
