"""The installed ``fastload`` console script: a thin shell with the README's exit codes
(0 success, 1 the work failed, 2 bad usage)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

FASTLOAD = str(Path(sys.executable).parent / "fastload")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # Generous: `bench --components --quick` ran 4 min on a loaded 2-core machine.
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=900, check=False, cwd=cwd
    )


def test_version_is_the_installed_one() -> None:
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"fastload {version('fastload')}"


def test_help_lists_every_command_of_the_design() -> None:
    out = run("--help")
    assert out.returncode == 0
    for command in ("warm", "cache", "bench", "doctor"):
        assert command in out.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["cache", "shred"],
        ["warm"],
        ["warm", "/x", "--max-bytes", "lots"],
        ["warm", "/x", "--rank", "0", "--world-size", "2"],  # --epochs missing
        ["warm", "/x", "--rank", "0", "--world-size", "2", "--epochs", "3..1"],
    ],
)
def test_bad_usage_exits_2(args) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1  # one line, pointing at the usage
    assert "(see fastload" in out.stderr
    assert "--help)" in out.stderr


def test_bench_on_a_missing_dataset_fails_with_one_line(tmp_path: Path) -> None:
    out = run("bench", str(tmp_path / "missing"), "--out", str(tmp_path / "results"))
    assert out.returncode == 1
    assert "missing" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_quick_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = run("bench", "--components", "--quick", "--out", str(tmp_path / "results"))
    assert out.returncode == 0, out.stderr
    assert "cat > /dev/null" in out.stdout
    assert "fastload native reader" in out.stdout
    result = json.loads((tmp_path / "results" / "read.json").read_text())
    assert {r["system"] for r in result["rows"]} >= {"cat > /dev/null", "Python readinto loop"}
    assert result["machine"]["cores"] >= 1
    scale = json.loads((tmp_path / "results" / "cache_scale.json").read_text())
    assert all(r["extra"]["evicted"] > 0 for r in scale["rows"] if r["system"] != "pin")


@pytest.mark.parametrize(
    ("args", "steps"),
    [
        (["bench"], ("sleep", "gil")),  # the full run: both steps for every system
        (["bench", "--quick"], ("sleep",)),  # the README's 2.5 minutes stay so
        (["bench", "--quick", "--step-holds-gil"], ("sleep", "gil")),
        (["bench", "--no-step-holds-gil"], ("sleep",)),
    ],
)
def test_bench_runs_the_gil_holding_step_beside_the_sleeping_one(args, steps) -> None:
    from fastload import cli

    config = cli.bench_config(cli.build_parser().parse_args(args))
    assert config.steps == steps


def test_bench_components_pass_the_gil_step_to_the_loader_benchmark() -> None:
    from fastload import cli

    parsed = cli.build_parser().parse_args(["bench", "--components", "--step-holds-gil"])
    assert parsed.step_holds_gil is True
    assert cli.build_parser().parse_args(["bench"]).step_holds_gil is None
