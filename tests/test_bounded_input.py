"""Input fastload did not write is bounded: every number read from a file is checked against
the object it describes before it is used, and work is bounded by the bytes that exist
(issues #29, #30). One direct regression test per defect; the fuzz suite is test_fuzz.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fastload.datasets import DatasetError, open_dataset
from fastload.testing import S3Server

# Names every layout must take as they are: non-ASCII, a combining accent (NFD), "+", "%"
# and a space (each of them once broke a byte offset, a URL or a key).
ODD_NAMES = ["clåss", "e\u0301té", "a+b", "50%off", "with space"]


def run_python(code: str, *, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """code in a fresh interpreter (a hang is a timeout, not a stuck test run)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def open_in_child(url: str, cache: Path, options: dict[str, Any], **kw: Any) -> Any:
    """(len, classes, samples) of the dataset at url opened in a child process."""
    code = f"""
        import json, fastload as fl
        ds = fl.open_dataset({url!r}, cache_dir={str(cache)!r},
                             storage_options=json.loads({json.dumps(options)!r}), **{kw!r})
        print(json.dumps([len(ds), ds.classes, [[ds[i][0].decode(), ds[i][1]]
                                                  for i in range(len(ds))]]))
    """
    done = run_python(code, timeout_s=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- ImageFolder class folders whose names are not ASCII -------------------------------------


def _odd_folder(root: Path) -> dict[str, bytes]:
    files = {}
    for n, name in enumerate(ODD_NAMES):
        for j in range(2):
            key = f"{name}/{name} {j}.jpg"
            files[key] = f"{n}:{j}".encode()
            (root / key).parent.mkdir(parents=True, exist_ok=True)
            (root / key).write_bytes(files[key])
    return files


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_imagefolder_with_non_ascii_class_folders_opens(kind: str, tmp_path: Path) -> None:
    """Was: the class folder was cut at a byte offset as if it were a character offset, and
    the search for the class's end never advanced: the open hung forever."""
    _odd_folder(tmp_path / "ds")
    expected_classes = sorted(ODD_NAMES)
    expected = [
        [f"{ODD_NAMES.index(c)}:{j}", k] for k, c in enumerate(expected_classes) for j in (0, 1)
    ]
    if kind == "local":
        got = open_in_child(str(tmp_path / "ds"), tmp_path / "c", {}, format="imagefolder")
    else:
        with S3Server() as server:
            server.upload_dir(tmp_path / "ds", "data", prefix="ds")
            got = open_in_child(
                "s3://data/ds", tmp_path / "c", server.storage_options, format="imagefolder"
            )
    assert got == [len(expected), expected_classes, expected]


# --- tar: field names as webdataset has them --------------------------------------------------


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_tar_fields_are_lower_cased_as_webdataset_does(tmp_path: Path) -> None:
    """Was: ``IMG_1.JPG`` gave field ``JPG``; webdataset lowercases it to ``jpg``, and the
    loader then said the sample had no image. webdataset's own reader is the oracle."""
    import webdataset as wds

    members = {}
    for name in [*ODD_NAMES, "IMG_1", "x" * 120]:
        members[f"{name}.JPG"] = f"image of {name}".encode()
        members[f"{name}.Cls"] = b"7"
        members[f"{name}.Seg.PNG"] = b"seg"
    _write_tar(tmp_path / "ds" / "shard-0.tar", members)
    ds = open_dataset(str(tmp_path / "ds"), format="tar", cache_dir=str(tmp_path / "c"))
    ours = [{k: v for k, v in ds[i].items() if k != "__shard__"} for i in range(len(ds))]
    with (tmp_path / "ds" / "shard-0.tar").open("rb") as f:  # webdataset's grouping
        stream = wds.tariterators.tar_file_expander([{"stream": f, "url": "shard-0.tar"}])
        theirs = [
            {k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
            for s in wds.tariterators.group_by_keys(stream)
        ]
    assert ours == theirs
    assert ds.image_and_label(ds[0], 0)[1] == 7


# --- fastload.flidx and wids' shardindex.json: counts checked against the shards -------------


def _two_shards(root: Path) -> None:
    for s in range(2):
        members = {}
        for j in range(5):
            members[f"s{s}-{j}.jpg"] = f"img {s} {j}".encode()
            members[f"s{s}-{j}.cls"] = str(j).encode()
        _write_tar(root / f"shard-{s}.tar", members)


def _indexed(root: Path, tmp_path: Path) -> dict[str, Any]:
    """The dataset at root with a fastload.flidx beside it; its header, as JSON."""
    import struct

    from fastload.datasets.tar import write_index

    write_index(str(root), cache_dir=str(tmp_path / "c0"))
    data = (root / "fastload.flidx").read_bytes()
    (n,) = struct.unpack_from("<Q", data, 8)
    header: dict[str, Any] = json.loads(data[16 : 16 + n])
    return header


def _rewrite_index(root: Path, header: dict[str, Any], sections: bytes | None = None) -> None:
    """Rewrites the index with header (and sections), sealed again: a hostile index carries
    a checksum that holds, so its numbers must still be checked."""
    import struct

    from fastload import safe_files

    data = safe_files.unsealed((root / "fastload.flidx").read_bytes())
    assert data is not None
    (n,) = struct.unpack_from("<Q", data, 8)
    body = data[16 + n :] if sections is None else sections
    raw = json.dumps(header).encode()
    out = data[:8] + struct.pack("<Q", len(raw)) + raw + body
    (root / "fastload.flidx").write_bytes(safe_files.sealed(out))


@pytest.mark.parametrize("samples", [-5, 0, 10**12, 5.0, "5", True])
def test_a_flidx_count_that_does_not_fit_its_shard_is_refused(samples: Any, tmp_path: Path) -> None:
    """Was: -5 samples gave 5 samples taken from the next shard; 0 dropped the shard
    silently; 1e12 was trusted until a sample was read."""
    root = tmp_path / "ds"
    _two_shards(root)
    header = _indexed(root, tmp_path)
    header["shards"][0]["samples"] = samples
    _rewrite_index(root, header)

    def read_all() -> None:
        ds = open_dataset(str(root), format="tar", cache_dir=str(tmp_path / "c"))
        [ds[i] for i in range(len(ds))]

    with pytest.raises(DatasetError, match=r"fastload\.flidx.*fastload index"):
        read_all()


def test_a_flidx_section_that_inflates_past_its_claim_is_refused(tmp_path: Path) -> None:
    """Was: a section was inflated whole before any check: ~1 MB that inflates to 1 GiB
    was a MemoryError (here, under a 768 MiB address-space limit) at best."""
    import zlib

    root = tmp_path / "ds"
    _two_shards(root)
    header = _indexed(root, tmp_path)
    deflate, zeros = zlib.compressobj(9), b"\0" * (1 << 20)
    bomb = b"".join(deflate.compress(zeros) for _ in range(1024)) + deflate.flush()
    for e in header["shards"]:
        e["at"], e["length"] = 0, len(bomb)
    _rewrite_index(root, header, bomb)
    done = run_python(
        f"""
        import resource
        import fastload as fl
        ds = fl.open_dataset({str(root)!r}, format="tar", cache_dir={str(tmp_path / "c")!r})
        resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
        try:
            ds[0]
        except fl.datasets.DatasetError as e:
            print("DatasetError:", e)
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fastload.flidx is damaged" in done.stdout
    assert "fastload index" in done.stdout


def _wids(root: Path, counts: list[Any], *, sizes: bool = True) -> None:
    shards = []
    for s, n in enumerate(counts):
        entry: dict[str, Any] = {"url": f"shard-{s}.tar", "nsamples": n}
        if sizes:
            entry["filesize"] = (root / f"shard-{s}.tar").stat().st_size
        shards.append(entry)
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shards}
    (root / "shardindex.json").write_text(json.dumps(index))


def test_a_wids_count_of_zero_does_not_drop_the_shard(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _two_shards(root)
    _wids(root, [0, 5])
    ds = open_dataset(str(root), format="tar", cache_dir=str(tmp_path / "c"))
    assert len(ds) == 10
    assert [ds[i]["__key__"] for i in range(10)] == [f"s{s}-{j}" for s in (0, 1) for j in range(5)]


def test_a_wrong_wids_count_is_called_wrong_not_out_of_date(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _two_shards(root)
    _wids(root, [4, 5])
    ds = open_dataset(str(root), format="tar", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DatasetError, match=r"says 4; that index is wrong for a shard of this size"):
        ds[0]


# --- Parquet footers: row counts checked against the row groups ------------------------------


def _parquet(path: Path, rows_per_group: int = 77, groups: int = 2) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = rows_per_group * groups
    table = pa.table({"image": [f"img{i}".encode() for i in range(n)], "label": list(range(n))})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=rows_per_group)


def _set_row_group_rows(path: Path, rows: int, new: int) -> None:
    """Rewrites the footer's RowGroup.num_rows (thrift compact: field 3, i64, right after
    field 2's varint) from rows to new, fixing the footer's length."""
    import re
    import struct

    def varint(v: int) -> bytes:
        z, out = (v << 1) ^ (v >> 63), b""
        while True:
            if z < 0x80:
                return out + bytes([z])
            out, z = out + bytes([z & 0x7F | 0x80]), z >> 7

    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, len(data) - 8)
    footer = data[len(data) - 8 - length : -8]
    pattern = re.compile(rb"(\x16[\x80-\xff]*[\x00-\x7f])\x16" + re.escape(varint(rows)))
    assert len(pattern.findall(footer)) == 2  # one per row group
    footer = pattern.sub(lambda m: m.group(1) + b"\x16" + varint(new), footer, count=1)
    path.write_bytes(
        data[: len(data) - 8 - length] + footer + struct.pack("<I", len(footer)) + b"PAR1"
    )


@pytest.mark.parametrize("rows", [-3, 0, 76, 78, 10**12])
def test_parquet_row_group_counts_that_do_not_add_up_are_refused(rows: int, tmp_path: Path) -> None:
    """Was: a row group's num_rows of -3 opened with 2 rows taken from the wrong group."""
    _parquet(tmp_path / "ds" / "a.parquet")
    _set_row_group_rows(tmp_path / "ds" / "a.parquet", 77, rows)
    with pytest.raises(DatasetError, match=r"a\.parquet: its footer says 154 rows.*rewrite it"):
        open_dataset(str(tmp_path / "ds"), format="parquet", cache_dir=str(tmp_path / "c"))


def test_parquet_footer_counts_that_add_up_but_lie_never_give_a_wrong_row(
    tmp_path: Path,
) -> None:
    """Footer counts that add up but lie (76 rows where group 0 holds 77): pyarrow reads
    the rows the footer says, each sample is its own row (one row is left out, never
    another row given in its place)."""
    import struct

    path = tmp_path / "ds" / "a.parquet"
    _parquet(path)
    _set_row_group_rows(path, 77, 76)
    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, len(data) - 8)
    footer = data[len(data) - 8 - length : -8]
    assert footer.count(b"\x16\xb4\x02") == 1  # FileMetaData.num_rows: 154
    footer = footer.replace(b"\x16\xb4\x02", b"\x16\xb2\x02")  # 153
    tail = struct.pack("<I", len(footer)) + b"PAR1"
    path.write_bytes(data[: len(data) - 8 - length] + footer + tail)
    ds = open_dataset(str(tmp_path / "ds"), format="parquet", cache_dir=str(tmp_path / "c"))
    assert len(ds) == 153
    assert [ds[i]["label"] for i in range(153)] == [*range(76), *range(77, 154)]


# --- Parquet: one class index for dictionary-encoded labels ---------------------------------


def test_dictionary_labels_mean_the_same_class_in_every_file_and_row_group(tmp_path: Path) -> None:
    """Was: a label was its position in its own chunk's dictionary: 0 was "dog" in one
    file (or row group) and "cat" in another."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "ds"
    root.mkdir()
    parts = {"a.parquet": ["dog", "dog", "fox", None], "b.parquet": ["cat", "fox", "cat", "émeu"]}
    for key, names in parts.items():
        labels = pa.array(names).dictionary_encode()  # each file's dictionary: its own order
        images = pa.array([f"{key}{i}".encode() for i in range(len(names))])
        pq.write_table(pa.table({"image": images, "label": labels}), root / key, row_group_size=2)
    ds = open_dataset(str(root), format="parquet", cache_dir=str(tmp_path / "c"))
    assert ds.classes == ["cat", "dog", "fox", "émeu"]
    got = [ds[i]["label"] for i in range(len(ds))]
    names = [*parts["a.parquet"], *parts["b.parquet"]]
    assert got == [None if n is None else ds.classes.index(n) for n in names]
    again = open_dataset(str(root), format="parquet", cache_dir=str(tmp_path / "c"))
    assert again.classes == ds.classes  # kept beside the listing


# --- Zarr: shapes bounded by the objects that exist; chunks inflated with a bound -------------


def _zarr_v2(root: Path, shape: Any, chunks: Any, chunk_files: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "zarr_format": 2,
        "shape": shape,
        "chunks": chunks,
        "dtype": "|u1",
        "compressor": {"id": "gzip", "level": 1},
        "fill_value": 0,
        "filters": None,
        "order": "C",
    }
    (root / ".zarray").write_text(json.dumps(meta))
    for key, data in chunk_files.items():
        (root / key).write_bytes(data)


@pytest.mark.parametrize("shape", [[10**9], [1e9], [2**63]])
def test_a_zarr_shape_far_beyond_its_chunks_is_refused_at_once(shape: Any, tmp_path: Path) -> None:
    """Was: shape[0] = 1e9 with chunks of 1 row looped per chunk-row in Python for 80-120 s
    (a float 1e9 was taken as a count)."""
    import gzip

    _zarr_v2(tmp_path / "ds", shape, [1], {"0": gzip.compress(b"\1")})
    code = f"""
        import fastload as fl
        try:
            fl.open_dataset(
                {str(tmp_path / "ds")!r}, format="zarr", cache_dir={str(tmp_path / "c")!r}
            )
        except fl.datasets.DatasetError as e:
            print("DatasetError:", e)
    """
    done = run_python(code, timeout_s=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DatasetError:" in done.stdout
    assert "ds/.zarray" in done.stdout


def test_a_zarr_chunk_that_inflates_past_its_shape_is_refused(tmp_path: Path) -> None:
    """Was: a gzip chunk was inflated whole (1 GiB from ~1 MB) before its size was
    checked: a MemoryError at best (here, under a 768 MiB address-space limit)."""
    import zlib

    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + 15)
    zeros = b"\0" * (1 << 20)
    bomb = b"".join(deflate.compress(zeros) for _ in range(1024)) + deflate.flush()
    _zarr_v2(tmp_path / "ds", [32], [16], {"0": bomb})
    code = f"""
        import resource
        import fastload as fl
        ds = fl.open_dataset(
            {str(tmp_path / "ds")!r}, format="zarr", cache_dir={str(tmp_path / "c")!r}
        )
        resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
        try:
            ds[0]
        except fl.datasets.DatasetError as e:
            print("DatasetError:", e)
        print(ds[16].tolist())  # chunk 1 was never written: the fill value
    """
    done = run_python(code, timeout_s=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ds/0: decoding with gzip failed (it inflates past the chunk" in done.stdout
    assert done.stdout.strip().endswith("0")


# --- CachedZarrStore: zarr-python's store conformance tests, read-only subset ----------------


class TestCachedZarrStoreReadOnly:
    """zarr-python 3's ``StoreTests`` (zarr/testing/store.py) that a read-only store must
    pass, run on :class:`CachedZarrStore` over a local folder. ``set`` writes the object
    beside the others and lists the folder again, bypassing the store as StoreTests asks.
    (Run synchronously: StoreTests' coroutines under asyncio.run, no pytest-asyncio.)"""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        from fastload.datasets.zarr.store import CachedZarrStore
        from fastload.store import CachedStore, StoreConfig

        root = tmp_path / "ds"
        root.mkdir()
        (root / "placeholder").write_bytes(b"")
        config = StoreConfig(url=str(root), cache_dir=str(tmp_path / "c"), refresh=True)
        return CachedZarrStore(CachedStore(config))

    @property
    def buffer_cls(self) -> Any:
        from zarr.core.buffer import cpu

        return cpu.Buffer

    async def set(self, store: Any, key: str, value: Any) -> None:
        from fastload.store import CachedStore

        path = Path(store.store.url) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value.to_bytes())
        store.store.close()
        store.__init__(CachedStore(store.store.config))

    async def get(self, store: Any, key: str) -> Any:
        return self.buffer_cls.from_bytes((Path(store.store.url) / key).read_bytes())

    @staticmethod
    def _run(name: str, *args: Any) -> None:
        import asyncio

        from zarr.testing.store import StoreTests

        asyncio.run(getattr(StoreTests, name)(*args))

    @pytest.mark.parametrize("key", ["c/0", "foo/c/0.0", "foo/0/0", "clåss/c +%/0"])
    @pytest.mark.parametrize("case", range(5))
    def test_get(self, store: Any, key: str, case: int) -> None:
        from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

        data, byte_range = [
            (b"\x01\x02\x03\x04", None),
            (b"\x01\x02\x03\x04", RangeByteRequest(1, 4)),
            (b"\x01\x02\x03\x04", OffsetByteRequest(1)),
            (b"\x01\x02\x03\x04", SuffixByteRequest(1)),
            (b"", None),
        ][case]
        self._run("test_get", self, store, key, data, byte_range)

    def test_get_raises(self, store: Any) -> None:
        """Was: an UnboundLocalError."""
        self._run("test_get_raises", self, store)

    def test_get_many(self, store: Any) -> None:
        self._run("test_get_many", self, store)

    @pytest.mark.parametrize("key", ["c/0", "foo/c/0.0"])
    @pytest.mark.parametrize("data", [b"\x01\x02\x03\x04", b""])
    def test_getsize(self, store: Any, key: str, data: bytes) -> None:
        self._run("test_getsize", self, store, key, data)

    def test_getsize_raises(self, store: Any) -> None:
        self._run("test_getsize_raises", self, store)

    def test_get_partial_values(self, store: Any) -> None:
        from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

        ranges = [
            ("c/0/0", RangeByteRequest(0, 2)),
            ("c/0/1", SuffixByteRequest(2)),
            ("c/0/2", OffsetByteRequest(2)),
        ]
        self._run("test_get_partial_values", self, store, ranges)

    def test_get_bytes_and_json(self, store: Any) -> None:
        self._run("test_get_bytes", self, store)
        self._run("test_get_json", self, store)

    def test_store_supports_writes(self, store: Any) -> None:
        assert not store.supports_writes
        assert not store.supports_deletes
        assert store.read_only

    def test_a_range_past_the_end_or_backwards(self, store: Any) -> None:
        import asyncio

        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype

        asyncio.run(self.set(store, "c/0", self.buffer_cls.from_bytes(b"\x01\x02\x03\x04")))
        get = store.get
        past = asyncio.run(get("c/0", default_buffer_prototype(), RangeByteRequest(2, 10)))
        assert past.to_bytes() == b"\x03\x04"
        with pytest.raises(ValueError, match="Unexpected byte_range"):
            asyncio.run(get("c/0", default_buffer_prototype(), RangeByteRequest(3, 1)))


# --- the .flm manifest: checked before it is used; truncation in place cannot kill a reader ---


def _manifest(path: Path, n: int = 2000) -> None:
    from fastload.manifest import Manifest, RemoteObject

    objects = [RemoteObject(f"clåss {i % 7}/{i:05d}.jpg", i, f"v{i}") for i in range(n)]
    Manifest("s3://b/ds", objects).save(path)


def test_a_manifest_truncated_in_place_while_in_use_does_not_kill_its_reader(
    tmp_path: Path,
) -> None:
    """Was: the manifest was always mapped; truncated in place while mapped, the next key
    read killed the process with SIGBUS. A file that is not sealed (read-only to all, as
    fastload publishes a manifest) is read into a private copy instead."""
    path = tmp_path / "m.flm"
    _manifest(path)
    code = f"""
        import os
        from pathlib import Path
        from fastload.manifest import Manifest
        m = Manifest.load(Path({str(path)!r}))
        os.truncate({str(path)!r}, 4096)
        print(sum(len(m.key(i)) for i in range(len(m))), m.size(len(m) - 1))
    """
    done = run_python(code, timeout_s=60)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    total = sum(len(f"clåss {i % 7}/{i:05d}.jpg") for i in range(2000))
    assert done.stdout.split() == [str(total), "1994"]  # the last key: clåss 6/01994.jpg


def test_load_manifest_publishes_a_sealed_file(tmp_path: Path) -> None:
    """What load_manifest writes is read-only to all (so it is mapped and shared)."""
    from fastload.manifest import load_manifest, manifest_path

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a").write_bytes(b"x")
    load_manifest(str(tmp_path / "ds"), tmp_path / "c")
    assert manifest_path(tmp_path / "c", str(tmp_path / "ds")).stat().st_mode & 0o777 == 0o444


@pytest.mark.parametrize(
    "damage",
    ["count", "key_bytes", "header_len", "offsets", "hash_order", "sizes"],
)
def test_a_damaged_manifest_is_refused_before_use(damage: str, tmp_path: Path) -> None:
    import struct

    from fastload.manifest import Manifest

    path = tmp_path / "m.flm"
    _manifest(path, 50)
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + hlen])
    body = 16 + hlen + (-(16 + hlen) % 8)
    if damage in ("count", "key_bytes"):  # the same length: only the number changes
        digits = str(header[damage])
        now = f"-{digits[1:]}" if damage == "count" else "9" * len(digits)
        head = bytes(data[16 : 16 + hlen])
        data[16 : 16 + hlen] = head.replace(
            f'"{damage}": {digits}'.encode(), f'"{damage}": {now}'.encode()
        )
    elif damage == "header_len":
        data[8:16] = struct.pack("<Q", 2**63)
    elif damage == "offsets":
        struct.pack_into("<q", data, body + 8 * 3, -7)  # key offset 3
    elif damage == "hash_order":
        struct.pack_into("<q", data, body + 8 * (51 + 50 + 51 + 50), 10**9)
    else:
        struct.pack_into("<q", data, body + 8 * 51, -5)  # size of object 0
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"m\.flm"):
        Manifest.load(path)


