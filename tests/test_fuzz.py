"""Fuzzing every parser of files fastload did not write (or wrote, then someone changed):
tar headers, ``fastload.flidx``, wids' ``shardindex.json``, the ``.flm`` manifest, Parquet
footers, Zarr metadata and shard indexes.

Each target starts from a sound file and draws mutations (bytes set, the file cut short,
a JSON value replaced by a hostile one: -1, 2**64, 1e9, a string, ...). Every example is
parsed in a worker subprocess (tests/fuzz_worker.py) under a 2 GiB address-space limit and
a 10 s timeout; the worker parses many examples and is started again when one kills it.
An example passes when the worker lives, answers in time, and either reads the dataset or
raises a DatasetError / DecodeError that names the file (the manifest: the ValueError its
loader turns into a fresh listing). Derandomized, with a bounded number of examples, so
the run is the same every time and takes well under the 3 minutes it may add to CI.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fastload import safe_files
from fastload.staging.child_pipe import readable_within

ADDRESS_SPACE_BYTES = 2 << 30
TIMEOUT_S = 10.0
# One worker process parses every example of the module (its module fixture ends it), so a
# test leaves it running on purpose.
pytestmark = pytest.mark.leaves_processes("one fuzz worker serves every test of the module")
EXAMPLES = 300
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    # No shrinking: a hang costs TIMEOUT_S per try; the raw example is reported as drawn.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HOSTILE = [
    -1,
    0,
    1,
    -5,
    7,
    2**31,
    2**32,
    2**63 - 1,
    2**64,
    10**12,
    1e9,
    0.5,
    True,
    None,
    "5",
    [],
    {},
]


class Worker:
    """tests/fuzz_worker.py in a process of its own, limited to ADDRESS_SPACE_BYTES."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))

        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("fuzz_worker.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=limit,  # setrlimit in the child, before exec
            env=env,
        )

    def parse(self, fmt: str, root: Path, cache: Path) -> dict[str, Any]:
        """The worker's answer, or {"died": ...} when it crashed or did not answer in time."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()  # a dead worker's pipes
            self._proc = self._start()
        proc = self._proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        request = {"format": fmt, "dir": str(root), "cache": str(cache)}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            return {"died": f"exit status {proc.wait()}"}
        line = proc.stdout.readline() if readable_within(proc.stdout, TIMEOUT_S) else b""
        if not line:
            if proc.poll() is None:
                self.close()
                return {"died": f"no answer in {TIMEOUT_S} s (a hang)"}
            return {"died": f"exit status {proc.wait()} (a negative one is a signal)"}
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fastload-fuzz-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Examples:
    """A fresh dataset folder and cache per example, from a sound one."""

    def __init__(self, scratch: Path, base: Path) -> None:
        self.scratch, self.base, self.n = scratch, base, 0

    def next(self) -> tuple[Path, Path]:
        self.n += 1
        root = self.scratch / f"ex{self.n}" / "ds"
        shutil.copytree(self.base, root)
        return root, self.scratch / f"ex{self.n}" / "cache"

    def done(self) -> None:
        shutil.rmtree(self.scratch / f"ex{self.n}", ignore_errors=True)


def judge(
    answer: dict[str, Any],
    names: tuple[str, ...],
    errors: tuple[str, ...],
    sound: dict[str, Any] | None = None,
) -> None:
    """The worker lived and answered; an error is of a kind in errors naming one of names;
    with ``sound``, what it read is what the sound input gives (an index changes no sample)."""
    assert "died" not in answer, answer["died"]
    if sound is not None and "ok" in answer:
        assert answer["ok"] == sound["ok"], "a damaged index changed the samples"
    if "error" in answer:
        kinds = answer["kinds"]
        assert any(e in kinds for e in errors), f"{answer['error']}: {answer['message']}"
        assert any(n in answer["message"] for n in names), answer["message"]


# --- mutations -------------------------------------------------------------------------------


@st.composite
def byte_edits(draw: st.DrawFn, size: int, hot: tuple[int, int] | None = None) -> Any:
    """(edits, cut): bytes set at positions (often in the ``hot`` span) and a length."""
    spot = st.integers(0, max(0, size - 1))
    if hot is not None:
        spot = st.one_of(st.integers(max(0, hot[0]), max(0, min(size, hot[1]) - 1)), spot)
    edits = draw(st.lists(st.tuples(spot, st.integers(0, 255)), max_size=6))
    cut = draw(st.one_of(st.none(), st.none(), st.integers(0, size)))
    return edits, cut


def edited(data: bytes, edits: Any) -> bytes:
    changes, cut = edits
    out = bytearray(data)
    for at, value in changes:
        if at < len(out):
            out[at] = value
    return bytes(out if cut is None else out[:cut])


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


@st.composite
def json_edits(draw: st.DrawFn, doc: Any) -> Any:
    """doc with a few values (anywhere in it) replaced by hostile ones."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        value = draw(st.one_of(st.sampled_from(HOSTILE), st.integers(-(2**70), 2**70)))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = value
    return doc


