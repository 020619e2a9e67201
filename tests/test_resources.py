"""Defaults read the container, not the host: real processes pinned with ``taskset`` and given
a fake cgroup directory (``FASTLOAD_CGROUP_ROOT``) laid out as the kernel writes it (v2 and
v1), and what ``loader.stats()`` and ``fastload doctor`` report of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from image_folders import jpeg_folder

from fastload.resources import CGROUP_ROOT_ENV

needs_taskset = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")

# What a process reads at import: the defaults that follow the CPUs and the memory limit.
PROBE = """
import json
from fastload import resources
from fastload.decode.base import DecodeConfig
from fastload.reader import default_num_threads
from fastload.loader.ring import _default_pack_threads
from fastload.store import DEFAULT_HOLD_BYTES
from fastload.datasets.parquet import DEFAULT_ROW_GROUP_CACHE_BYTES
from fastload.datasets.zarr import DEFAULT_CHUNK_CACHE_BYTES
print(json.dumps({
    "resources": resources.resources().as_dict(),
    "note": resources.container_note(),
    "decode_threads": DecodeConfig().num_threads,
    "read_threads": default_num_threads(),
    "pack_threads": _default_pack_threads(),
    "hold_bytes": DEFAULT_HOLD_BYTES,
    "row_group_cache_bytes": DEFAULT_ROW_GROUP_CACHE_BYTES,
    "chunk_cache_bytes": DEFAULT_CHUNK_CACHE_BYTES,
}))
"""

MiB = 1 << 20


def probe(
    *, cgroup: Path | None = None, cpus: str | None = None, code: str = PROBE
) -> dict[str, object]:
    env = dict(os.environ)
    env.pop(CGROUP_ROOT_ENV, None)
    if cgroup is not None:
        env[CGROUP_ROOT_ENV] = str(cgroup)
    command = [sys.executable, "-c", code]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def cgroup_v2(root: Path, cpu_max: str, memory_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cpu.max").write_text(cpu_max + "\n")
    (root / "memory.max").write_text(memory_max + "\n")
    return root


def cgroup_v1(root: Path, quota_us: int, period_us: int, limit_bytes: int) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "memory").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{limit_bytes}\n")
    return root


@needs_taskset
def test_one_pinned_cpu_gives_one_decode_thread() -> None:
    got = probe(cpus="0")
    resources = got["resources"]
    assert isinstance(resources, dict)
    assert resources["affinity_cpus"] == 1
    assert resources["cpus"] == 1
    assert got["decode_threads"] == 1
    assert got["pack_threads"] == 1
    assert got["read_threads"] == 4  # the floor: reads want requests in flight
    if (os.cpu_count() or 1) > 1:
        assert "1 of the host's" in str(got["note"])


def test_cgroup_v2_cpu_max_and_memory_max_lower_the_defaults(tmp_path: Path) -> None:
    # Half a CPU (rounded up to one thread) and 512 MiB: each in-memory default gets 1/16.
    root = cgroup_v2(tmp_path / "pod", "50000 100000", str(512 * MiB))
    got = probe(cgroup=root)
    assert got["resources"] == {
        "cpus": 1,
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "cgroup_cpus": 0.5,
        "memory_limit_bytes": 512 * MiB,
        "cgroup": f"{root} (v2)",
    }
    assert got["decode_threads"] == 1
    assert got["hold_bytes"] == got["row_group_cache_bytes"] == got["chunk_cache_bytes"] == 32 * MiB
    assert "512 MiB" in str(got["note"])


def test_cgroup_v1_quota_and_limit(tmp_path: Path) -> None:
    root = cgroup_v1(tmp_path / "pod", 100000, 100000, 256 * MiB)
    got = probe(cgroup=root)
    resources = got["resources"]
    assert isinstance(resources, dict)
    assert resources["cgroup_cpus"] == 1.0
    assert resources["memory_limit_bytes"] == 256 * MiB
    assert got["decode_threads"] == 1
    assert got["hold_bytes"] == 16 * MiB


def test_no_limits_keep_the_machines_defaults(tmp_path: Path) -> None:
    # v2's "max" and v1's "unlimited" (the largest page-aligned value) are no limit.
    v2 = probe(cgroup=cgroup_v2(tmp_path / "v2", "max 100000", "max"))
    v1 = probe(cgroup=cgroup_v1(tmp_path / "v1", -1, 100000, 9223372036854771712))
    cores = len(os.sched_getaffinity(0))
    for got in (v2, v1):
        resources = got["resources"]
        assert isinstance(resources, dict)
        assert resources["cgroup_cpus"] is None
        assert resources["memory_limit_bytes"] is None
        assert got["decode_threads"] == cores
        assert got["hold_bytes"] == 256 * MiB
        assert got["note"] is None or "memory" not in str(got["note"])


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path: Path) -> None:
    root = cgroup_v2(tmp_path / "pod", "6400000 100000", "max")  # 64 CPUs of quota
    got = probe(cgroup=root)
    assert got["decode_threads"] == len(os.sched_getaffinity(0))


def test_nested_limits_bind_the_child(tmp_path: Path) -> None:
    """On the real hierarchy a parent's limit binds its children; the walk up finds it."""
    from fastload.resources import _levels

    leaf = tmp_path / "kubepods" / "pod1" / "ctr"
    leaf.mkdir(parents=True)
    assert _levels(tmp_path, "/kubepods/pod1/ctr") == [
        leaf,
        leaf.parent,
        leaf.parent.parent,
        tmp_path,
    ]
    assert _levels(tmp_path, "/not/here") == [tmp_path]