# --- a null label -----------------------------------------------------------------------------


def test_a_null_label_raises_naming_its_sample_or_is_skipped(tmp_path: Path) -> None:
    """Was: torch's "Could not infer dtype of NoneType", naming only "decode stage, batch
    0", with on_error="skip" too."""
    import io as _io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    import fastload as fl
    from fastload.errors import DecodeError

    def jpeg(i: int) -> bytes:
        out = _io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), i * 20, np.uint8)).save(out, "JPEG")
        return out.getvalue()

    root = tmp_path / "ds"
    root.mkdir()
    labels = pa.array([0, 1, None, 3, 4, 5], pa.int64())
    images = pa.array([jpeg(i) for i in range(6)])
    pq.write_table(pa.table({"image": images, "label": labels}), root / "a.parquet")
    ds = open_dataset(str(root), format="parquet", cache_dir=str(tmp_path / "c"))
    settings: dict[str, Any] = {"batch_size": 3, "decode": "cpu"}
    with pytest.raises(
        DecodeError,
        match=r"sample 2 \(row 2 of row group 0 of .*a\.parquet\) has no label.*on_error='skip'",
    ):
        list(fl.DataLoader(ds, **settings))
    loader = fl.DataLoader(ds, on_error="skip", **settings)
    got = [labels.tolist() for _, labels in loader]
    assert got == [[0, 1, 0], [3, 4, 5]]  # sample 2's place goes to another of its batch
    assert loader.stats()["skipped_samples"] == 1