# --- sound inputs ------------------------------------------------------------------------------


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _shard(s: int) -> bytes:
    members = {}
    for j in range(4):
        key = f"s{s}-{j}" if j != 3 else f"clåss {s}/{'long' * 30}-{j}"
        members[f"{key}.jpg"] = bytes([s, j]) * 50
        members[f"{key}.cls"] = str(j).encode()
    return _tar(members)


def tar_base(root: Path) -> None:
    root.mkdir(parents=True)
    for s in range(2):
        (root / f"shard-{s}.tar").write_bytes(_shard(s))


def flidx_base(root: Path, scratch: Path) -> None:
    from fastload.datasets.tar import write_index

    tar_base(root)
    write_index(str(root), cache_dir=str(scratch / "index-cache"), progress=False)


def wids_base(root: Path) -> None:
    tar_base(root)
    shards = [
        {
            "url": f"shard-{s}.tar",
            "nsamples": 4,
            "filesize": (root / f"shard-{s}.tar").stat().st_size,
        }
        for s in range(2)
    ]
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shards}
    (root / "shardindex.json").write_text(json.dumps(index))


def flm_base(root: Path) -> None:
    from fastload.manifest import Manifest, RemoteObject

    root.mkdir(parents=True)
    objects = [
        RemoteObject(f"clåss {i % 3}/{i:03d}.jpg", i * 7, f"v{i}" if i % 2 else None)
        for i in range(40)
    ]
    Manifest("s3://b/ds", objects).save(root / "m.flm")


def parquet_base(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    labels = pa.array(["dog", "cat", None, "fox"] * 6).dictionary_encode()
    images = pa.array([bytes([i]) * 20 for i in range(24)])
    pq.write_table(
        pa.table({"image": images, "label": labels}), root / "a.parquet", row_group_size=8
    )


def zarr_base(root: Path, fmt: int) -> None:
    import numpy as np
    import zarr

    root.mkdir(parents=True)
    group = zarr.open_group(str(root), mode="w", zarr_format=fmt)
    a = group.create_array(
        "x", shape=(20, 3), chunks=(4, 2), dtype="i4", compressors=None if fmt == 2 else "auto"
    )
    a[:] = np.arange(60, dtype="i4").reshape(20, 3)
    b = group.create_array("y", shape=(20,), chunks=(8,), dtype="f8")
    b[:] = np.arange(20) / 2


def sharded_base(root: Path) -> None:
    import numpy as np
    import zarr

    root.mkdir(parents=True)
    a = zarr.create_array(str(root), shape=(24, 4), chunks=(2, 4), shards=(8, 4), dtype="u2")
    a[:] = np.arange(96, dtype="u2").reshape(24, 4)


# --- the targets ---------------------------------------------------------------------------------


def run_target(
    worker: Worker,
    scratch: Path,
    fmt: str,
    base: Path,
    mutate: Callable[[Path, Any], None],
    edits: st.SearchStrategy[Any],
    names: tuple[str, ...],
    errors: tuple[str, ...] = ("DatasetError", "DecodeError"),
    *,
    same_samples: bool = False,
) -> None:
    examples = Examples(scratch / base.name, base)
    sound = worker.parse(fmt, *examples.next())
    assert "ok" in sound, sound  # the unmutated input reads
    examples.done()

    @SETTINGS
    @given(edits)
    def example(edit: Any) -> None:
        root, cache = examples.next()
        mutate(root, edit)
        judge(worker.parse(fmt, root, cache), names, errors, sound if same_samples else None)
        examples.done()

    example()


def _bytes_of(path: Path) -> int:
    return path.stat().st_size


def test_fuzz_tar_headers(worker: Worker, scratch: Path) -> None:
    base = scratch / "tar-base"
    tar_base(base)
    size = _bytes_of(base / "shard-0.tar")

    def mutate(root: Path, edit: Any) -> None:
        path = root / "shard-0.tar"
        path.write_bytes(edited(path.read_bytes(), edit))

    run_target(worker, scratch, "tar", base, mutate, byte_edits(size, (0, 2048)), ("shard-0.tar",))


def _flidx_parts(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16 : 16 + n]), data[16 + n :]


