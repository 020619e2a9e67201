"""A format defined only here, added with ``register_format``, works with the loader, warm
and decode: the loader names no format, each format says what its samples are.

The toy container (``.toy``): ``TOYPACK1``, the image count (uint32, little-endian), then per
image its data offset (uint64), length (uint32) and label (int32), then the JPEGs.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_loader import jpeg

import fastload as fl
from fastload import cli
from fastload.datasets import DatasetError, ShardedDataset, formats, register_format
from fastload.datasets.base import Range, keys_ending
from fastload.decode import make_decoder
from fastload.store import CachedStore
from fastload.testing import S3Server

MAGIC = b"TOYPACK1"
HEAD = struct.Struct("<8sI")
ENTRY = struct.Struct("<QIi")
PER_FILE = (5, 3, 4)  # images in each container: one shard each


def pack(images: Sequence[bytes], labels: Sequence[int]) -> bytes:
    at = HEAD.size + ENTRY.size * len(images)
    table = []
    for image, label in zip(images, labels, strict=True):
        table.append(ENTRY.pack(at, len(image), label))
        at += len(image)
    return b"".join([HEAD.pack(MAGIC, len(images)), *table, *images])


class ToyDataset(ShardedDataset):
    """Sample ``i`` is ``(jpeg bytes, label)``; a ``.toy`` container is a shard. Opening
    reads only each container's table (as byte ranges), not its images."""

    format = "toy"

    def __init__(self, store: CachedStore) -> None:
        self.entries: list[list[tuple[int, int, int]]] = []
        keys = keys_ending(store, ".toy")
        for key in keys:
            size = store.object(key).size or 0
            magic, count = HEAD.unpack(store.read_range(key, 0, HEAD.size))
            if magic != MAGIC or HEAD.size + count * ENTRY.size > size:
                raise DatasetError(f"{store.object_url(key)} is not a toy container")
            table = store.read_range(key, HEAD.size, count * ENTRY.size)
            entries = list(ENTRY.iter_unpack(table))
            if any(offset + length > size for offset, length, _ in entries):
                raise DatasetError(f"{store.object_url(key)}: an image lies past its end")
            self.entries.append(entries)
        super().__init__(store, [len(e) for e in self.entries], [[k] for k in keys])

    def _entry(self, index: int) -> tuple[str, int, int, int]:
        s = self.shard_of(index)
        offset, length, label = self.entries[s][index - int(self.shard_offsets[s])]
        return self.shard_keys[s][0], offset, length, label

    def sample_ranges(self, index: int) -> list[Range] | None:
        key, offset, length, _ = self._entry(index)
        return [(key, offset, length)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        return (bytes(parts[0]) if copy else parts[0]), self._entry(index)[3]

    # The hooks the loader's decoder asks.

    @property
    def decodable(self) -> bool:
        return True

    def image_and_label(self, sample: Any, index: int) -> tuple[Any, Any]:
        return sample[0], sample[1]

    def describe(self, index: int) -> str:
        key, offset, _, _ = self._entry(index)
        return f"the image at byte {offset} of {self.store.object_url(key)}"


register_format("toy", ToyDataset)


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple[str, dict[str, Any], list[bytes], list[int]]]:
    """The containers in a bucket: (URL, storage options, every image, every label)."""
    images = [jpeg(seed, 24 + seed % 3 * 8, 32) for seed in range(sum(PER_FILE))]
    labels = [seed % 4 for seed in range(sum(PER_FILE))]
    with S3Server() as s3:
        s3.create_bucket("toys")
        start = 0
        for n, count in enumerate(PER_FILE):
            body = pack(images[start : start + count], labels[start : start + count])
            s3.put("toys", f"set/part-{n}.toy", body)
            start += count
        yield "s3://toys/set", s3.storage_options, images, labels


def test_a_registered_format_is_one_of_the_formats_and_a_built_in_name_is_refused() -> None:
    assert formats()[: len(fl.datasets.FORMATS)] == fl.datasets.FORMATS
    assert "toy" in formats()
    assert "toy" not in fl.datasets.FORMATS
    with pytest.raises(ValueError, match="built-in"):
        register_format("tar", ToyDataset)


def test_the_loader_decodes_a_registered_format_as_decoding_its_images_directly(
    toy: tuple[str, dict[str, Any], list[bytes], list[int]], tmp_path: Path
) -> None:
    url, options, images, labels = toy
    with fl.open_dataset(
        url, format="toy", cache_dir=str(tmp_path), storage_options=options
    ) as dataset:
        assert isinstance(dataset, ToyDataset)
        assert len(dataset) == len(images)
        loader = fl.DataLoader(dataset, batch_size=4, decode="cpu")
        batches = list(loader)
        loader.close()
    got = [image for batch_images, _ in batches for image in batch_images]
    assert torch.cat([batch_labels for _, batch_labels in batches]).tolist() == labels
    with make_decoder("cpu") as decoder:
        expected = decoder.decode(images, indices=list(range(len(images)))).images
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_a_bad_image_of_a_registered_format_is_named_as_the_format_describes_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    (root / "part-0.toy").write_bytes(pack([jpeg(1, 16, 16), b"not a jpeg at all"], [0, 1]))
    with fl.open_dataset(str(root), format="toy", cache_dir=str(tmp_path / "cache")) as dataset:
        loader = fl.DataLoader(dataset, batch_size=2, decode="cpu")
        with pytest.raises(fl.decode.DecodeError, match=r"the image at byte \d+ of .*part-0"):
            list(loader)
        loader.close()


def test_fastload_warm_stages_the_objects_of_a_registered_format(
    toy: tuple[str, dict[str, Any], list[bytes], list[int]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, options, _, _ = toy
    cache = str(tmp_path / "cache")
    opened = {"format": "toy", "cache_dir": cache, "storage_options": options}
    with fl.open_dataset(url, **opened) as dataset:  # reads the tables only, as ranges
        keys = [k for shard in dataset.shard_keys for k in shard]
        assert dataset.store.local_paths(keys) == [None] * len(keys)
    with pytest.MonkeyPatch.context() as env:  # what the command reads the server's address from
        env.setenv("AWS_ACCESS_KEY_ID", options["key"])
        env.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
        env.setenv("AWS_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        assert cli.main(["warm", url, "--format", "toy", "--cache-dir", cache, "--json"]) == 0
    assert '"objects"' in capsys.readouterr().out
    with fl.open_dataset(url, **opened) as dataset:
        located = dataset.store.local_paths(keys)
    assert all(at is not None for at in located), located
