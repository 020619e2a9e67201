"""The batched reader, both backends, against plain Python reads of the same bytes."""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload
from fastload import reader as reader_module
from fastload.errors import InvalidDestinationError, ReadError, ShortReadError
from fastload.reader import BatchReader, aligned_empty


def expected(content: bytes, offset: int, length: int) -> bytes:
    return content[offset : offset + length]


def test_random_offsets_and_lengths_match_python_reads(reader: BatchReader, data_file) -> None:
    path, content = data_file
    rng = np.random.default_rng(1)
    offsets = rng.integers(0, len(content) + 1000, 3000)  # some start past the end
    lengths = rng.integers(0, 20_000, 3000)
    dest = np.zeros(int(lengths.sum()), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    got = reader.read(
        (path, int(o), int(n), dest, int(s))
        for o, n, s in zip(offsets, lengths, starts, strict=True)
    )
    for o, n, s, g in zip(offsets, lengths, starts, got, strict=True):
        want = expected(content, int(o), int(n))
        assert g == len(want)
        assert dest[s : s + g].tobytes() == want


@settings(max_examples=60, deadline=None)
@given(
    reads=st.lists(
        st.tuples(st.integers(0, (1 << 20) + 200), st.integers(0, 70_000)), min_size=1, max_size=20
    ),
    chunk_bytes=st.sampled_from([1, 4096, 65536, 8 << 20]),
    backend=st.sampled_from(["native", "python"] if fastload.native_available() else ["python"]),
)
def test_chunked_reads_match_for_any_chunk_size(
    tmp_path_factory, reads, chunk_bytes, backend
) -> None:
    path = tmp_path_factory.getbasetemp() / "hypothesis.bin"
    if not path.exists():
        path.write_bytes(
            np.random.default_rng(2).integers(0, 256, (1 << 20) + 7, np.uint8).tobytes()
        )
    content = path.read_bytes()
    dests = [bytearray(n) for _, n in reads]
    with BatchReader(num_threads=3, chunk_bytes=chunk_bytes, backend=backend) as r:
        got = r.read((path, o, n, d) for (o, n), d in zip(reads, dests, strict=True))
    for (o, n), d, g in zip(reads, dests, got, strict=True):
        want = expected(content, o, n)
        assert g == len(want)
        assert bytes(d[:g]) == want


def test_zero_length_reads_write_nothing(reader: BatchReader, data_file) -> None:
    path, _ = data_file
    dest = bytearray(b"\xaa" * 8)
    assert list(reader.read([(path, 0, 0, dest, 0), (path, 5, 0, dest, 8)])) == [0, 0]
    assert dest == bytearray(b"\xaa" * 8)
    assert len(reader.read([])) == 0


def test_reads_past_the_end_are_short(reader: BatchReader, data_file) -> None:
    path, content = data_file
    dest = bytearray(b"\xaa" * 300)
    got = reader.read(
        [(path, len(content) - 100, 200, dest), (path, len(content) + 5, 50, dest, 250)]
    )
    assert list(got) == [100, 0]
    assert bytes(dest[:100]) == content[-100:]
    assert dest[100:] == bytearray(b"\xaa" * 200)  # nothing beyond what was read is touched


def test_exact_read_that_ends_early_names_the_file(reader: BatchReader, data_file) -> None:
    path, content = data_file
    with pytest.raises(ShortReadError, match=r"read only 10 of 20 bytes .*data\.bin") as info:
        reader.read([(path, len(content) - 10, 20, bytearray(20))], exact=True)
    assert info.value.filename == str(path)


def test_missing_file_raises_naming_the_path(reader: BatchReader, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.jpg"
    with pytest.raises(ReadError, match=re.escape(str(missing))) as info:
        reader.read([(missing, 0, 10, bytearray(10))])
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(missing)
    assert isinstance(info.value, OSError)


def test_one_failure_among_many_reports_it_and_counts_the_rest(
    reader: BatchReader, data_file, tmp_path: Path
) -> None:
    path, _ = data_file
    dest = bytearray(100)
    requests = [
        (path, 0, 10, dest, 0),
        (tmp_path / "a", 0, 10, dest, 10),
        (tmp_path / "b", 0, 10, dest, 20),
    ]
    with pytest.raises(ReadError, match=r"'[^']*/a' failed \(1 other requests failed too\)"):
        reader.read(requests)


def test_directory_is_unreadable_with_a_clear_error(reader: BatchReader, tmp_path: Path) -> None:
    with pytest.raises(ReadError, match=re.escape(str(tmp_path))) as info:
        reader.read([(tmp_path, 0, 10, bytearray(10))])
    assert info.value.errno == errno.EISDIR


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_file_without_read_permission(reader: BatchReader, data_file) -> None:
    path, _ = data_file
    path.chmod(0)
    with pytest.raises(ReadError, match=re.escape(str(path))) as info:
        reader.read([(path, 0, 10, bytearray(10))])
    assert info.value.errno == errno.EACCES


def test_open_descriptors_are_read_and_left_open(reader: BatchReader, data_file) -> None:
    path, content = data_file
    fd = os.open(path, os.O_RDONLY)
    try:
        dest = bytearray(1000)
        assert list(reader.read([(fd, 500, 1000, dest)])) == [1000]
        assert bytes(dest) == content[500:1500]
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


def test_write_only_descriptor_fails_naming_the_descriptor(
    reader: BatchReader, tmp_path: Path
) -> None:
    fd = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ReadError, match=rf"file descriptor {fd}\b") as info:
            reader.read([(fd, 0, 10, bytearray(10))])
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)


