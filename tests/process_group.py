"""Runs a test file as the ranks of a real gloo process group (one subprocess a rank)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_group(
    script: str,
    world_size: int,
    out: Path,
    args: list[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Runs ``script --out OUT/rank<R>.json ARGS`` as ``world_size`` ranks (torchrun's
    environment: MASTER_ADDR/PORT, WORLD_SIZE, RANK); returns each rank's JSON result. A
    rank that fails or outlives ``timeout_s`` fails the test with its log."""
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
        **(env or {}),
    }
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"rank{rank}.log" for rank in range(world_size)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world_size):
            with open(logs[rank], "wb") as log:  # a file, not a pipe: no child blocks on it
                procs.append(
                    subprocess.Popen(
                        [sys.executable, script, "--out", str(out / f"rank{rank}.json"), *args],
                        env={**base, "RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (
            f"rank {rank} exited with {p.returncode}:\n{logs[rank].read_text()}"
        )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
