"""Parquet files, read row group by row group through fastload's cache.

The dataset's objects are the ``.parquet`` files under the URL (in key order; other objects
such as ``README.md`` are ignored); its shards are their row groups, and sample ``i`` is
one row as a dict of column values::

    train-00000.parquet                    dataset
      row group 0: rows 0..999     ──►  shard 0: [0] {"image": b"\\xff\\xd8..", "label": 3}
      row group 1: rows 1000..1999 ──►  shard 1 ...
    train-00001.parquet
      row group 0 ...              ──►  shard 2 ...

Opening reads only each file's footer, as two byte ranges through the cache (its last 8
bytes: the footer's length and ``PAR1``; then the footer), many files at once. A row
group is read as the byte ranges of its column chunks (cached as range entries, or cut
from the whole file where the cache holds it), decoded by pyarrow, and kept in a small
per-process LRU bounded by bytes, so consecutive rows decode it once.

Values: binary as ``bytes``; the image column as its bytes (a Hugging Face ``Image``
struct ``{bytes, path}`` gives its ``bytes``); the label column as an int (a dictionary-
encoded one as its value's position in ``classes``, the sorted distinct values of every
file's dictionaries: the same int is the same class in every file and row group); nulls
as None; other columns as pyarrow's ``as_py`` gives them.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import (
    DatasetError,
    Range,
    ShardedDataset,
    StoreFile,
    keys_ending,
)
from fastload.datasets.lru import ProcessLRU
from fastload.errors import MissingBackendError
from fastload.remote.listing import ENCODING as _ENCODING
from fastload.resources import memory_share
from fastload.store import CachedStore

DEFAULT_ROW_GROUP_CACHE_BYTES = memory_share(256 << 20, 1 / 16)  # lower in a small container
_MAGIC = b"PAR1"
_TAIL = 8  # the footer's length (uint32, little-endian) and the magic
_OPEN_THREADS = 16
# Column chunks of a row group closer than this are read as one range (what lies between
# is columns left out by ``columns=``).
_MAX_GAP_BYTES = 1 << 20
_ENTRY_OVERHEAD_BYTES = 256
IMAGE_NAMES = ("image", "img", "jpg", "jpeg", "png")
LABEL_NAMES = ("label", "labels", "cls", "target")


def _pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or an error saying what to install."""
    try:
        pyarrow = importlib.import_module("pyarrow")
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError as e:
        raise MissingBackendError(
            "reading Parquet needs pyarrow: pip install 'fastload[parquet]' (or pip install "
            "pyarrow)"
        ) from e
    return pyarrow, parquet


@dataclass(frozen=True)
class _File:
    """One Parquet file: where its footer is, and its row groups' rows and byte spans."""

    key: str
    size: int
    footer_length: int
    rows: tuple[int, ...]  # per row group


class DecodedRowGroups(ProcessLRU[tuple[int, int], dict[str, list[Any]]]):
    """Decoded row groups (columns as Python lists) by (file, row group)."""

    setting = "row_group_cache_bytes"

    def __init__(self, max_bytes: int = DEFAULT_ROW_GROUP_CACHE_BYTES) -> None:
        super().__init__(max_bytes)


