"""A batch's read: the native read of a whole batch from request columns, and the GIL
hand-offs it costs, counted per batch in ``stats()``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fastload as fl
from fastload.reader import BatchReader, InvalidDestinationError, aligned_empty


def folder(root: Path, count: int = 64) -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    files = {}
    for i in range(count):
        key = f"c{i % 4}/{i:03d}.bin"
        files[key] = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(files[key])
    return files


@pytest.mark.parametrize("batch_size", [4, 16])
def test_hand_offs_are_counted_per_batch_not_per_sample(tmp_path: Path, batch_size: int) -> None:
    files = folder(tmp_path / "ds")
    fl.warm(str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"), progress=False)
    ds = fl.open_dataset(str(tmp_path / "ds"), format="files", cache_dir=str(tmp_path / "cache"))
    with fl.DataLoader(ds, batch_size=batch_size, collate_fn=list) as dl:
        got = [bytes(s) for batch in dl for s in batch]
        stats = dl.stats()
    assert sorted(got) == sorted(files.values())
    # Cached: the index query, the native read and the checksums, whatever the batch's size.
    assert stats["gil_handoffs_per_batch"] == 3


@pytest.mark.parametrize("backend", ["native", "python"])
def test_read_spans_fills_one_destination_from_columns(tmp_path: Path, backend: str) -> None:
    data = {name: bytes(range(i, i + 200)) for i, name in enumerate(["a", "b"])}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    files = [str(tmp_path / "a"), str(tmp_path / "b")]
    dest = aligned_empty(64)
    ids, offsets, lengths = np.array([1, 0, 1]), np.array([10, 0, 199]), np.array([5, 3, 1])
    at = np.array([0, 5, 8])
    with BatchReader(num_threads=2, backend=backend) as reader:
        reader.read_spans(files, dest, ids, offsets, lengths, at, exact=True)
        assert dest[:9].tobytes() == data["b"][10:15] + data["a"][:3] + data["b"][199:]
        with pytest.raises(InvalidDestinationError, match="too small"):
            reader.read_spans(files, dest, ids, offsets, lengths, at + 60)
        with pytest.raises(ValueError, match=">= 0"):
            reader.read_spans(files, dest, ids, offsets - 20, lengths, at)
