"""The README's main command, `fastload bench --quick`, run as a user runs it.

Its figures are not checked (timing belongs to benchmarks, not tests); what is checked is
that it finishes, exits 0, and writes the report it promises: every quick layout measured
for fastload and for the peers installed here, the JSON, and the chart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def _fastload() -> list[str]:
    script = Path(sys.executable).with_name("fastload")
    if script.exists():
        return [str(script)]
    found = shutil.which("fastload")
    if found is None:
        pytest.fail("the fastload console script is not installed beside this Python")
    return [found]


def why_it_failed(run: dict[str, Any]) -> str:
    """A failed run's note and the end of its log: the reason, not only that it failed."""
    text = f"{run['system']} on {run['layout']} failed: {run.get('note') or 'no note'}"
    logged = re.search(r"\(log: (.+)\)$", run.get("note") or "")
    if logged is not None:
        log = Path(logged.group(1)) / "log.txt"
        lines = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
        text += "\n  " + "\n  ".join(lines or [f"(no log at {log})"])
    return text


def test_bench_quick_exits_0_and_writes_its_json_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [*_fastload(), "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    report = json.loads((out / "e2e.json").read_text())
    chart = out / "e2e.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = report["params"]["runs"]
    ran = {(r["system"], r["layout"]) for r in runs if r["status"] == "ok"}
    assert {("fastload", "folder"), ("fastload", "tar")} <= ran, runs
    failed = [r for r in runs if r["status"] == "failed"]
    assert not failed, "\n\n".join(why_it_failed(r) for r in failed)
    for run in runs:
        if run["status"] == "ok":
            assert run["figures"]["warm_samples_per_s"] > 0, run
    # The table on stdout names every system measured.
    for system, _ in ran:
        assert system in done.stdout
