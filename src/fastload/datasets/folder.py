"""File folders: one sample per file; with ImageFolder layout, (bytes, class index) pairs.

Samples are manifest indices kept as runs (:class:`IndexRuns`), never a Python string per
file: a dataset of 1.28 M images opens from its cached manifest in a few array passes and
pickles to a few KB.
"""

from __future__ import annotations

import functools
import hashlib
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from fastload.datasets.base import DatasetError, Range, SampleSpans, ShardedDataset
from fastload.datasets.columns import IndexRuns, Int64s, ends_with, key_tails, slashes
from fastload.manifest import Manifest
from fastload.remote.listing import ENCODING as _ENCODING
from fastload.store import CachedStore

# torchvision's IMG_EXTENSIONS: the files ImageFolder takes as samples.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def suffix_of(key: str) -> str:
    return posixpath.splitext(key)[1].lower()


class SampleKeys(Sequence[str]):
    """The key of each sample, made when asked for."""

    def __init__(self, manifest: Manifest, objects: IndexRuns) -> None:
        self._manifest = manifest
        self._objects = objects

    def __len__(self) -> int:
        return len(self._objects)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} is out of range ({n} samples)")
        return self._manifest.key(self._objects[i % n])

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


class _OneKeyShards(Sequence[list[str]]):
    """Shard i of a file dataset reads one object: sample i's."""

    def __init__(self, keys: SampleKeys) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i: int) -> list[str]:  # type: ignore[override]
        return [self._keys[i]]


