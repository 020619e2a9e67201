"""The GPU check's ``doctor`` and ``ranks`` sections.

``doctor``: ``fastload doctor`` on the GPU, as a user runs it (the command line, ``--json``),
over the check's JPEGs, twice:

- ``--model resnet50`` on CUDA (bf16 autocast, channels_last): the ``h2d`` phase and a real
  model's step;
- a 20 ms step with ``--decode cpu --apply``: decoding binds, so the DALI probe runs
  (``decode="dali"`` on the GPU) and ``--apply`` measures its prediction.

``ranks``: :mod:`fastload.bench.gpu.ranks`, 1 rank and N at once (a rank per GPU, at least
two sharing one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fastload.bench.gpu.config import GpuCheckConfig, Outcome
from fastload.bench.runner import Measurement

DOCTOR_RUNS: dict[str, list[str]] = {
    "doctor --model resnet50": ["--model", "resnet50", "--decode", "auto"],
    "doctor, 20 ms step, --decode cpu --apply": ["--step-ms", "20", "--decode", "cpu", "--apply"],
}


def doctor_command(data: Path, out: Path, config: GpuCheckConfig, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastload.cli",
        "doctor",
        str(data),
        "--out",
        str(out),
        "--json",
        "--no-chart",
        "--device",
        config.device,
        "--batch-size",
        str(config.batch_size),
        "--workers",
        str(config.threads),
        "--phase-s",
        str(config.doctor_phase_s),
        *extra,
    ]


def summarize_doctor(report: dict[str, Any]) -> dict[str, float]:
    """The figures a GPU run of the doctor is for: the h2d phase, the DALI probe's rate, and
    --apply's measured against predicted samples/s."""
    figures: dict[str, float] = {}
    h2d = report.get("phases", {}).get("h2d") or {}
    if h2d.get("step_s"):
        figures["h2d ms"] = 1000 * float(h2d["step_s"])
    train = report.get("phases", {}).get("train") or {}
    if train.get("samples_per_s"):
        figures["img/s"] = float(train["samples_per_s"])
    for fix in report.get("fixes", []):
        if fix.get("name") == "dali":
            figures["DALI probe img/s"] = float(fix["predicted_samples_per_s"])
    applied = report.get("applied") or {}
    if applied:
        figures["apply predicted"] = float(applied["predicted_samples_per_s"])
        figures["apply measured"] = float(applied["measured_samples_per_s"])
    return figures


def measure_doctor(data: Path, out: Path, config: GpuCheckConfig, outcome: Outcome) -> None:
    for system, extra in DOCTOR_RUNS.items():

        def run(system: str = system, extra: list[str] = extra) -> Measurement:
            where = out / "doctor" / system.split(",")[0].replace(" ", "_").replace("-", "")
            command = doctor_command(data, where, config, extra)
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-600:]}")
            report = json.loads(done.stdout)
            where.mkdir(parents=True, exist_ok=True)
            (where / "doctor_report.json").write_text(done.stdout)
            return Measurement(
                benchmark="gpu_check",
                case="fastload doctor on the GPU",
                system=system,
                seconds=float(report.get("budget_s", 0.0)),
                repeats=[],
                note=f"bottleneck: {report.get('bottleneck')}",
                extra=summarize_doctor(report),
            )

        outcome.attempt(system, run)


def measure_ranks(data: Path, out: Path, config: GpuCheckConfig, outcome: Outcome) -> None:
    from fastload.bench.gpu.ranks import RankConfig, default_ranks, run_node

    rank_config = RankConfig(
        data=str(data),
        cache_dir=str(out / "ranks-cache"),
        device=config.device,
        decode="auto",
        batch_size=config.batch_size,
        size=config.size,
        batches=config.rank_batches,
    )
    n = config.ranks or default_ranks(config.device)
    case = f"fl.DataLoader(decode='auto') per rank, batch {config.batch_size}"
    for ranks in dict.fromkeys((1, n)):

        def run(ranks: int = ranks) -> Measurement:
            node = run_node(rank_config, ranks, out)
            (out / f"ranks-{ranks}.json").write_text(json.dumps(node, indent=1))
            seconds = max(r["seconds"] for r in node["per_rank"])
            return Measurement(
                benchmark="gpu_check",
                case=case,
                system=f"{ranks} rank(s) on {node['gpus']} GPU(s)",
                seconds=seconds,
                repeats=[seconds],
                items=sum(r["images"] for r in node["per_rank"]),
                note="per rank img/s: "
                + ", ".join(f"{v:,.0f}" for v in node["per_rank_images_per_s"]),
                extra={
                    "slowest rank img/s": min(node["per_rank_images_per_s"]),
                    "cores/GPU": node["cores_per_gpu"],
                },
            )

        outcome.attempt(f"{ranks} rank(s)", run)
