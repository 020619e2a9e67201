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

from fastload.datasets import open_dataset
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