@needs_taskset
def test_loader_stats_report_what_was_read(tmp_path: Path) -> None:
    data = jpeg_folder(tmp_path / "data")
    root = cgroup_v2(tmp_path / "pod", "100000 100000", str(1 << 30))
    code = f"""
import json, fastload as fl
from fastload.decode import TrainPreset
loader = fl.DataLoader({str(data)!r}, batch_size=8, cache_dir={str(tmp_path / "cache")!r},
                       decode="cpu", transform=TrainPreset(32))
for _ in loader:
    pass
stats = loader.stats()
loader.close()
print(json.dumps(stats["resources"]))
"""
    got = probe(cgroup=root, cpus="0", code=code)
    assert got["cpus"] == 1
    assert got["affinity_cpus"] == 1
    assert got["cgroup_cpus"] == 1.0
    assert got["memory_limit_bytes"] == 1 << 30


@pytest.mark.slow
@needs_taskset
def test_the_doctor_reports_the_container(tmp_path: Path) -> None:
    data = jpeg_folder(tmp_path / "data", count=64)
    root = cgroup_v2(tmp_path / "pod", "100000 100000", str(2 << 30))
    env = {**os.environ, CGROUP_ROOT_ENV: str(root)}
    fastload = str(Path(sys.executable).parent / "fastload")
    done = subprocess.run(
        ["taskset", "-c", "0", fastload, "doctor", str(data), "--cache-dir", str(tmp_path / "c"),
         "--step-ms", "1", "--size", "32", "--batch-size", "8", "--phase-s", "0.5", "--json",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["node"]["cores"] == 1
    assert report["node"]["resources"]["memory_limit_bytes"] == 2 << 30
    assert any("2,048 MiB" in note for note in report["notes"])


# What a benchmark sizes its workers by, read in a process of its own.
BENCH_PROBE = """
import json
from fastload.bench.gpu.config import GpuCheckConfig
from fastload.bench.runner import machine_info
from fastload.loader.autotune import Bounds
print(json.dumps({
    "gpu_check_threads": GpuCheckConfig().threads,
    "usable_cores": machine_info()["usable_cores"],
    "autotune_max_workers": Bounds.from_setting(True).max_workers,
}))
"""


@needs_taskset
def test_benchmarks_size_their_workers_to_what_the_container_gives(tmp_path: Path) -> None:
    """A pod's benchmark runs as many threads as its quota or affinity allows, not the host's
    cores: pinned to one CPU, or given one CPU of cgroup quota."""
    one = {"gpu_check_threads": 1, "usable_cores": 1, "autotune_max_workers": 1}
    assert probe(cpus="0", code=BENCH_PROBE) == one
    quota = cgroup_v2(tmp_path / "pod", "100000 100000", "max")
    assert probe(cgroup=quota, code=BENCH_PROBE) == one
