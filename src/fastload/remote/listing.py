"""A listing in columns: keys, sizes and versions of a dataset's objects, sorted by key.

What a transport lists becomes a :class:`~fastload.manifest.Manifest` without a Python
object per entry: keys and versions are UTF-8 blobs with offsets, sizes an array. S3 pages
arrive as Arrow record batches (obstore's ``return_arrow=True``) and are read through the
Arrow C data interface (:func:`from_arrow`): the per-object work is a few array passes,
not ~5 us of Python per entry (1.28 M objects: ~6 s of a start-up's CPU).
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Int64s = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]
_MOST_PIECES = 10_000
# Keys are stored UTF-8; surrogates (undecodable local names) pass through, in code point order.
ENCODING = ("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Listing:
    """Objects in key order (UTF-8 byte order, which is code point order), one per key.
    Key i is ``key_blob[key_offsets[i]:key_offsets[i + 1]]``; versions likewise, where
    ``version_present[i]``; ``sizes[i]`` is -1 where the backend gave none."""

    key_blob: bytes
    key_offsets: Int64s
    sizes: Int64s
    version_blob: bytes
    version_offsets: Int64s
    version_present: Bytes

    def __len__(self) -> int:
        return len(self.sizes)

    def key(self, i: int) -> bytes:
        return self.key_blob[self.key_offsets[i] : self.key_offsets[i + 1]]

    def pieces(self) -> list[Listing]:
        """One listing per object, or this one whole when it has many (a folder of files
        beside a few folders: merged a key at a time instead, see :meth:`joined`)."""
        if len(self) > _MOST_PIECES:
            return [self]
        return [self._slice(i) for i in range(len(self))]

    def _slice(self, i: int) -> Listing:
        k, v = self.key_offsets, self.version_offsets
        return Listing(
            self.key_blob[k[i] : k[i + 1]],
            np.array([0, k[i + 1] - k[i]], dtype=np.int64),
            self.sizes[i : i + 1],
            self.version_blob[v[i] : v[i + 1]],
            np.array([0, v[i + 1] - v[i]], dtype=np.int64),
            self.version_present[i : i + 1],
        )

    @classmethod
    def of(
        cls,
        keys: Sequence[str],
        sizes: Sequence[int | None],
        versions: Sequence[str | None],
    ) -> Listing:
        """From Python columns in any order; a key listed twice keeps its last entry."""
        if any(a >= b for a, b in itertools.pairwise(keys)):  # listings usually come sorted
            last = {k: i for i, k in enumerate(keys)}
            order = sorted(last.values(), key=keys.__getitem__)
            keys = [keys[i] for i in order]
            sizes = [sizes[i] for i in order]
            versions = [versions[i] for i in order]
        encoded_keys = [k.encode(*ENCODING) for k in keys]
        encoded_versions = [b"" if v is None else v.encode(*ENCODING) for v in versions]
        return cls(
            b"".join(encoded_keys),
            _offsets(encoded_keys),
            np.array([-1 if s is None else s for s in sizes], dtype=np.int64),
            b"".join(encoded_versions),
            _offsets(encoded_versions),
            np.array([v is not None for v in versions], dtype=np.uint8),
        )

    @classmethod
    def joined(cls, parts: Sequence[Listing]) -> Listing:
        """The parts as one listing. Parts listed from disjoint prefixes follow each other
        in key order once sorted by their first keys; parts that interleave (an object
        beside folders) are merged a key at a time."""
        parts = sorted((p for p in parts if len(p)), key=lambda p: p.key(0))
        if any(a.key(len(a) - 1) >= b.key(0) for a, b in itertools.pairwise(parts)):
            return cls.of(*_python_columns(parts))
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.of([], [], [])
        return cls(
            b"".join(p.key_blob for p in parts),
            _joined_offsets([p.key_offsets for p in parts]),
            np.concatenate([p.sizes for p in parts]),
            b"".join(p.version_blob for p in parts),
            _joined_offsets([p.version_offsets for p in parts]),
            np.concatenate([p.version_present for p in parts]),
        )


def _offsets(encoded: Sequence[bytes]) -> Int64s:
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    return offsets


def _joined_offsets(parts: Sequence[Int64s]) -> Int64s:
    shifts = np.cumsum([0] + [int(p[-1]) for p in parts[:-1]])
    return np.concatenate([[0]] + [p[1:] + s for p, s in zip(parts, shifts, strict=True)])


def _python_columns(
    parts: Sequence[Listing],
) -> tuple[list[str], list[int | None], list[str | None]]:
    keys: list[str] = []
    sizes: list[int | None] = []
    versions: list[str | None] = []
    for p in parts:
        for i in range(len(p)):
            keys.append(str(p.key(i), *ENCODING))
            size = int(p.sizes[i])
            sizes.append(None if size < 0 else size)
            v = p.version_offsets
            present = p.version_present[i]
            versions.append(str(p.version_blob[v[i] : v[i + 1]], *ENCODING) if present else None)
    return keys, sizes, versions


# --- Arrow pages ---------------------------------------------------------------------------


class _ArrowSchema(ctypes.Structure):
    _fields_ = [("format", ctypes.c_char_p)]  # the first field is all that is read


class _ArrowArray(ctypes.Structure):
    """The Arrow C data interface's ArrowArray (a stable ABI)."""

    _fields_ = [
        ("length", ctypes.c_int64),
        ("null_count", ctypes.c_int64),
        ("offset", ctypes.c_int64),
        ("n_buffers", ctypes.c_int64),
        ("n_children", ctypes.c_int64),
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("children", ctypes.c_void_p),
        ("dictionary", ctypes.c_void_p),
        ("release", ctypes.c_void_p),
        ("private_data", ctypes.c_void_p),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _utf8_column(column: Any) -> tuple[Int64s, Bytes] | None:
    """(offsets from 0, bytes) of an Arrow string column without nulls, copied out of
    Arrow's buffers; None for another type or a column with nulls."""
    schema_capsule, array_capsule = column.__arrow_c_array__()
    schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
    array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    if schema.format != b"u" or array.null_count != 0:
        return None
    n, first = array.length, array.offset
    raw = (ctypes.c_int32 * (first + n + 1)).from_address(array.buffers[1])
    offsets = np.ctypeslib.as_array(raw)[first:].astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    data = np.zeros(0, np.uint8)
    if end > start:
        data = np.ctypeslib.as_array((ctypes.c_uint8 * end).from_address(array.buffers[2]))
        data = data[start:end].copy()  # before the capsules release Arrow's buffers
    return offsets - start, data


_ETAG = np.frombuffer(b"ETag=", np.uint8)
_LONGEST_ETAG = 400  # versions are cut at 512 characters; an ETag this long is left to Python


def _modified_tails(seconds: Int64s) -> Bytes:
    """``;LastModified=<datetime>`` for each time (whole seconds, UTC), the datetime as
    Python prints it (s3fs's entries hold datetimes); one row of bytes each. Formatted
    once per distinct time: objects uploaded together share their second."""
    distinct, which = np.unique(seconds, return_inverse=True)
    rows = [
        f";LastModified={datetime.datetime.fromtimestamp(t, datetime.UTC)}".encode()
        for t in distinct.tolist()
    ]
    return np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), -1)[which]