class ParquetDataset(ShardedDataset):
    """Rows of the ``.parquet`` files under a URL; shards are row groups (module docstring).

    ``columns`` picks the columns a sample holds (default: all). ``image_column`` names the
    image column (default: a struct column with a binary ``bytes`` field, the Hugging Face
    ``Image`` feature, else a binary column named image/img/jpg/jpeg/png; None if there is
    none); ``label_column`` the label (default: an integer or dictionary column named
    label/labels/cls/target). With an image column, ``fl.DataLoader(ds, decode=...)``
    gives ``(images, labels)`` batches. ``row_group_cache_bytes`` bounds the per-process
    cache of decoded row groups (0 turns it off).
    """

    format = "parquet"

    def __init__(
        self,
        store: CachedStore,
        *,
        columns: Sequence[str] | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
        row_group_cache_bytes: int = DEFAULT_ROW_GROUP_CACHE_BYTES,
    ) -> None:
        if isinstance(columns, str) or (columns is not None and not columns):
            raise ValueError(
                f"columns must be a non-empty list of column names such as ['image', "
                f"'label'], got {columns!r}"
            )
        _pyarrow()
        self.decoded = DecodedRowGroups(row_group_cache_bytes)
        keys = _parquet_keys(store)
        metas = _read_footers(store, keys)
        files = [
            _File(
                k,
                _size(store, k),
                n,
                tuple(md.row_group(i).num_rows for i in range(md.num_row_groups)),
            )
            for k, (md, n) in zip(keys, metas, strict=True)
        ]
        self.files = files
        self._metadata: list[Any] | None = [md for md, _ in metas]
        schemas = [md.schema.to_arrow_schema() for md, _ in metas]
        first = schemas[0]
        for name in (*(columns or ()), image_column, label_column):
            if name is not None:
                _require(store, keys[0], first, name)
        chosen = list(dict.fromkeys(columns)) if columns is not None else list(first.names)
        self.image_column = (
            image_column if image_column is not None else _detect_image(first, chosen)
        )
        self.label_column = (
            label_column if label_column is not None else _detect_label(first, chosen)
        )
        for extra in (self.image_column, self.label_column):
            if extra is not None and extra not in chosen:
                chosen.append(extra)
        self.columns: tuple[str, ...] = tuple(chosen)
        if self.image_column is not None:
            _check_image(store, keys[0], first, self.image_column)
        self._image_bytes = (
            self.image_column is not None
            and _image_field(first.field(self.image_column).type) is not None
        )
        wanted = [first.field(c) for c in self.columns]
        for key, schema in zip(keys[1:], schemas[1:], strict=True):
            for name in self.columns:
                _require(store, key, schema, name)
            theirs = [schema.field(c) for c in self.columns]
            if not all(a.equals(b) for a, b in zip(wanted, theirs, strict=True)):
                differ = next(
                    f"{a} there, {b} here"
                    for a, b in zip(wanted, theirs, strict=True)
                    if not a.equals(b)
                )
                raise DatasetError(
                    f"{store.object_url(key)} and {store.object_url(keys[0])} have different "
                    f"schemas (column {differ}); a dataset's Parquet files must share one "
                    "schema: pick the columns they share with columns=[...], or open them apart"
                )
        # Shards: the row groups that hold rows, file by file.
        shard_file, shard_group, sizes = [], [], []
        for f, file in enumerate(files):
            for g, rows in enumerate(file.rows):
                if rows:
                    shard_file.append(f)
                    shard_group.append(g)
                    sizes.append(rows)
        if not sizes:
            raise DatasetError(
                f"{store.url} holds no rows: its {len(files)} Parquet file(s) have no row "
                "groups with rows"
            )
        self._shard_file: npt.NDArray[np.int32] = np.asarray(shard_file, dtype=np.int32)
        self._shard_group: npt.NDArray[np.int32] = np.asarray(shard_group, dtype=np.int32)
        self._new_locks()
        super().__init__(store, sizes, [[files[f].key] for f in shard_file])
        # A dictionary-encoded label's index is its position in its own chunk's dictionary:
        # one global class list (its values sorted) makes a label the same class everywhere.
        # Made when first needed (opening reads only footers), then kept beside the listing.
        self._classes: list[Any] | None = None

    def _new_locks(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._reading: dict[tuple[int, int], threading.Lock] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_reading"], state["_pid"]
        state["_metadata"] = None  # re-read from the cache where needed (footers are ranges)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._new_locks()

    # --- samples ---------------------------------------------------------------------------

    def where(self, index: int) -> tuple[str, int, int]:
        """(file key, row group, row within it) of sample index."""
        index = self._check(int(index))
        s = self.shard_of(index)
        f = int(self._shard_file[s])
        return self.files[f].key, int(self._shard_group[s]), index - int(self.shard_offsets[s])

    @property
    def decodable(self) -> bool:
        """With an image column: its cells are encoded images."""
        return self.image_column is not None

    def image_and_label(self, sample: Any, index: int) -> tuple[Any, Any]:
        if self.image_column is None:
            return sample, None
        # A null image stays None: the loader raises for it, or skips it like a bad image.
        image = sample[self.image_column]
        return image, None if self.label_column is None else sample[self.label_column]

    def describe(self, index: int) -> str:
        key, group, row = self.where(index)
        return f"row {row} of row group {group} of {self.store.object_url(key)}"

    def no_image(self, index: int) -> str:
        key, group, row = self.where(index)
        return (
            f"sample {index} (row {row} of row group {group} of {self.store.object_url(key)}) "
            f"has no image: its {self.image_column!r} is null"
        )

    def _load(self, index: int) -> Any:
        s = self.shard_of(index)
        f, g = int(self._shard_file[s]), int(self._shard_group[s])
        row = index - int(self.shard_offsets[s])
        group = self._row_group(f, g)
        return {name: values[row] for name, values in group.items()}

    def _row_group(self, f: int, g: int) -> dict[str, list[Any]]:
        cached = self.decoded.get((f, g))
        if cached is not None:
            return cached
        if self._pid != os.getpid():  # forked: locks held by the parent's threads stay held
            self._new_locks()
        with self._lock:
            reading = self._reading.setdefault((f, g), threading.Lock())
        with reading:  # one thread decodes a row group; others wait for it
            cached = self.decoded.get((f, g), count=False)
            if cached is None:
                cached, nbytes = self._decode(f, g)
                self.decoded.put((f, g), cached, nbytes)
            return cached

    def _decode(self, f: int, g: int) -> tuple[dict[str, list[Any]], int]:
        _, pq = _pyarrow()
        file = self.files[f]
        md = self.metadata(f)
        source = _RangeFile(self.store, file.key, file.size)
        source.prefetch(self._spans(f, g))
        url = self.store.object_url(file.key)
        try:
            table = pq.ParquetFile(source, metadata=md).read_row_group(
                g, columns=list(self.columns), use_threads=False
            )
            if table.num_rows != file.rows[g]:  # the footer said; never another group's row
                raise DatasetError(
                    f"{url}: row group {g} decodes to {table.num_rows} rows where the footer "
                    f"says {file.rows[g]}; the file is damaged or changed since the dataset "
                    "was opened: open it again with refresh=True, else rewrite the file"
                )
            # Converting is reading too: a damaged page can hold text that is not UTF-8.
            out = {name: self._values(table.column(name), name) for name in self.columns}
        except DatasetError:
            raise
        except Exception as e:
            raise DatasetError(
                f"{url}: row group {g} cannot be read ({type(e).__name__}: {e}); the file is "
                "damaged or changed since the dataset was opened: open it again with "
                "refresh=True, else rewrite the file"
            ) from e
        return out, int(table.nbytes) + _ENTRY_OVERHEAD_BYTES * (1 + table.num_rows)

    def _spans(self, f: int, g: int) -> list[tuple[int, int]]:
        """(start, end) of the byte spans row group g of file f is read as: its column
        chunks of the dataset's columns, merged where close."""
        rg = self.metadata(f).row_group(g)
        names = self.columns
        spans = []
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            path = chunk.path_in_schema
            if any(path == n or path.startswith(n + ".") for n in names):
                spans.append(_chunk_span(chunk))
        return _coalesce(spans)

    def stage_ranges(self, shard: int) -> list[Range]:
        """The byte ranges row group ``shard`` is read as (see :meth:`_spans`): a loader
        stages these as range entries, not the whole file (a rank reads ~1/world of a
        file's row groups). Footers were read, as ranges, when the dataset was opened."""
        f, g = int(self._shard_file[shard]), int(self._shard_group[shard])
        key = self.files[f].key
        return [(key, start, end - start) for start, end in self._spans(f, g)]

    def _values(self, column: Any, name: str) -> list[Any]:
        pa, _ = _pyarrow()
        values: list[Any] = []
        for chunk in column.chunks:
            if name == self.image_column and self._image_bytes:
                field = _image_field(chunk.type)
                values += chunk.flatten()[field].to_pylist()  # flatten: nulls of the struct
            elif name == self.label_column and pa.types.is_dictionary(chunk.type):
                values += self._class_indices(chunk)
            else:
                values += chunk.to_pylist()
        return values

    @property
    def classes(self) -> list[Any] | None:
        """With a dictionary-encoded label column: its distinct values over every file,
        sorted; a sample's label is its value's position here. None otherwise."""
        if self.label_column is None:
            return None
        if self._classes is None:
            kind = self._schema_type(self.label_column)
            if not pa_is_dictionary(kind):
                return None
            self._classes = self._label_classes()
        return self._classes

    def _schema_type(self, name: str) -> Any:
        return self.metadata(0).schema.to_arrow_schema().field(name).type

    def _class_indices(self, chunk: Any) -> list[int | None]:
        """A dictionary chunk's values as positions in :attr:`classes` (None for a null)."""
        assert self.classes is not None
        dictionary = chunk.dictionary.to_pylist()
        at = {value: i for i, value in enumerate(self.classes)}  # a few classes: cheap
        try:
            mapped = [at[value] for value in dictionary]
        except KeyError as e:
            raise DatasetError(
                f"{self.store.url}: label {e.args[0]!r} is in no file's dictionary as the "
                "dataset was opened; a file changed since: open it again with refresh=True"
            ) from None
        return [None if i is None else mapped[i] for i in chunk.indices.to_pylist()]

    def _label_classes(self) -> list[Any]:
        """The sorted distinct values of the label column over every file (each row group's
        label column chunk read once; kept beside the listing for the next open)."""
        name = self.label_column
        assert name is not None

        def make() -> dict[str, Any]:
            groups = [(f, g) for f, file in enumerate(self.files) for g in range(len(file.rows))]
            with ThreadPoolExecutor(
                min(_OPEN_THREADS, max(1, len(groups))), thread_name_prefix="fastload-parquet"
            ) as pool:
                found = set().union(
                    *pool.map(lambda fg: self._dictionary(fg[0], fg[1], name), groups)
                )
            found.discard(None)
            try:
                classes = sorted(found)
            except TypeError as e:
                raise DatasetError(
                    f"{self.store.url}: the values of label column {name!r} cannot be ordered "
                    f"({e}); name another label_column="
                ) from None
            return {"classes": np.array(classes)}

        keys = "\0".join(file.key for file in self.files)
        ident = hashlib.sha256(f"{name}\0{keys}".encode(*_ENCODING)).hexdigest()[:12]
        found = self.store.manifest.derived(f"parquet-classes-{ident}", make)
        return list(found["classes"].tolist())

    def _dictionary(self, f: int, g: int, name: str) -> set[Any]:
        """The values in the dictionary of column name's chunk in row group g of file f."""
        _, pq = _pyarrow()
        file = self.files[f]
        md = self.metadata(f)
        source = _RangeFile(self.store, file.key, file.size)
        rg = md.row_group(g)
        spans = [
            _chunk_span(rg.column(c))
            for c in range(rg.num_columns)
            if rg.column(c).path_in_schema == name
        ]
        source.prefetch(_coalesce(spans))
        try:
            column = (
                pq.ParquetFile(source, metadata=md)
                .read_row_group(g, columns=[name], use_threads=False)
                .column(name)
            )
            # Converting is reading too: a damaged dictionary can hold text that is not UTF-8.
            return {v for chunk in column.chunks for v in chunk.dictionary.to_pylist()}
        except Exception as e:
            raise DatasetError(
                f"{self.store.object_url(file.key)}: row group {g} cannot be read "
                f"({type(e).__name__}: {e}); the file is damaged: rewrite it"
            ) from e

    def metadata(self, f: int) -> Any:
        """pyarrow's ``FileMetaData`` of file f (its footer, read again from the cache in a
        process the dataset was pickled to)."""
        if self._metadata is None:
            with self._lock:
                if self._metadata is None:
                    self._metadata = [None] * len(self.files)
        md = self._metadata[f]
        if md is None:
            file = self.files[f]
            md = self._metadata[f] = _parse_footer(
                self.store, file.key, file.size, file.footer_length
            )
        return md


# --- opening -------------------------------------------------------------------------------


def _parquet_keys(store: CachedStore) -> list[str]:
    files = keys_ending(store, ".parquet")
    if not files:
        keys = store.object_keys()
        raise DatasetError(
            f"{store.url} holds no .parquet files ({len(keys)} objects, e.g. {keys[:3]}); "
            "pick another format= (files, imagefolder, tar, zarr)"
        )
    return files


def _size(store: CachedStore, key: str) -> int:
    size = store.object(key).size
    if size is None:
        raise DatasetError(
            f"{store.object_url(key)}: the listing gives no size, and a Parquet file is read "
            "from its end; serve it with its size (Content-Length)"
        )
    return size


def _read_footers(store: CachedStore, keys: list[str]) -> list[tuple[Any, int]]:
    """(FileMetaData, footer length) of each file, read as byte ranges on a few threads."""
    store.stager  # noqa: B018  # made once here, not by each thread
    if len(keys) == 1:
        return [_open_footer(store, keys[0])]
    with ThreadPoolExecutor(
        min(_OPEN_THREADS, len(keys)), thread_name_prefix="fastload-parquet"
    ) as pool:
        return list(pool.map(lambda k: _open_footer(store, k), keys))


def _open_footer(store: CachedStore, key: str) -> tuple[Any, int]:
    size = _size(store, key)
    url = store.object_url(key)
    if size < len(_MAGIC) + _TAIL:
        raise DatasetError(
            f"{url} has {size} bytes, too few for a Parquet file; it is truncated or not "
            "Parquet: rewrite it or remove it from the dataset"
        )
    tail = store.read_range(key, size - _TAIL, _TAIL)
    length, magic = struct.unpack("<I4s", tail)
    if magic != _MAGIC:
        what = (
            "is encrypted (PARE)"
            if magic == b"PARE"
            else f"does not end with the Parquet magic PAR1 (ends with {magic!r})"
        )
        raise DatasetError(
            f"{url} {what}; it is truncated or not a (plain) Parquet file: rewrite it or "
            "remove it from the dataset"
        )
    if length + _TAIL + len(_MAGIC) > size:
        raise DatasetError(
            f"{url}: its footer is {length} bytes long, more than the file's {size} bytes "
            "hold; the file is truncated or damaged: rewrite it"
        )
    return _parse_footer(store, key, size, length), length


def _parse_footer(store: CachedStore, key: str, size: int, length: int) -> Any:
    pa, pq = _pyarrow()
    url = store.object_url(key)
    footer = store.read_range(key, size - _TAIL - length, length)
    tail = struct.pack("<I", length) + _MAGIC
    try:  # the footer alone, framed as a file of its own: pyarrow parses only the footer
        md = pq.read_metadata(pa.BufferReader(_MAGIC + footer + tail))
        md.schema.to_arrow_schema()  # its names and types are sound (UTF-8, known types)
        _check_spans(url, md, size - _TAIL - length)
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(
            f"{url}: its footer cannot be parsed ({type(e).__name__}: {e}); the file is "
            "damaged: rewrite it"
        ) from e
    return md


def _check_spans(url: str, md: Any, data_end: int) -> None:
    """Row counts add up and every column chunk lies within the file's data."""
    rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    if any(n < 0 for n in rows) or sum(rows) != md.num_rows:
        raise DatasetError(
            f"{url}: its footer says {md.num_rows} rows, but its row groups hold {rows}; the "
            "file is damaged: rewrite it"
        )
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        if rg.num_rows and not rg.num_columns:
            raise DatasetError(
                f"{url}: row group {g} says {rg.num_rows} rows but holds no columns; the "
                "file is damaged: rewrite it"
            )
        for c in range(rg.num_columns):
            chunk = rg.column(c)
            start, end = _chunk_span(chunk)
            chunk.path_in_schema  # noqa: B018  # UTF-8 (a reader compares it): checked now
            if start < 0 or end < start or end > data_end:
                raise DatasetError(
                    f"{url}: row group {g} column {chunk.path_in_schema!r} ends at byte "
                    f"{end}, past the data ({data_end} bytes); the file is truncated or "
                    "damaged: rewrite it"
                )


def _chunk_span(chunk: Any) -> tuple[int, int]:
    """(start, end) of a column chunk's pages in its file (its dictionary page first)."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    return int(start), int(start + chunk.total_compressed_size)


def _coalesce(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, end) spans sorted and merged where they overlap or lie close."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + _MAX_GAP_BYTES:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


# --- columns -------------------------------------------------------------------------------


def pa_is_dictionary(kind: Any) -> bool:
    pa, _ = _pyarrow()
    return bool(pa.types.is_dictionary(kind))


def _require(store: CachedStore, key: str, schema: Any, name: str) -> None:
    if schema.get_field_index(name) < 0:
        raise DatasetError(
            f"{store.object_url(key)} has no column {name!r}; its columns are "
            f"{', '.join(schema.names)}: name one of them (columns=, image_column=, "
            "label_column=)"
        )


def _image_field(kind: Any) -> int | None:
    """The index of the binary ``bytes`` field of an image struct type, else None."""
    pa, _ = _pyarrow()
    if not pa.types.is_struct(kind):
        return None
    i = kind.get_field_index("bytes")
    if i < 0 or not _is_binary(kind.field(i).type):
        return None
    return int(i)


def _is_binary(kind: Any) -> bool:
    pa, _ = _pyarrow()
    return bool(
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(kind))
    )


def _detect_image(schema: Any, names: list[str]) -> str | None:
    for name in names:
        if _image_field(schema.field(name).type) is not None:
            return name
    for name in names:
        if name.lower() in IMAGE_NAMES and _is_binary(schema.field(name).type):
            return name
    return None


def _detect_label(schema: Any, names: list[str]) -> str | None:
    pa, _ = _pyarrow()
    for name in names:
        kind = schema.field(name).type
        if name.lower() in LABEL_NAMES and (
            pa.types.is_integer(kind) or pa.types.is_dictionary(kind)
        ):
            return name
    return None


def _check_image(store: CachedStore, key: str, schema: Any, name: str) -> None:
    kind = schema.field(name).type
    if _image_field(kind) is None and not _is_binary(kind):
        raise DatasetError(
            f"{store.object_url(key)}: column {name!r} is {kind}, not an image (binary, or a "
            "struct with a binary 'bytes' field); name the image column with image_column="
        )


# --- reading -------------------------------------------------------------------------------


class _RangeFile(StoreFile):
    """A Parquet file for pyarrow: reads within the spans fetched by :meth:`prefetch` come
    from them, others are ``store.read_range`` calls (cached as range entries, or cut from
    the whole file where it is cached)."""

    def __init__(self, store: CachedStore, key: str, size: int) -> None:
        super().__init__(store, key, size)
        self._spans: list[tuple[int, bytes]] = []

    def prefetch(self, spans: Sequence[tuple[int, int]]) -> None:
        self._spans = [(s, self._store.read_range(self._key, s, e - s)) for s, e in spans]
        for (start, end), (_, data) in zip(spans, self._spans, strict=True):
            if len(data) != end - start:
                raise DatasetError(
                    f"{self._store.object_url(self._key)}: read {len(data)} bytes at offset "
                    f"{start}, expected {end - start}; the file changed since the dataset was "
                    "opened: open it again with refresh=True"
                )

    def _fetch(self, offset: int, length: int) -> bytes:
        end = offset + length
        for at, data in self._spans:
            if at <= offset and end <= at + len(data):
                return data[offset - at : end - at]
        return self._store.read_range(self._key, offset, length)


__all__ = ["DEFAULT_ROW_GROUP_CACHE_BYTES", "DecodedRowGroups", "ParquetDataset"]
