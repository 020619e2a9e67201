"""The GPU check: its parts that run anywhere here, the whole of it (quick) on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fastload.bench.gpu import gpu_check
from fastload.bench.gpu.config import GpuCheckConfig, Outcome
from fastload.bench.gpu.doctor_check import DOCTOR_RUNS
from fastload.bench.gpu.transfer import ring_feed
from fastload.bench.runner import Measurement, Report
from fastload.decode.cpu import decode_rgb
from fastload.loader.ring import DeviceRing

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
HAS_CUDA = torch.cuda.is_available()
REFERENCES = {gpu_check.DECODE_REFERENCE, gpu_check.COPY_REFERENCE, gpu_check.STEP_REFERENCE}
HAS_DALI = importlib.util.find_spec("nvidia") is not None and (
    importlib.util.find_spec("nvidia.dali") is not None
)


def parse(*argv: str) -> GpuCheckConfig:
    return gpu_check.config_from_args(gpu_check.build_parser().parse_args(list(argv)))


def test_arguments_choose_the_sizes_and_sections() -> None:
    assert parse() == GpuCheckConfig()
    quick = parse("--quick", "--section", "copy", "--section", "overlap", "--steps", "5")
    assert quick == GpuCheckConfig.quick(sections=("copy", "overlap"), steps=5)
    assert quick.files < GpuCheckConfig().files
    assert parse("--batch-size", "32", "--device", "cuda:1").batch_size == 32
    assert GpuCheckConfig(batch_size=2, size=4).batch_bytes == 2 * 3 * 4 * 4 * 4


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"files": 10, "batch_size": 20}, "files"),
        ({"sections": ("decode", "disk")}, "sections"),
        ({"device": "cpu"}, "cuda"),
        ({"steps": 1}, "steps"),
        ({"repeats": 0}, "repeats"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GpuCheckConfig(**settings)  # type: ignore[arg-type]


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--quick", "--files", "3"])
    assert info.value.code == 2
    assert "files (3) must be >= batch_size" in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="checks what happens without a CUDA device")
def test_without_cuda_the_check_stops_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks what happens without a CUDA device")
def test_the_script_without_cuda_exits_2_and_writes_only_under_out(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "given"), "HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [str(SCRIPT), "--quick"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr
    assert "results in" not in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given"]
    assert not (tmp_path / "given" / "gpu-check" / "gpu_check.json").exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks what happens without a CUDA device")
def test_the_script_skips_a_venv_without_torch(tmp_path: Path) -> None:
    """Offline, make install leaves .venv without torch; python3 with torch must run."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    script = root / "benchmarks" / SCRIPT.name
    script.write_text(SCRIPT.read_text())
    script.chmod(0o755)
    (root / "src").symlink_to(ROOT / "src")
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    (venv / "python").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # this one has torch (the CPU build)
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    env.pop("OUT", None)
    done = subprocess.run(
        [str(script), "--quick", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stderr


def test_generated_jpegs_decode_and_are_kept(tmp_path: Path) -> None:
    paths = gpu_check.generate(tmp_path, 4, threads=2)
    assert [p.relative_to(tmp_path).as_posix() for p in paths[:2]] == [
        "class_000/000000.jpg",
        "class_001/000001.jpg",
    ]
    for path in paths:
        height, width, channels = decode_rgb(path.read_bytes()).shape
        assert 350 <= height <= 500
        assert 400 <= width <= 500
        assert channels == 3
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert gpu_check.generate(tmp_path, 4, threads=2) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.skipif(not HAS_DALI, reason="needs NVIDIA DALI")
def test_dalis_own_gpu_pipeline_is_valid_dali_without_a_gpu(tmp_path: Path) -> None:
    """Defining the graph checks every operator and argument against DALI's schemas."""
    files = [str(p) for p in gpu_check.generate(tmp_path, 2, threads=1)]
    pipe, output = gpu_check.dali_mixed_pipeline(files, GpuCheckConfig.quick(), device_id=0)
    assert output.device == "gpu"
    del pipe


def row(case: str, system: str, seconds: float, **figures: object) -> Measurement:
    return Measurement(
        benchmark="gpu_check",
        case=case,
        system=system,
        seconds=seconds,
        repeats=[seconds],
        **figures,  # type: ignore[arg-type]
    )


def test_tables_show_each_case_and_what_failed(tmp_path: Path) -> None:
    outcome = Outcome()
    outcome.attempt("decode", lambda: row("decode", "a", 2.0, items=100))
    outcome.attempt("copy", lambda: row("copy", "b", 1.0, nbytes=4 * 10**9))
    outcome.attempt("broken", lambda: 1 // 0)
    outcome.attempt("nothing", lambda: None)
    assert [r.system for r in outcome.rows] == ["a", "b"]
    assert outcome.failures == {"broken": "ZeroDivisionError: integer division or modulo by zero"}
    outcome.skipped["dali"] = "DALI not installed"
    report = Report(
        name="gpu_check",
        rows=outcome.rows,
        params={"failures": outcome.failures, "skipped": outcome.skipped},
    )
    text = gpu_check.tables(report)
    assert text.startswith("decode\ncase")
    assert "\n\ncopy\ncase" in text
    assert "4.00" in text  # GB/s
    assert "FAILED broken: ZeroDivisionError" in text
    assert "skipped dali: DALI not installed" in text
    payload = json.loads(report.write_json(tmp_path).read_text())
    assert payload["params"]["failures"] == outcome.failures
    assert payload["rows"][0]["items_per_s"] == 50


def test_copy_ratios_compare_bandwidth_not_time() -> None:
    """The whole ring moves more bytes than the reference copies: GB/s decide, not seconds."""
    rows = [
        row("copy", gpu_check.COPY_REFERENCE, 1.0, nbytes=8 * 10**9),
        row("copy", "ring", 6.0, nbytes=48 * 10**9),
        row("copy", "pageable", 4.0, nbytes=8 * 10**9),
    ]
    ratios = {r.system: r.ratio for r in gpu_check.relate_bandwidth(rows, gpu_check.COPY_REFERENCE)}
    assert ratios == {gpu_check.COPY_REFERENCE: 1.0, "ring": 1.0, "pageable": 0.25}
    alone = gpu_check.relate_bandwidth(rows[1:], gpu_check.COPY_REFERENCE)
    assert [r.ratio for r in alone] == [None, None]


def test_ring_feed_delivers_every_batch_then_leaves_the_ring_open() -> None:
    batches = [{"x": torch.full((3,), float(i))} for i in range(2)]
    with DeviceRing("cpu", slots=2) as ring:
        for _ in range(2):  # a finished feed keeps the ring for the next
            with ring_feed(ring, batches, 5) as got:
                values = [float(b["x"][0]) for b in got]
            assert values == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert ring.stats()["delivered"] == 10


def test_ring_feed_stops_its_producer_when_the_consumer_stops_early() -> None:
    before = set(threading.enumerate())
    ring = DeviceRing("cpu", slots=2)
    with ring_feed(ring, [torch.zeros(4)]) as got:  # endless
        assert [next(got) for _ in range(3)]
    producers = [t for t in set(threading.enumerate()) - before if t.name == "gpu-check-producer"]
    assert not producers
    assert ring.stats()["slot_bytes_held"] == 0  # closed


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_the_whole_check_runs_in_quick_mode(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"results in {tmp_path / 'gpu_check.json'}" in done.stdout
    payload = json.loads((tmp_path / "gpu_check.json").read_text())
    systems = {r["system"] for r in payload["rows"]}
    assert {"fastload CPU", gpu_check.COPY_REFERENCE, gpu_check.STEP_REFERENCE} <= systems
    assert "DeviceRing put/get, producer thread" in systems
    assert "DeviceRing, batch written into the slot" in systems
    for decode in ("auto", "cpu"):  # each loader alone and feeding the step
        name = f"fastload.DataLoader(decode={decode!r})"
        assert {name, f"{name} alone"} <= systems
    assert sum(s.endswith("GPU(s)") for s in systems) == 2  # 1 rank and N ranks
    assert set(DOCTOR_RUNS) <= systems
    assert payload["params"]["failures"] == {}
    assert payload["params"]["gpu"]["name"]
    if HAS_DALI:
        assert {"fastload DALI, mixed", gpu_check.DECODE_REFERENCE} <= systems
    # Without DALI the decode rows have no reference; every other case has its own.
    referenced = {r["case"] for r in payload["rows"] if r["system"] in REFERENCES}
    rows = [r for r in payload["rows"] if r["case"] in referenced]
    assert len(referenced) == (3 if HAS_DALI else 2)
    assert all(r["ratio"] is not None for r in rows), payload["rows"]
    print(done.stdout, file=sys.stderr)