def test_thousands_of_small_requests_over_many_files(reader: BatchReader, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    contents = []
    for i in range(40):
        data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
        (tmp_path / f"{i}.bin").write_bytes(data)
        contents.append(data)
    requests, wants = [], []
    dest = np.zeros(5000 * 64, dtype=np.uint8)
    for k in range(5000):
        i = int(rng.integers(0, 40))
        o = int(rng.integers(0, len(contents[i])))
        n = int(rng.integers(0, 64))
        requests.append((tmp_path / f"{i}.bin", o, n, dest, k * 64))
        wants.append(expected(contents[i], o, n))
    got = reader.read(requests)
    for k, want in enumerate(wants):
        assert got[k] == len(want)
        assert dest[k * 64 : k * 64 + len(want)].tobytes() == want


@pytest.mark.parametrize("backend", ["native", "python"])
@pytest.mark.parametrize("num_threads", [0, 1, 16])
def test_any_thread_count_gives_the_same_bytes(backend, num_threads, data_file) -> None:
    if backend == "native" and not fastload.native_available():
        pytest.skip("native backend disabled")
    path, content = data_file
    dest = aligned_empty(len(content))
    with BatchReader(num_threads=num_threads, chunk_bytes=10_000, backend=backend) as r:
        got = r.read(
            [
                (path, at, min(50_000, len(content) - at), dest, at)
                for at in range(0, len(content), 50_000)
            ]
        )
    assert int(got.sum()) == len(content)
    assert dest.tobytes() == content


def test_one_reader_serves_many_python_threads(reader: BatchReader, data_file) -> None:
    path, content = data_file
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                o = int(rng.integers(0, len(content)))
                n = int(rng.integers(0, 100_000))
                dest = bytearray(n)
                got = reader.read([(path, o, n, dest)])
                assert bytes(dest[: got[0]]) == expected(content, o, n)
        except BaseException as exc:  # handed to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_the_gil_is_released_while_reading(reader: BatchReader) -> None:
    """A Python thread keeps running while a long read is in flight.

    /dev/zero makes the read long without a large file. If the reader held the GIL, the
    sampling thread could not run at all between the read's start and end.
    """
    dest = aligned_empty(64 << 20)
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(time.monotonic())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        blocks = 32
        while True:
            start = time.monotonic()
            reader.read([("/dev/zero", 0, len(dest), dest)] * blocks)
            end = time.monotonic()
            if end - start >= 0.2 or blocks >= 4096:
                break
            blocks *= 2  # make the read long enough to see the sampler inside it
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert end - start >= 0.2
    inside = [t for t in samples if start + 0.02 < t < end - 0.02]
    assert len(inside) >= 20, f"only {len(inside)} samples during a {end - start:.2f}s read"


# --- destination checks: each raises before anything is read -------------------------------


def bad_destinations() -> dict[str, object]:
    return {
        "read-only bytes": (bytes(100), "read-only"),
        "read-only numpy": (np.zeros(100, np.uint8).view(), "read-only"),
        "non-contiguous numpy": (np.zeros(200, np.uint8)[::2], "not C-contiguous"),
        "float32 numpy": (np.zeros(100, np.float32), "must hold bytes"),
        "int16 numpy": (np.zeros(100, np.int16), "must hold bytes"),
        "too small": (bytearray(10), "too small"),
        "not a buffer": ([0] * 100, "does not export a buffer"),
        "float tensor": (torch.zeros(100), "torch.float32"),
        "non-contiguous tensor": (torch.zeros(200, dtype=torch.uint8)[::2], "not contiguous"),
    }


@pytest.mark.parametrize("case", list(bad_destinations()))
def test_bad_destination_is_refused_and_nothing_is_written(
    reader: BatchReader, data_file, case
) -> None:
    path, _ = data_file
    bad, message = bad_destinations()[case]
    if case == "read-only numpy":
        bad.flags.writeable = False
    good = bytearray(b"\xaa" * 50)
    with pytest.raises(InvalidDestinationError, match=message):
        reader.read([(path, 0, 50, good), (path, 0, 50, bad, 0)])
    assert good == bytearray(b"\xaa" * 50)  # the valid request before it was not read either


def test_negative_offsets_are_refused(reader: BatchReader, data_file) -> None:
    path, _ = data_file
    with pytest.raises(ValueError, match="must be >= 0"):
        reader.read([(path, -1, 10, bytearray(10))])
    with pytest.raises(ValueError, match="must be >= 0"):
        reader.read([(-3, 0, 10, bytearray(10))])


def test_torch_and_multidimensional_numpy_destinations_are_filled_in_place(
    reader: BatchReader, data_file
) -> None:
    path, content = data_file
    tensor = torch.zeros(1000, dtype=torch.uint8)
    image = np.zeros((10, 10, 3), np.uint8)
    reader.read([(path, 0, 1000, tensor), (path, 1000, 300, image)])
    assert tensor.numpy().tobytes() == content[:1000]
    assert image.tobytes() == content[1000:1300]


@pytest.mark.skipif(not fastload.native_available(), reason="native backend disabled")
def test_native_layer_checks_requests_on_its_own() -> None:
    """The C++ binding does not trust its Python caller: bad rows raise instead of writing."""
    from fastload import _native

    r = _native.Reader(2)
    ok = bytearray(10)
    row = np.array([[0, 0, 10, 0, 0]], np.int64)
    with pytest.raises(ValueError, match="too small"):
        r.read(["/dev/zero"], [ok], np.array([[0, 0, 11, 0, 0]], np.int64))
    with pytest.raises(ValueError, match="too small"):
        r.read(["/dev/zero"], [ok], np.array([[0, 0, 2, 0, 9]], np.int64))
    with pytest.raises(IndexError, match="destination index"):
        r.read(["/dev/zero"], [ok], np.array([[0, 0, 1, 1, 0]], np.int64))
    with pytest.raises(IndexError, match="file index"):
        r.read(["/dev/zero"], [ok], np.array([[2, 0, 1, 0, 0]], np.int64))
    with pytest.raises(ValueError, match=">= 0"):
        r.read(["/dev/zero"], [ok], np.array([[0, 0, -1, 0, 0]], np.int64))
    with pytest.raises(ValueError, match="writable"):
        r.read(["/dev/zero"], [b"0123456789"], row)
    with pytest.raises(ValueError, match="must hold bytes"):
        r.read(["/dev/zero"], [np.zeros(10, np.float32)], row)
    with pytest.raises(TypeError):
        r.read([1.5], [ok], row)
    ok[:] = b"\xaa" * 10
    assert list(r.read(["/dev/zero"], [ok], row)) == [10]
    assert ok == bytearray(10)


# --- aligned buffers ------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16])
def test_aligned_buffers_are_aligned_writable_and_zero_copy(monkeypatch, native, alignment) -> None:
    if native and not fastload.native_available():
        pytest.skip("native backend disabled")
    if not native:
        monkeypatch.setattr(reader_module, "_native", None)
    buf = aligned_empty(1_000_003, alignment=alignment)
    assert buf.dtype == np.uint8
    assert buf.shape == (1_000_003,)
    assert buf.ctypes.data % alignment == 0
    assert buf.flags.writeable
    assert buf.flags.c_contiguous
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    assert tensor.data_ptr() == buf.ctypes.data  # the same memory, not a copy
    tensor[7] = 42
    assert buf[7] == 42
    assert aligned_empty(0, alignment=alignment).size == 0


def test_aligned_buffer_outlives_its_creator_scope() -> None:
    tensor = torch.frombuffer(aligned_empty(1 << 20), dtype=torch.uint8)
    tensor.fill_(3)  # the array is gone; the tensor keeps the memory alive
    assert int(tensor.sum()) == 3 << 20


@pytest.mark.parametrize("alignment", [0, 3, 100])
def test_bad_alignment_is_refused(alignment) -> None:
    with pytest.raises(ValueError, match="power of two"):
        aligned_empty(10, alignment=alignment)


# --- backend selection and process life -----------------------------------------------------


def test_installed_build_has_the_native_backend() -> None:
    if os.environ.get("FASTLOAD_NATIVE") == "0":
        pytest.skip("native backend disabled by FASTLOAD_NATIVE=0")
    assert fastload.native_available(), fastload.native_status()
    assert BatchReader().backend == "native"


def test_environment_variable_forces_the_python_backend() -> None:
    code = (
        "import fastload as f; "
        "print(f.native_available(), f.BatchReader().backend, f.native_status())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "FASTLOAD_NATIVE": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split()[:2] == ["False", "python"]
    assert "FASTLOAD_NATIVE=0" in out.stdout


def test_asking_for_native_when_disabled_says_how_to_fix(monkeypatch) -> None:
    monkeypatch.setattr(reader_module, "_native", None)
    with pytest.raises(ImportError, match="reinstall fastload"):
        BatchReader(backend="native")


def _child_read(r: BatchReader, path: str, conn) -> None:
    dest = bytearray(4096)
    r.read([(path, 0, 4096, dest)])
    conn.send(bytes(dest))


def test_reader_keeps_working_in_a_forked_child(reader: BatchReader, data_file) -> None:
    """DataLoader workers fork; the parent's threads do not exist in the child."""
    path, content = data_file
    reader.read([(path, 0, 10, bytearray(10))])  # start the parent's threads first
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_read, args=(reader, str(path), child))
    proc.start()
    try:
        assert parent.poll(30), "child did not answer"
        assert parent.recv() == content[:4096]
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        parent.close()
        child.close()
    assert proc.exitcode == 0
    assert list(reader.read([(path, 0, 10, bytearray(10))])) == [10]  # parent unaffected


# Runs in a fresh interpreter: in pytest's own process the child's collection would also
# meet earlier tests' objects (s3fs instances whose finalizers wait on an event loop the
# child does not have, a second each), which is not what this checks.
_FORKED_COLLECTION = """
import faulthandler, gc, multiprocessing, sys
import fastload
from fastload.reader import BatchReader

class Cycle:  # holds a reader in a reference cycle: only the garbage collector frees it
    def __init__(self, reader):
        self.reader, self.me = reader, self

def collect(conn):
    faulthandler.dump_traceback_later(20, exit=True)  # a hang shows where, in the log
    gc.collect()  # destroys the parent's reader here unless fastload orphaned its pool
    conn.send("collected")

reader = BatchReader(backend="native" if fastload.native_available() else "python")
reader.read([(sys.argv[1], 0, 10, bytearray(10))])  # the parent's pool threads exist now
gc.disable()  # keep the cycle uncollected until the fork
Cycle(reader)
del reader
parent, child = multiprocessing.Pipe()
proc = multiprocessing.get_context("fork").Process(target=collect, args=(child,))
proc.start()
gc.enable()
collected = parent.poll(30) and parent.recv() == "collected"
proc.join(30)
if proc.is_alive():
    proc.kill()
print("collected" if collected and proc.exitcode == 0 else f"hung (exit {proc.exitcode})")
"""


def test_a_forked_child_collecting_a_parents_reader_does_not_hang(data_file) -> None:
    """torch's DataLoader workers fork, then collect garbage: a reader the parent had not
    collected yet must not be destroyed there (joining threads the child does not have)."""
    path, _ = data_file
    run = subprocess.run(
        [sys.executable, "-c", _FORKED_COLLECTION, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.strip() == "collected", run.stdout + run.stderr


def test_close_is_idempotent_and_reading_after_close_fails(data_file) -> None:
    path, _ = data_file
    r = BatchReader(backend="python")
    r.read([(path, 0, 10, bytearray(10))])
    r.close()
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.read([(path, 0, 10, bytearray(10))])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_threads": -1}, "num_threads"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"backend": "gpu"}, "backend"),
    ],
)
def test_bad_reader_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        BatchReader(**kwargs)
