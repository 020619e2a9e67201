"""Metadata files fastload writes for itself carry a checksum: a damaged one is rebuilt,
logged once naming the file, and never used (a dataset's derived layout beside its
manifest, the cache's tar index of a shard)."""

from __future__ import annotations

import io
import json
import logging
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

import fastload as fl
from fastload import safe_files

CLASSES = 3
PER_CLASS = 4


def _imagefolder(root: Path) -> None:
    for c in range(CLASSES):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            (root / f"class{c}" / f"{i}.jpg").write_bytes(f"{c}:{i}".encode())


def _labels(root: Path, cache: Path) -> list[int]:
    ds = fl.open_dataset(str(root), format="imagefolder", cache_dir=str(cache))
    return [int(ds.targets[i]) for i in range(len(ds))]


def test_a_damaged_layout_file_is_rebuilt_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: a flipped byte in the ``.npz`` beside the manifest changed the labels silently."""
    root, cache = tmp_path / "ds", tmp_path / "cache"
    _imagefolder(root)
    right = _labels(root, cache)
    assert right == [c for c in range(CLASSES) for _ in range(PER_CLASS)]
    (layout,) = (cache / "manifests").glob("*.npz")
    data = bytearray(layout.read_bytes())
    # the classes' offsets are stored raw in the (uncompressed) archive: move one sample
    # from class 1 to class 0 (a layout its other checks accept)
    offsets = np.arange(0, (CLASSES + 1) * PER_CLASS, PER_CLASS, dtype=np.int64).tobytes()
    at = bytes(data).index(offsets)
    data[at + 8] += 1
    layout.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert _labels(root, cache) == right
    named = [r for r in caplog.records if str(layout) in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert "checksum" in named[0].getMessage()
    assert safe_files.unsealed(layout.read_bytes()) is not None  # made again, sealed

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        assert _labels(root, cache) == right
    assert str(layout) not in caplog.text  # the rebuilt file is read as it is


def _tar_shards(root: Path, shards: int = 2, samples: int = 5) -> None:
    root.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(root / f"shard-{s}.tar", "w") as tar:
            for j in range(samples):
                for ext, data in (("jpg", f"img {s} {j}".encode()), ("cls", str(j).encode())):
                    info = tarfile.TarInfo(f"s{s}-{j}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def test_a_damaged_cached_tar_index_is_rebuilt_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: a cached index whose sample count was changed (to one its checks accept: fewer
    samples than members) dropped a sample of the shard without a word."""
    root, cache = tmp_path / "ds", tmp_path / "cache"
    _tar_shards(root)
    ds = fl.open_dataset(str(root), format="tar", cache_dir=str(cache))
    assert len(ds) == 10
    indexes = sorted((cache / "indexes").glob("*.flidx"))
    assert len(indexes) == 2
    damaged = indexes[0]
    data = damaged.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 8)
    header = data[16 : 16 + n]
    assert b'"samples": 5' in header
    fewer = header.replace(b'"samples": 5', b'"samples": 4')
    damaged.write_bytes(data[:16] + fewer + data[16 + n :])

    with caplog.at_level(logging.WARNING, logger="fastload"):
        ds = fl.open_dataset(str(root), format="tar", cache_dir=str(cache))
        assert len(ds) == 10
    named = [r for r in caplog.records if str(damaged) in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert "checksum" in named[0].getMessage()
    assert json.loads(safe_files.unsealed(damaged.read_bytes())[16 : 16 + n])  # type: ignore[index]


def test_an_index_of_the_older_format_without_a_checksum_is_still_read(tmp_path: Path) -> None:
    """A dataset's fastload.flidx written before checksums (format 2) opens as before."""
    from fastload.datasets.tar.index import IndexFile

    members = [("a.jpg", 512, 3), ("a.cls", 1536, 1)]
    sealed = IndexFile.encode([("s.tar", 4096, None, members)])
    data = safe_files.unsealed(sealed)
    assert data is not None
    (n,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + n])
    header["format"] = "fastload-tar-index/2"
    raw = json.dumps(header).encode()
    old = data[:8] + struct.pack("<Q", len(raw)) + raw + data[16 + n :]
    assert IndexFile(old, "old").members("s.tar", "u") == members
    with pytest.raises(ValueError, match="checksum"):
        IndexFile(sealed[:-1] + bytes([sealed[-1] ^ 1]), "damaged")