def test_fuzz_fastload_flidx(worker: Worker, scratch: Path) -> None:
    base = scratch / "flidx-base"
    flidx_base(base, scratch)
    # Edits are made to the payload and sealed again: a hostile index carries a checksum that
    # holds, so every number in it must still be checked.
    data = safe_files.unsealed((base / "fastload.flidx").read_bytes())
    assert data is not None
    header, sections = _flidx_parts(data)
    edits = st.one_of(
        st.tuples(st.just("json"), json_edits(header)),
        st.tuples(st.just("bytes"), byte_edits(len(data), (len(data) - len(sections), len(data)))),
    )

    def mutate(root: Path, edit: Any) -> None:
        kind, value = edit
        if kind == "json":
            raw = json.dumps(value).encode()
            out = data[:8] + struct.pack("<Q", len(raw)) + raw + sections
        else:
            out = edited(data, value)
        (root / "fastload.flidx").write_bytes(safe_files.sealed(out))

    names = ("fastload.flidx", "shard-")
    run_target(worker, scratch, "tar", base, mutate, edits, names, same_samples=True)


def test_fuzz_wids_index(worker: Worker, scratch: Path) -> None:
    base = scratch / "wids-base"
    wids_base(base)
    doc = json.loads((base / "shardindex.json").read_text())

    def mutate(root: Path, edit: Any) -> None:
        (root / "shardindex.json").write_text(json.dumps(edit))

    names = ("shardindex.json", "shard-")
    run_target(worker, scratch, "tar", base, mutate, json_edits(doc), names, same_samples=True)


def test_fuzz_flm_manifest(worker: Worker, scratch: Path) -> None:
    base = scratch / "flm-base"
    flm_base(base)
    data = (base / "m.flm").read_bytes()
    (n,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + n])
    body = data[16 + n + (-(16 + n) % 8) :]
    edits = st.one_of(
        st.tuples(st.just("json"), json_edits(header)),
        st.tuples(st.just("bytes"), byte_edits(len(data))),
    )

    def mutate(root: Path, edit: Any) -> None:
        kind, value = edit
        if kind == "json":
            raw = json.dumps(value).encode()
            head = data[:8] + struct.pack("<Q", len(raw)) + raw
            out = head + b"\0" * (-len(head) % 8) + body
        else:
            out = edited(data, value)
        (root / "m.flm").write_bytes(out)

    run_target(worker, scratch, "flm", base, mutate, edits, ("m.flm",), ("ValueError",))


def test_fuzz_parquet_footer(worker: Worker, scratch: Path) -> None:
    base = scratch / "parquet-base"
    parquet_base(base)
    data = (base / "a.parquet").read_bytes()
    (footer,) = struct.unpack_from("<I", data, len(data) - 8)

    def mutate(root: Path, edit: Any) -> None:
        (root / "a.parquet").write_bytes(edited(data, edit))

    hot = (len(data) - 8 - footer, len(data))
    run_target(worker, scratch, "parquet", base, mutate, byte_edits(len(data), hot), ("a.parquet",))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_fuzz_zarr_metadata(worker: Worker, scratch: Path, zarr_format: int) -> None:
    base = scratch / f"zarr{zarr_format}-base"
    zarr_base(base, zarr_format)
    name = ".zarray" if zarr_format == 2 else "zarr.json"
    doc = json.loads((base / "x" / name).read_text())

    def mutate(root: Path, edit: Any) -> None:
        (root / "x" / name).write_text(json.dumps(edit))

    run_target(worker, scratch, "zarr", base, mutate, json_edits(doc), (f"x/{name}", "x/", "ds"))


def test_fuzz_zarr_shard_index(worker: Worker, scratch: Path) -> None:
    base = scratch / "sharded-base"
    sharded_base(base)
    shard = base / "c" / "1" / "0"
    data = shard.read_bytes()
    index_bytes = 4 * 16 + 4  # 4 inner chunks, their (offset, nbytes), a crc32c

    def mutate(root: Path, edit: Any) -> None:
        (root / "c" / "1" / "0").write_bytes(edited(data, edit))

    hot = (len(data) - index_bytes, len(data))
    run_target(worker, scratch, "zarr", base, mutate, byte_edits(len(data), hot), ("c/1/0",))
