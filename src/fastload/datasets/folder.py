"""File folders: one sample per file; with ImageFolder layout, (bytes, class index) pairs."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

from fastload.datasets.base import DatasetError, Range, ShardedDataset
from fastload.store import CachedStore

# torchvision's IMG_EXTENSIONS: the files ImageFolder takes as samples.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def suffix_of(key: str) -> str:
    return posixpath.splitext(key)[1].lower()


class FileDataset(ShardedDataset):
    """Every object under the root is a sample: ``dataset[i]`` is its bytes.

    ``dataset.keys[i]`` names it and ``dataset.suffix(i)`` says what the bytes are.
    """

    format = "files"

    def __init__(self, store: CachedStore, keys: list[str] | None = None) -> None:
        self.keys = sorted(store.object_keys()) if keys is None else keys
        if not self.keys:
            raise DatasetError(f"{store.url} holds no files")
        super().__init__(store, [1] * len(self.keys), [[k] for k in self.keys])

    def suffix(self, index: int) -> str:
        return suffix_of(self.keys[self._check(index)])

    def _load(self, index: int) -> Any:
        return self.store.read(self.keys[index])

    def sample_ranges(self, index: int) -> list[Range] | None:
        key = self.keys[index]
        size = self.store.object(key).size
        return None if size is None else [(key, 0, size)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        return bytes(parts[0]) if copy else parts[0]


class ImageFolderDataset(FileDataset):
    """torchvision's ImageFolder layout: ``root/<class>/**/<image>``; samples are
    ``(encoded bytes, class index)``, classes and samples ordered as torchvision orders them
    (classes sorted by name; within a class, files sorted by folder, then name)."""

    format = "imagefolder"

    def __init__(self, store: CachedStore, extensions: tuple[str, ...] = IMAGE_EXTENSIONS) -> None:
        by_class: dict[str, list[str]] = {}
        for key in store.object_keys():
            if "/" not in key or not key.lower().endswith(extensions):
                continue  # files beside the class folders, or not images
            by_class.setdefault(key.split("/", 1)[0], []).append(key)
        if not by_class:
            raise DatasetError(
                f"{store.url} has no class folders holding images ({', '.join(extensions)}); "
                "use format='files' for a flat folder"
            )
        self.classes = sorted(by_class)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        keys: list[str] = []
        self.targets: list[int] = []
        for c in self.classes:
            members = sorted(
                by_class[c], key=lambda k: (posixpath.dirname(k), posixpath.basename(k))
            )
            keys += members
            self.targets += [self.class_to_idx[c]] * len(members)
        super().__init__(store, keys)

    def _load(self, index: int) -> Any:
        return self.store.read(self.keys[index]), self.targets[index]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        return (bytes(parts[0]) if copy else parts[0]), self.targets[index]
