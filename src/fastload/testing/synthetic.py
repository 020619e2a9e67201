"""Synthetic buckets: datasets of any size computed from (key, seed), never stored.

A layout says which keys a bucket holds, in S3's (sorted) order, and computes any byte
range of any object from its index. Nothing per object is kept: an ImageNet-sized bucket
costs no disk and a few payloads of memory, and a listing page is a few bisections over
the computed keys. :class:`~fastload.testing.S3FolderServer` serves layouts read-only
(``synthetic={"bucket": layout}``)::

    ImageFolderLayout(objects=7, classes=3, payloads=...)       index -> key
        [0] n00000000/n00000000_00000000.JPEG       7 = 3 * 2 + 1: the first 7 % 3
        [1] n00000000/n00000000_00000001.JPEG       classes hold one object more
        [2] n00000000/n00000000_00000002.JPEG
        [3] n00000001/n00000001_00000000.JPEG
        [4] n00000001/n00000001_00000001.JPEG
        [5] n00000002/n00000002_00000000.JPEG
        [6] n00000002/n00000002_00000001.JPEG

    TarShardsLayout(shards=2, samples_per_shard=3, payloads=..., shard_index=True)
        [0] shard-000000.tar   000000000.jpg 000000000.cls ... 000000002.jpg 000000002.cls
        [1] shard-000001.tar   000000003.jpg 000000003.cls ... 000000005.jpg 000000005.cls
        [2] shardindex.json    wids' shard list

An object's bytes are one payload of a small pool, drawn from (key, seed). Its ETag is
an MD5 of the layout's parameters and the key (so any change to the layout changes every
ETag), and every object was last modified at ``LAST_MODIFIED_S``.

A server in another process learns its layouts from a spec file in its root
(``write_spec``); ``S3FolderProcess(synthetic=...)`` writes it.
"""

from __future__ import annotations

import abc
import base64
import bisect
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "LAST_MODIFIED_S",
    "SPEC_NAME",
    "ImageFolderLayout",
    "SyntheticLayout",
    "TarShardsLayout",
    "jpeg_payloads",
    "random_payloads",
    "read_spec",
    "write_spec",
]

LAST_MODIFIED_S = 1_767_225_600  # 2026-01-01T00:00:00Z
# The file in a server's root that declares its synthetic buckets (not a bucket: a dot name).
SPEC_NAME = ".s3folder-synthetic.json"
_BLOCK = tarfile.BLOCKSIZE  # 512
_INDEX_NAME = "shardindex.json"
_CHUNK_BYTES = 1 << 20


