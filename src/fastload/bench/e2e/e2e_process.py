"""Runs one system of the end-to-end benchmark in a process of its own, and watches it.

A process per (system, layout) gives each its own peak RSS and CPU time (``ru_maxrss``,
``getrusage`` in the child), a fresh interpreter, and the right environment: the peers that
need torchvision run with ``.venv-peers``' Python. Children import the fastload package in
use here through a PYTHONPATH folder that holds only a link to it (:func:`python_path_dir`),
so both environments run the same code and neither sees the other's packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastload.bench.e2e.e2e_child import MARK
from fastload.bench.e2e.e2e_report import Run
from fastload.bench.runner import process_tree, pss_bytes
from fastload.staging.lifetime import env_for_child
from fastload.testing.http_server import LoopbackServer


@contextmanager
def _sampling_memory(pid: int, period_s: float = 0.2) -> Iterator[list[int]]:
    """Samples the PSS of pid's process tree until the block ends; yields [peak]."""
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(period_s):
            peak[0] = max(peak[0], sum(pss_bytes(p) for p in process_tree(pid)))

    thread = threading.Thread(target=sample, name="e2e-pss", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join(5)


def python_path_dir(work: Path) -> Path:
    """A folder holding only a link to the fastload package in use, for children's
    PYTHONPATH: the peers' venv then imports this same code and none of our venv."""
    import fastload

    folder = work / "pythonpath"
    link = folder / "fastload"
    target = Path(fastload.__file__).resolve().parent
    if not (link.is_symlink() and link.resolve() == target):
        folder.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return folder


def child_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(python_path_dir(work)), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env_for_child(env)  # a child ends with this process (staging.lifetime)


def run_child(
    python: str,
    spec: dict[str, Any],
    run_dir: Path,
    server: LoopbackServer | None,
    timeout_s: float,
) -> Run:
    """Runs ``e2e_child run`` for spec with ``python``, in a process of its own; counts
    what the server sent at each of its marks and samples its memory. Never raises for
    the child's failures: the run says what went wrong and where its log is."""
    run = Run(system=spec["system"], layout=spec["layout"], step=spec.get("step", "sleep"))
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # The spec holds the run's storage_options (a user's credentials with `bench URL`): only
    # its owner may read it while the child runs, and it is gone once the child has ended.
    spec_path = run_dir / "spec.json"
    spec_path.touch(mode=0o600)
    spec_path.write_text(json.dumps(spec))
    result_path = run_dir / "result.json"
    cmd = [python, "-m", "fastload.bench.e2e.e2e_child", "run", "spec.json", "result.json"]
    if server is not None:
        server.reset_stats()
        server_cpu_before = server.cpu_s  # its request threads only, not our sampler
    start = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=run_dir,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=child_env(run_dir.parent),
            start_new_session=True,  # so a timeout can end its workers too
        )

        def follow() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(MARK) and server is not None:
                    stats = server.stats()
                    run.marks.append(
                        {
                            "mark": line[len(MARK) :].strip(),
                            "at_s": time.perf_counter() - start,
                            "remote_bytes": stats.bytes_sent,
                            "remote_requests": stats.total,
                        }
                    )
                elif not line.startswith(MARK):
                    log.write(line)

        reader = threading.Thread(target=follow, name="e2e-stdout", daemon=True)
        reader.start()
        with _sampling_memory(proc.pid) as peak:
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                code = proc.wait(30)
                run.status, run.note = "failed", f"timed out after {timeout_s:g} s"
        reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
    spec_path.unlink(missing_ok=True)
    run.wall_s = time.perf_counter() - start
    run.peak_tree_pss_bytes = peak[0] or None
    if server is not None:
        run.server_cpu_s = server.cpu_s - server_cpu_before
        stats = server.stats()
        run.remote_bytes, run.remote_requests = stats.bytes_sent, stats.total
    if run.status == "ok" and (code != 0 or not result_path.exists()):
        tail = (run_dir / "log.txt").read_text().strip().splitlines()[-1:] or ["no output"]
        run.status, run.note = "failed", f"exit {code}: {tail[0][:300]} (log: {run_dir})"
    if run.status == "ok":
        run.result = json.loads(result_path.read_text())
    return run


def default_peers_python() -> str | None:
    """``$FASTLOAD_PEERS_PYTHON``, else ``.venv-peers`` here or beside the source tree."""
    given = os.environ.get("FASTLOAD_PEERS_PYTHON")
    if given:
        return given
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        candidate = base / ".venv-peers" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


def probe_python(python: str, modules: Sequence[str], work: Path) -> dict[str, str | None]:
    """Version of each module importable by ``python`` (None: it does not import)."""
    code = (
        "import importlib, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        found[name] = str(getattr(importlib.import_module(name), '__version__', '?'))\n"
        "    except Exception:\n"
        "        found[name] = None\n"
        "print(json.dumps(found))\n"
    )
    try:
        out = subprocess.run(
            [python, "-c", code, *modules],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(work),
            check=False,
        )
        found: dict[str, str | None] = json.loads(out.stdout.strip().splitlines()[-1])
        return found
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return dict.fromkeys(modules)
