"""A pod's memory limit for a test: a cgroup v2 directory as the kernel lays it out, read
by ``fastload.resources`` in place of the process's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.resources import CGROUP_ROOT_ENV


def limit_memory(monkeypatch: pytest.MonkeyPatch, root: Path, memory_max: str) -> None:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cpu.max").write_text("max 100000\n")
    (root / "memory.max").write_text(f"{memory_max}\n")
    monkeypatch.setenv(CGROUP_ROOT_ENV, str(root))