def random_payloads(count: int, nbytes: int, *, seed: int = 0) -> tuple[bytes, ...]:
    """``count`` payloads of ``nbytes`` pseudo-random bytes each, the same for a seed."""
    return tuple(
        b"".join(
            hashlib.sha256(f"{seed}:{i}:{block}".encode()).digest()
            for block in range(-(-nbytes // 32))
        )[:nbytes]
        for i in range(count)
    )


def jpeg_payloads(
    count: int, *, width: int = 500, height: int = 375, quality: int = 90, seed: int = 0
) -> tuple[bytes, ...]:
    """``count`` JPEG photos-alike (smooth gradients plus noise; ImageNet's median size is
    500x375, ~110 KB at quality 90), encoded with simplejpeg."""
    import numpy as np

    simplejpeg = importlib.import_module("simplejpeg")  # it ships no type information
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    payloads = []
    for _ in range(count):
        fx, fy = rng.uniform(0.005, 0.05, (2, 3, 1, 1))
        phase = rng.uniform(0, 2 * np.pi, (3, 1, 1))
        waves = 127 + 80 * np.sin(fx * x + fy * y + phase) + rng.normal(0, 8, (3, height, width))
        pixels = np.clip(waves, 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()
        payloads.append(simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB"))
    return tuple(payloads)


class _Keys:
    """The layout's keys as a read-only sequence, computed on access (for ``bisect``)."""

    def __init__(self, layout: SyntheticLayout) -> None:
        self._layout = layout

    def __len__(self) -> int:
        return self._layout.count

    def __getitem__(self, index: int) -> str:
        return self._layout.key(index)


class SyntheticLayout(abc.ABC):
    """A bucket's objects, computed: keys in sorted order by index, sizes, bytes, ETags.

    Subclasses are frozen dataclasses with ``payloads``, ``seed`` and ``prefix`` fields;
    they compute ``count``, ``key``, ``size`` and ``read``.
    """

    kind: ClassVar[str]  # names the layout in a spec file
    payloads: tuple[bytes, ...]
    seed: int
    prefix: str

    @property
    @abc.abstractmethod
    def count(self) -> int:
        """How many objects the bucket holds."""

    @abc.abstractmethod
    def key(self, index: int) -> str:
        """The key of the object at ``index`` of the sorted listing."""

    @abc.abstractmethod
    def size(self, index: int) -> int: ...

    @abc.abstractmethod
    def read(self, index: int, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the object at ``index`` (within its size), in pieces."""

    @property
    def keys(self) -> _Keys:
        return _Keys(self)

    def index(self, key: str) -> int | None:
        """The index of ``key``, or None if the bucket holds no such key."""
        keys = self.keys
        index = bisect.bisect_left(keys, key)
        return index if index < len(keys) and keys[index] == key else None

    def etag(self, index: int) -> str:
        """The object's ETag (hex, unquoted): stable for this layout and key."""
        return hashlib.md5(self._fingerprint + self.key(index).encode()).hexdigest()

    def content(self, index: int) -> bytes:
        """All of the object's bytes (for tests; servers ``read`` ranges)."""
        return b"".join(self.read(index, 0, self.size(index)))

    def _check_common(self) -> None:
        if not self.payloads:
            raise ValueError("payloads must hold at least one byte string")
        if self.prefix and (not self.prefix.endswith("/") or self.prefix.startswith("/")):
            raise ValueError(
                f"prefix must be '' or end with '/' (no leading '/'), got {self.prefix!r}"
            )

    def _check_index(self, index: int) -> int:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} objects")
        return index

    def _draw(self, name: str) -> int:
        """A number drawn from (name, seed): which payload, which label."""
        digest = hashlib.blake2b(name.encode(), digest_size=8, key=str(self.seed).encode())
        return int.from_bytes(digest.digest(), "big")

    @functools.cached_property
    def _fingerprint(self) -> bytes:
        return hashlib.md5(json.dumps(self.to_json(), sort_keys=True).encode()).digest()

    def to_json(self) -> dict[str, Any]:
        """The layout as JSON values (payloads in base64), for a spec file."""
        layout: Any = self  # a dataclass: every subclass is one
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(layout)}
        fields["payloads"] = [base64.b64encode(p).decode() for p in self.payloads]
        return {"kind": self.kind, **fields}

    @staticmethod
    def from_json(spec: Mapping[str, Any]) -> SyntheticLayout:
        fields = dict(spec)
        kind = fields.pop("kind")
        layouts: dict[str, type[ImageFolderLayout | TarShardsLayout]] = {
            ImageFolderLayout.kind: ImageFolderLayout,
            TarShardsLayout.kind: TarShardsLayout,
        }
        if kind not in layouts:
            raise ValueError(f"unknown synthetic layout {kind!r}; known: {sorted(layouts)}")
        fields["payloads"] = tuple(base64.b64decode(p) for p in fields["payloads"])
        return layouts[kind](**fields)


@dataclass(frozen=True, kw_only=True)
class ImageFolderLayout(SyntheticLayout):
    """``objects`` images in ``classes`` class folders, ImageNet's train layout.

    Keys are ``{prefix}n{class:08d}/n{class:08d}_{rank:08d}.JPEG`` (fixed widths, so key
    order is index order); each object is one of ``payloads``, drawn from (key, seed).
    """

    kind: ClassVar[str] = "imagefolder"
    objects: int
    classes: int
    payloads: tuple[bytes, ...]
    seed: int = 0
    prefix: str = ""

    def __post_init__(self) -> None:
        self._check_common()
        if not 0 <= self.objects < 10**8 or not 1 <= self.classes < 10**8:
            raise ValueError(
                f"need 0 <= objects < 10**8 and 1 <= classes < 10**8, got "
                f"objects={self.objects}, classes={self.classes}"
            )

    @property
    def count(self) -> int:
        return self.objects

    def label(self, index: int) -> int:
        """The class of the object at ``index``."""
        return self._class_and_rank(index)[0]

    def _class_and_rank(self, index: int) -> tuple[int, int]:
        per_class, bigger = divmod(self.objects, self.classes)
        in_bigger = bigger * (per_class + 1)  # objects in the classes that hold one more
        index = self._check_index(index)
        if index < in_bigger:
            return divmod(index, per_class + 1)
        label, rank = divmod(index - in_bigger, per_class)
        return bigger + label, rank

    def key(self, index: int) -> str:
        label, rank = self._class_and_rank(index)
        return f"{self.prefix}n{label:08d}/n{label:08d}_{rank:08d}.JPEG"

    def _payload(self, index: int) -> bytes:
        return self.payloads[self._draw(self.key(index)) % len(self.payloads)]

    def size(self, index: int) -> int:
        return len(self._payload(index))

    def read(self, index: int, start: int, end: int) -> Iterator[bytes]:
        yield self._payload(index)[start:end]


@dataclass(frozen=True, kw_only=True)
class TarShardsLayout(SyntheticLayout):
    """``shards`` WebDataset tar shards of ``samples_per_shard`` samples each.

    Sample ``g`` (numbered across shards) is ``{g:09d}.jpg``, one of ``payloads`` drawn
    from (its name, seed) and zero-padded to the longest payload (decoders stop at a
    JPEG's end-of-image marker), and ``{g:09d}.cls``, its label in decimal, drawn below
    ``classes``. Every member has the same size, so where any byte of a shard lies is
    arithmetic::

        one sample: | header | .jpg data, padded to 512 | header | .cls data | padding |
        a shard:    | sample 0 | sample 1 | ... | two zero blocks (end of archive) |

    With ``shard_index`` the bucket also holds ``shardindex.json`` (wids' shard list).
    1,024 shards of 600 samples of ~110 KB (68 MB each): 69 GB that is never stored.
    """

    kind: ClassVar[str] = "tar"
    shards: int
    samples_per_shard: int
    payloads: tuple[bytes, ...]
    classes: int = 1000
    shard_index: bool = False
    seed: int = 0
    prefix: str = ""

    def __post_init__(self) -> None:
        self._check_common()
        if not 0 <= self.shards < 10**6 or self.samples_per_shard < 1 or self.classes < 1:
            raise ValueError(
                f"need 0 <= shards < 10**6, samples_per_shard >= 1 and classes >= 1, got "
                f"shards={self.shards}, samples_per_shard={self.samples_per_shard}, "
                f"classes={self.classes}"
            )
        if self.shards * self.samples_per_shard > 10**9:
            raise ValueError("at most 10**9 samples (their names have 9 digits)")

    @property
    def count(self) -> int:
        return self.shards + self.shard_index

    def key(self, index: int) -> str:
        # "shard-" sorts before "shardindex.json": '-' < 'i'.
        if self._check_index(index) < self.shards:
            return f"{self.prefix}shard-{index:06d}.tar"
        return self.prefix + _INDEX_NAME

    @functools.cached_property
    def sample_bytes(self) -> int:
        """The size of every ``.jpg`` member: the longest payload."""
        return max(len(p) for p in self.payloads)

    @functools.cached_property
    def _sample_span(self) -> int:
        jpg_blocks = -(-self.sample_bytes // _BLOCK)
        return (1 + jpg_blocks + 1 + 1) * _BLOCK

    @property
    def shard_bytes(self) -> int:
        return self.samples_per_shard * self._sample_span + 2 * _BLOCK

    def size(self, index: int) -> int:
        if self._check_index(index) < self.shards:
            return self.shard_bytes
        return len(self._shard_index)

    def sample_name(self, sample: int) -> str:
        return f"{sample:09d}"

    def label(self, sample: int) -> int:
        return self._draw(self.sample_name(sample) + ".cls") % self.classes

    def jpg(self, sample: int) -> bytes:
        """The ``.jpg`` member's payload, before its zero padding."""
        return self.payloads[self._draw(self.sample_name(sample) + ".jpg") % len(self.payloads)]

    def read(self, index: int, start: int, end: int) -> Iterator[bytes]:
        if self._check_index(index) == self.shards:
            yield self._shard_index[start:end]
        else:
            yield from _joined(self._shard_pieces(index, start, end), _CHUNK_BYTES)

    def _shard_pieces(self, shard: int, start: int, end: int) -> Iterator[bytes]:
        span = self._sample_span
        first_sample = shard * self.samples_per_shard
        for i in range(start // span, min(self.samples_per_shard, -(-end // span))):
            yield from _clip(self._sample_pieces(first_sample + i), i * span, start, end)
        end_of_samples = self.samples_per_shard * span
        if end > end_of_samples:
            yield bytes(end - max(start, end_of_samples))

    def _sample_pieces(self, sample: int) -> Iterator[bytes]:
        name = self.sample_name(sample)
        payload = self.jpg(sample)
        label = str(self.label(sample)).encode()
        yield _tar_header(f"{name}.jpg", self.sample_bytes)
        yield payload
        yield self._zeros[: self._sample_span - 3 * _BLOCK - len(payload)]
        yield _tar_header(f"{name}.cls", len(label))
        yield label
        yield self._zeros[: _BLOCK - len(label)]

    @functools.cached_property
    def _zeros(self) -> bytes:
        return bytes(self._sample_span)

    @functools.cached_property
    def _shard_index(self) -> bytes:
        shardlist = [
            {"url": self.key(s)[len(self.prefix) :], "nsamples": self.samples_per_shard}
            for s in range(self.shards)
        ]
        index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist}
        return json.dumps(index).encode()


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = LAST_MODIFIED_S
    info.mode = 0o644
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def _joined(pieces: Iterable[bytes], size: int) -> Iterator[bytes]:
    """``pieces`` joined into chunks of about ``size`` bytes: a socket write per tar header
    would cost more than the bytes."""
    chunk = bytearray()
    for piece in pieces:
        chunk += piece
        if len(chunk) >= size:
            yield bytes(chunk)
            chunk.clear()
    if chunk:
        yield bytes(chunk)


def _clip(pieces: Iterable[bytes], offset: int, start: int, end: int) -> Iterator[bytes]:
    """The parts within ``[start, end)`` of consecutive ``pieces`` laid out from ``offset``."""
    for piece in pieces:
        piece_end = offset + len(piece)
        if piece_end > start and offset < end:
            yield piece[max(start - offset, 0) : min(end, piece_end) - offset]
        offset = piece_end
        if offset >= end:
            return


# -- spec files -------------------------------------------------------------------------------


def write_spec(root: str | os.PathLike[str], buckets: Mapping[str, SyntheticLayout]) -> Path:
    """Declare ``buckets`` in ``root`` for the next ``S3FolderServer(root)``; returns the file."""
    path = Path(root) / SPEC_NAME
    spec = {name: layout.to_json() for name, layout in buckets.items()}
    tmp = path.with_name(f"{SPEC_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, path)
    return path


def read_spec(root: str | os.PathLike[str]) -> dict[str, SyntheticLayout]:
    """The synthetic buckets declared in ``root`` (none without a spec file)."""
    path = Path(root) / SPEC_NAME
    if not path.is_file():
        return {}
    spec = json.loads(path.read_text())
    return {name: SyntheticLayout.from_json(layout) for name, layout in spec.items()}