class FileDataset(ShardedDataset):
    """Every object under the root is a sample: ``dataset[i]`` is its bytes.

    ``dataset.keys[i]`` names it and ``dataset.suffix(i)`` says what the bytes are.
    ``objects`` (the listing's indices of the samples, in sample order) picks and orders
    them; by default every object, in key order.
    """

    format = "files"
    stages_many_objects = True  # a sample is an object

    def __init__(self, store: CachedStore, objects: IndexRuns | None = None) -> None:
        self.objects = IndexRuns.whole(len(store.manifest)) if objects is None else objects
        if not len(self.objects):
            raise DatasetError(f"{store.url} holds no files")
        self._shards(store)

    def _shards(self, store: CachedStore) -> None:
        self.keys = SampleKeys(store.manifest, self.objects)
        super().__init__(store, np.ones(len(self.objects), np.int64), _OneKeyShards(self.keys))

    def __getstate__(self) -> dict[str, Any]:
        """What a worker needs: the per-sample arrays are remade there from the runs."""
        derived = ("keys", "shard_sizes", "shard_keys", "shard_offsets", "targets")
        return {k: v for k, v in self.__dict__.items() if k not in derived}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._shards(self.store)

    def shard_of(self, index: int) -> int:
        return index

    def suffix(self, index: int) -> str:
        return suffix_of(self.keys[self._check(index)])

    def _load(self, index: int) -> Any:
        return self.store.read(self.keys[index])

    def sample_ranges(self, index: int) -> list[Range] | None:
        manifest = self.store.manifest
        i = self.objects[index]
        size = manifest.size(i)
        return None if size is None else [(manifest.key(i), 0, size)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        return bytes(parts[0]) if copy else parts[0]

    def sample_spans(self, indices: Int64s) -> SampleSpans | None:
        manifest = self.store.manifest
        objects = self.objects.at(indices)
        sizes = manifest.sizes_at(objects)
        if len(sizes) and int(sizes.min()) < 0:
            return None
        return SampleSpans(objects, manifest.keys_at(objects), sizes, self._labels_at(indices))

    def _labels_at(self, indices: Int64s) -> Int64s | None:
        return None

    @property
    def decodable(self) -> bool:
        """A file is an encoded image as it is (or not one: the decoder says which)."""
        return True

    def describe(self, index: int) -> str:
        return self.store.object_url(self.keys[index])


class ImageFolderDataset(FileDataset):
    """torchvision's ImageFolder layout: ``root/<class>/**/<image>``; samples are
    ``(encoded bytes, class index)``, classes and samples ordered as torchvision orders them
    (classes sorted by name; within a class, files sorted by folder, then name)."""

    format = "imagefolder"

    def __init__(self, store: CachedStore, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> None:
        ident = hashlib.sha256("\0".join(extensions).encode()).hexdigest()[:12]
        layout = store.manifest.derived(
            f"imagefolder-{ident}", lambda: _layout(store.manifest, extensions)
        )
        if not len(layout["classes"]):
            raise DatasetError(
                f"{store.url} has no class folders holding images ({', '.join(extensions)}); "
                "use format='files' for a flat folder"
            )
        self.classes: list[str] = layout["classes"].tolist()
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.class_offsets = layout["class_offsets"].astype(np.int64)
        super().__init__(store, IndexRuns.of_runs(layout["run_starts"], layout["run_offsets"]))

    @functools.cached_property
    def targets(self) -> Int64s:
        """Each sample's class index, as torchvision has it (made on first access, then
        kept: one integer per sample, which a loader never needs; it uses :meth:`target`)."""
        return np.repeat(np.arange(len(self.classes)), np.diff(self.class_offsets))

    def target(self, index: int) -> int:
        return int(np.searchsorted(self.class_offsets, index, side="right")) - 1

    def _labels_at(self, indices: Int64s) -> Int64s | None:
        return np.searchsorted(self.class_offsets, indices, side="right").astype(np.int64) - 1

    def _load(self, index: int) -> Any:
        return self.store.read(self.keys[index]), self.target(index)

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        return (bytes(parts[0]) if copy else parts[0]), self.target(index)

    def image_and_label(self, sample: Any, index: int) -> tuple[Any, Any]:
        return sample[0], sample[1]


def _layout(manifest: Manifest, extensions: tuple[str, ...]) -> dict[str, Any]:
    """Classes (sorted), where each class's samples start, and the samples as runs."""
    runs = sorted(_class_runs(manifest, extensions), key=lambda run: run[0])
    order = np.concatenate([members for _, members in runs]) if runs else np.zeros(0, np.int64)
    samples = IndexRuns(order)
    counts = [len(members) for _, members in runs]
    return {
        "classes": np.array([name for name, _ in runs], dtype=str),
        "class_offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "run_starts": samples.starts,
        "run_offsets": samples.offsets,
    }


def _class_runs(manifest: Manifest, extensions: tuple[str, ...]) -> list[tuple[str, Int64s]]:
    """(class name, the listing's indices of its images in torchvision's order), one per
    class folder holding images. A class's keys are consecutive in key order (they share
    the prefix ``class/``), so each class is found with one search, not a key at a time."""
    images = with_extension(manifest, extensions)
    first, last = slashes(manifest)
    candidates = np.flatnonzero(images & (first >= 0))
    runs: list[tuple[str, Int64s]] = []
    at = 0
    while at < len(candidates):
        i = int(candidates[at])
        name = _folder_of(manifest, i, int(first[i]))
        end = manifest.search(name + "0")  # "0" follows "/": past every "name/..." key
        stop = int(np.searchsorted(candidates, end))
        if stop <= at:  # cannot happen for a sorted listing; never loop on one that is not
            raise DatasetError(
                f"{manifest.url}: the listing is not in key order at {manifest.key(i)!r}; "
                "open the dataset again with refresh=True"
            )
        members = candidates[at:stop]
        if (last[members] != first[members]).any():  # subfolders: by folder, then name
            keys = {int(m): manifest.key(int(m)) for m in members}
            members = np.array(sorted(keys, key=lambda m: posixpath.split(keys[m])), dtype=np.int64)
        runs.append((name, members.astype(np.int64)))
        at = stop
    return runs


def _folder_of(manifest: Manifest, i: int, first_slash: int) -> str:
    """Key i up to its first ``/``: ``first_slash`` counts UTF-8 bytes, not characters
    (``clåss/x.jpg`` has its slash at byte 6, character 5)."""
    start = int(manifest.key_offsets[i])
    return str(manifest.key_blob[start : start + first_slash], *_ENCODING)


def with_extension(manifest: Manifest, extensions: tuple[str, ...]) -> np.ndarray:
    """Which keys end with one of extensions, ignoring case (``key.lower().endswith``)."""
    short = [e.lower().encode() for e in extensions if len(e.encode()) <= 8 and e.isascii()]
    hit = ends_with(key_tails(manifest, lower=True), short) if short else None
    if hit is not None and len(short) == len(extensions):
        return hit
    keys = manifest.keys()  # an unusual extension: the per-key test
    return np.array([k.lower().endswith(extensions) for k in keys], dtype=bool)
