"""A process that ends with loader work still in flight ends cleanly: exit code 0 and no
"terminate called" on stderr, however it ends (the end of the script, ``sys.exit``, a
``break`` out of the loop, a SIGTERM handler that exits).

Python 3.11-3.13 end a daemon thread that takes the GIL back during finalization with
``pthread_exit``; unwinding that out of a native call's GIL guard (a destructor, so
noexcept) called ``std::terminate``: "terminate called without an active exception", exit
134, seen from a preemption benchmark's restarted job. Now the loader waits at exit for its
threads to finish the batch in hand, and a native call that returns after that parks its
thread instead (``native/gil_release.hpp``). Real subprocesses, run side by side.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.decode.native_jpeg import native_jpeg_available
from fastload.loader import pipeline as pipeline_module
from fastload.loader.pipeline import Pipeline
from fastload.loader.stats import LoaderStats
from fastload.reader import native_available

# Native calls on a daemon thread, back to back, while the main thread ends.
NATIVE = r"""
import sys, threading, time
import numpy as np

how, path = sys.argv[1:3]
if how == "read":
    from fastload.reader import BatchReader, aligned_empty

    reader = BatchReader(num_threads=2, backend="native")
    size = 64 << 20
    dest = aligned_empty(size)

    def call():
        reader.read([(path, 0, size, dest)])
else:
    from fastload.decode.native_jpeg import jpeg_transform

    transform = jpeg_transform(2)
    images = [open(path, "rb").read()] * 4
    boxes = np.array([[1, 0, 1024, 0, 1024, 0]] * 4, dtype=np.int32)
    out = np.empty((4, 3, 256, 256), dtype=np.float32)

    def call():
        transform.run(images, boxes, out, 256, 256, False, [0.0] * 3, [1.0] * 3)

started = threading.Event()

def loop():
    started.set()
    try:
        while True:
            call()
    except ValueError:  # the reader closed by its exit hook: this loop's last call
        pass

threading.Thread(target=loop, daemon=True).start()
started.wait()
time.sleep(0.3)
"""

# A loader with batches being loaded when the script ends, in one of several ways.
LOADER = r"""
import os, signal, sys, time
import fastload as fl

how, data, cache = sys.argv[1:4]
ds = fl.open_dataset(data, format="files", cache_dir=cache)
loader = fl.DataLoader(ds, batch_size=4, shuffle=True, seed=0, num_workers=2,
                       on_preempt=os.path.join(cache, "state.json"))
if how == "sigterm":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
it = iter(loader)
next(it)
if how == "break":
    for batch in it:
        break
    del it
elif how == "sys.exit":
    sys.exit(0)
elif how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # not reached: the handler exits
# "end": the end of the script, the pass still referenced
"""


def _run_all(scripts: list[tuple[str, list[str]]], cwd: Path) -> None:
    """Runs the scripts side by side; each must exit 0 without "terminate called"."""
    running = []
    for i, (text, args) in enumerate(scripts):
        script = cwd / f"script{i}.py"
        script.write_text(text)
        running.append(
            (
                args,
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                ),
            )
        )
    failures = []
    for args, process in running:
        try:
            _, err = process.communicate(timeout=120)
        finally:
            process.kill()
        stderr = err.decode(errors="replace")
        if process.returncode != 0 or "terminate called" in stderr:
            failures.append(f"{args[0]}: exit {process.returncode}: {stderr[-500:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not native_available(), reason="the native reader is not built")
def test_a_native_read_in_flight_at_exit_ends_the_process_cleanly(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    with open(data, "wb") as f:  # sparse: read fast from the page cache, stored as nothing
        f.truncate(64 << 20)
    _run_all([(NATIVE, ["read", str(data)])] * 2, tmp_path)


@pytest.mark.skipif(not native_jpeg_available(), reason="the native JPEG transform is not built")
def test_a_native_jpeg_transform_in_flight_at_exit_ends_the_process_cleanly(
    tmp_path: Path,
) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
    image = tmp_path / "big.jpg"
    image.write_bytes(encoded.getvalue())
    _run_all([(NATIVE, ["jpeg", str(image)])] * 2, tmp_path)


@pytest.mark.slow
def test_a_loader_with_batches_in_flight_ends_cleanly_however_the_script_ends(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    block = os.urandom(1 << 20)
    for i in range(24):
        (data / f"{i:03d}.bin").write_bytes(block * 4)
    scripts = [
        (LOADER, [how, str(data), str(tmp_path / f"cache-{how}")])
        for how in ("end", "break", "sys.exit", "sigterm")
    ]
    _run_all(scripts, tmp_path)


def test_at_exit_the_loader_waits_for_its_threads_to_finish_the_batch_in_hand() -> None:
    release = threading.Event()

    def load(seq: int, indices: list[int]) -> list[int]:
        if seq > 0:
            release.wait(10)  # a batch still being loaded when the script ends
        return indices

    p = Pipeline(iter([[i] for i in range(100)]), load, workers=2, prefetch=2, stats=LoaderStats())
    assert next(p) == [0]
    p.close()  # as `break` does: it waits a moment, not for the batch in hand
    assert any(t.is_alive() for t in p._threads)
    threading.Timer(0.3, release.set).start()
    pipeline_module._stop_all_at_exit()
    assert not any(t.is_alive() for t in p._threads)


@pytest.mark.skipif(not native_available(), reason="the native reader is not built")
def test_the_thread_running_the_exit_hooks_is_never_parked(tmp_path: Path) -> None:
    # A native call made by a later exit hook, on the thread that runs them, returns.
    script = (
        "import atexit\n"
        "def late():\n"
        "    from fastload import reader\n"
        "    print(len(reader.aligned_empty(4096)))\n"
        "atexit.register(late)\n"
        "import fastload.reader\n"  # its exit hook registered after late's: it runs first
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [b"4096"]