def from_arrow(batch: Any, cut: int) -> Listing | None:
    """A page of obstore's listing (an Arrow record batch: path, size, e_tag,
    last_modified), keys less their first ``cut`` bytes (the root's prefix), versions as
    ``fastload.manifest`` writes s3fs's entries (``ETag=<etag>;LastModified=<datetime>``,
    the datetime as Python prints it), the page's own key order kept. None where the page
    needs a key at a time (nulls, timestamps with microseconds, an empty object: a folder
    marker only s3fs lists right)."""
    paths, etags = _utf8_column(batch.column("path")), _utf8_column(batch.column("e_tag"))
    if paths is None or etags is None:
        return None
    sizes = np.asarray(batch.column("size").to_numpy()).astype(np.int64)
    import arro3.core

    micros = np.asarray(batch.column("last_modified").cast(arro3.core.DataType.int64()).to_numpy())
    if (sizes == 0).any() or (micros % 1_000_000).any():
        return None
    n = len(sizes)
    key_offsets, key_bytes = paths
    if cut:
        if (np.diff(key_offsets) <= cut).any():
            return None  # a key that is the root itself: s3fs decides what it is
        keep = np.ones(len(key_bytes), dtype=bool)
        keep[key_offsets[:-1, None] + np.arange(cut)] = False
        key_bytes = key_bytes[keep]
        key_offsets = key_offsets - np.arange(n + 1) * cut
    etag_offsets, etag_bytes = etags
    etag_lengths = np.diff(etag_offsets)
    if (etag_lengths > _LONGEST_ETAG).any() or not etag_lengths.all():
        return None
    tail = _modified_tails(micros // 1_000_000)
    if (etag_lengths == etag_lengths[0]).all():  # S3's quoted MD5s: rows of one width
        rows = np.concatenate(
            [np.broadcast_to(_ETAG, (n, len(_ETAG))), etag_bytes.reshape(n, -1), tail], axis=1
        )
        width = rows.shape[1]
        return Listing(
            key_bytes.tobytes(),
            key_offsets,
            sizes,
            rows.tobytes(),
            np.arange(0, width * (n + 1), width, dtype=np.int64),
            np.ones(n, dtype=np.uint8),
        )
    version_lengths = len(_ETAG) + etag_lengths + tail.shape[1]
    version_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(version_lengths, out=version_offsets[1:])
    out = np.empty(int(version_offsets[-1]), dtype=np.uint8)
    starts = version_offsets[:-1]
    out[starts[:, None] + np.arange(len(_ETAG))] = _ETAG
    shift = np.repeat(starts + len(_ETAG) - etag_offsets[:-1], etag_lengths)
    out[np.arange(len(etag_bytes)) + shift] = etag_bytes
    out[(starts + len(_ETAG) + etag_lengths)[:, None] + np.arange(tail.shape[1])] = tail
    return Listing(
        key_bytes.tobytes(),
        key_offsets,
        sizes,
        out.tobytes(),
        version_offsets,
        np.ones(n, dtype=np.uint8),
    )
