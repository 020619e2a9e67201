"""Zarr metadata: a root's arrays (``.zarray``/``.zgroup`` for v2, ``zarr.json`` for v3)
parsed into :class:`~fastload.datasets.zarr.chunks.ZarrArray`, every value checked; an array
fastload's own reader refuses is handed to zarr-python
(:class:`~fastload.datasets.zarr.fallback.ZarrPythonArray`)."""

from __future__ import annotations

import base64
import importlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastload.datasets.base import DatasetError
from fastload.datasets.zarr.chunks import Array, ShardSpec, ZarrArray, _codec
from fastload.datasets.zarr.fallback import ZarrPythonArray
from fastload.store import CachedStore

# v3 core data types -> numpy kinds; the byte order comes from the "bytes" codec.
_V3_DTYPES = {
    "bool": "b1",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "complex64": "c8",
    "complex128": "c16",
}
# v3 bytes-to-bytes codecs -> numcodecs ids (blosc, gzip and zstd frames describe themselves,
# so their configuration is not needed to decode).
_V3_BYTES_CODECS = {"blosc": "blosc", "gzip": "gzip", "zstd": "zstd", "crc32c": "crc32c"}


class Unsupported(DatasetError):
    """What fastload's own reader does not read (zarr-python may): ``why`` in a few words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def open_root(
    store: CachedStore, existing: frozenset[str], arrays: Sequence[str] | str | None
) -> tuple[bool, dict[str, ZarrArray | ZarrPythonArray]]:
    """(is the root a group, its arrays by name in sample order)."""
    url = store.url
    root = _read_node(store, existing, "")
    if root is None:
        nested = sorted(
            k.rsplit("/", 1)[0]
            for k in existing
            if k.rsplit("/", 1)[-1] in (".zarray", ".zgroup", "zarr.json")
        )
        hint = (
            f"; Zarr metadata sits below it, e.g. in {nested[0]!r}: open {url}/{nested[0]}"
            if nested
            else "; expected the root of a Zarr v2 or v3 array or group"
        )
        raise DatasetError(f"{url} has no .zarray, .zgroup or zarr.json at its root{hint}")
    kind, meta = root
    if kind == "array":
        if arrays is not None:
            raise DatasetError(
                f"{url} is a single Zarr array, not a group; drop arrays={list(arrays)!r}"
            )
        found: dict[str, ZarrArray | ZarrPythonArray] = {"": _array(store, existing, "", meta)}
    else:
        names = [arrays] if isinstance(arrays, str) else arrays
        if names is None:
            names = _child_nodes(existing)
        found = {}
        for name in dict.fromkeys(n.strip("/") for n in names):
            node = _read_node(store, existing, name)
            if node is not None and node[0] == "array":
                found[name] = _array(store, existing, name, node[1])
            elif arrays is not None:
                raise DatasetError(
                    f"{url} has no array {name!r}; nodes directly in the group: "
                    f"{', '.join(_child_nodes(existing)) or 'none'}"
                )
        if not found:
            raise DatasetError(f"{url} is a Zarr group without arrays; expected at least one")
    for name, a in found.items():
        if len(a.shape) == 0 or a.shape[0] == 0:
            raise DatasetError(
                f"Zarr array {name or url!r} has shape {a.shape}: no rows to sample; "
                "expected at least one row along axis 0"
            )
    lengths = {name: a.shape[0] for name, a in found.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{n!r} has {rows}" for n, rows in lengths.items())
        raise DatasetError(
            f"the arrays of {url} must share their first axis (one row per sample): {listed} "
            "rows; pick arrays that line up with arrays=[...]"
        )
    return kind == "group", found


def _array(
    store: CachedStore, existing: frozenset[str], name: str, meta: dict[str, Any]
) -> ZarrArray | ZarrPythonArray:
    """fastload's own reader of the array, else zarr-python's where fastload's refuses it."""
    try:
        return _parse_array(store.url, name, meta)
    except Unsupported as e:
        try:
            importlib.import_module("zarr")
        except ImportError:
            raise DatasetError(
                f"{e}; zarr-python 3 reads it through fastload's cache: pip install zarr"
            ) from e
        try:
            return ZarrPythonArray(
                name=name,
                store=store,
                existing=existing,
                reason=f"{e.why} are not read by fastload's own reader",
            )
        except (ImportError, DatasetError):
            raise
        except Exception as z:  # zarr-python's own refusal: name the file, say what to do
            raise DatasetError(
                f"{e}; zarr-python cannot open it either ({type(z).__name__}: {z}): rewrite "
                "the array's metadata"
            ) from z


def _child_nodes(existing: frozenset[str]) -> list[str]:
    """Names of the arrays (and v3 groups) directly in the root group."""
    return sorted(
        k.rsplit("/", 1)[0]
        for k in existing
        if k.count("/") == 1 and k.endswith(("/.zarray", "/zarr.json"))
    )


def _read_node(
    store: CachedStore, existing: frozenset[str], path: str
) -> tuple[str, dict[str, Any]] | None:
    """("array" or "group", metadata) of the node at path, or None where there is none."""
    prefix = f"{path}/" if path else ""
    if prefix + "zarr.json" in existing:
        meta = _read_json(store, prefix + "zarr.json")
        kind = meta.get("node_type")
        if meta.get("zarr_format") != 3 or kind not in ("array", "group"):
            raise DatasetError(
                f"{store.url}/{prefix}zarr.json is not Zarr v3 metadata (zarr_format "
                f"{meta.get('zarr_format')!r}, node_type {kind!r}); expected zarr_format 3 and "
                "node_type 'array' or 'group'"
            )
        return kind, {**meta, "_prefix": prefix}
    if prefix + ".zarray" in existing:
        return "array", {**_read_json(store, prefix + ".zarray"), "_prefix": prefix}
    if prefix + ".zgroup" in existing:
        return "group", {}
    return None


def _read_json(store: CachedStore, key: str) -> dict[str, Any]:
    try:
        meta = json.loads(store.read(key))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{store.url}/{key} is not valid JSON ({e}); rewrite it") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{store.url}/{key} holds {type(meta).__name__}, expected an object")
    return meta


def _parse_array(url: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    where = f"{url}/{meta['_prefix']}{'zarr.json' if meta.get('zarr_format') == 3 else '.zarray'}"
    try:
        array = _parse_v3(where, name, meta) if meta.get("zarr_format") == 3 else None
        array = _parse_v2(where, name, meta) if array is None else array
        if array.chunk_nbytes > _MAX_CHUNK_BYTES:
            raise DatasetError(
                f"{where}: chunks {array.chunks} of {array.stored_dtype} take "
                f"{array.chunk_nbytes} bytes each, more than fastload decodes at once "
                f"({_MAX_CHUNK_BYTES}); rewrite the array with smaller chunks"
            )
        return array
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError) as e:
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"{where} is malformed ({type(e).__name__}: {e}); rewrite it") from e


# One decoded chunk (an inner chunk, for a sharded array) at most; a shape's axis at most.
_MAX_CHUNK_BYTES = 4 << 30
_MAX_EXTENT = 1 << 48


def _integers(where: str, what: str, values: Any) -> tuple[int, ...]:
    """A list of JSON integers (not floats, bools or strings: 1e9 is not a row count)."""
    if not isinstance(values, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise DatasetError(f"{where}: {what} is {values!r}, expected a list of integers")
    return tuple(values)


def _shape(where: str, shape: Any, chunks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, chunks = _integers(where, "shape", shape), _integers(where, "chunks", chunks)
    if any(not 0 <= s <= _MAX_EXTENT for s in shape) or any(
        not 0 < c <= _MAX_EXTENT for c in chunks
    ):
        raise DatasetError(
            f"{where}: shape {shape} and chunks {chunks} must be 0 to {_MAX_EXTENT} per axis "
            "(chunks above 0); rewrite the metadata"
        )
    if len(shape) != len(chunks):
        raise DatasetError(
            f"{where}: shape {shape} and chunks {chunks} do not fit; expected one chunk length "
            "> 0 per axis"
        )
    return shape, chunks


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _parse_v2(where: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    if meta.get("zarr_format") != 2:
        raise DatasetError(f"{where}: zarr_format {meta.get('zarr_format')!r}, expected 2")
    if not isinstance(meta["dtype"], str):
        raise Unsupported(
            f"{where}: structured dtype {meta['dtype']} is not read by fastload's own reader",
            "structured dtypes",
        )
    stored = np.dtype(meta["dtype"])
    if stored.hasobject:
        raise Unsupported(
            f"{where}: dtype {meta['dtype']!r} holds Python objects (variable-length strings); "
            "fastload's own reader reads fixed-size dtypes only",
            "variable-length strings",
        )
    shape, chunks = _shape(where, meta["shape"], meta["chunks"])
    order = meta.get("order", "C")
    if order not in ("C", "F"):
        raise DatasetError(f"{where}: order {order!r}, expected 'C' or 'F'")
    codecs = []
    if meta.get("compressor") is not None:
        codecs.append(meta["compressor"])
    codecs += reversed(meta.get("filters") or [])  # filters were applied before compressing
    separator = meta.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise DatasetError(f"{where}: dimension_separator {separator!r}, expected '.' or '/'")
    dtype = _native(stored)
    return ZarrArray(
        name=name,
        zarr_format=2,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        stored_dtype=stored,
        fill_value=_fill_v2(where, meta.get("fill_value"), dtype),
        codecs=_checked_codecs(where, codecs),
        order=order,
        key_prefix=meta["_prefix"],
        separator=separator,
    )


def _parse_v3(where: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    data_type = meta["data_type"]
    if not isinstance(data_type, str) or data_type not in _V3_DTYPES:
        kind = data_type.get("name") if isinstance(data_type, dict) else data_type
        why = (
            "variable-length strings"
            if kind in ("string", "variable_length_utf8")
            else "structured dtypes"
            if kind == "structured"
            else f"arrays of data_type {kind!r}"
        )
        raise Unsupported(
            f"{where}: data_type {data_type!r} is not read by fastload's own reader; it reads "
            f"{', '.join(_V3_DTYPES)}",
            why,
        )
    grid = meta["chunk_grid"]
    if grid.get("name") != "regular":
        raise Unsupported(
            f"{where}: chunk_grid {grid.get('name')!r}, fastload's own reader reads 'regular'",
            f"chunk grids {grid.get('name')!r}",
        )
    shape, chunks = _shape(where, meta["shape"], grid["configuration"]["chunk_shape"])
    if meta.get("storage_transformers"):
        raise Unsupported(
            f"{where}: storage transformers are not read by fastload's own reader",
            "storage transformers",
        )
    encoding = meta.get("chunk_key_encoding", {"name": "default"})
    separator = (encoding.get("configuration") or {}).get(
        "separator", "/" if encoding["name"] == "default" else "."
    )
    if separator not in (".", "/"):
        raise DatasetError(f"{where}: chunk key separator {separator!r}, expected '.' or '/'")
    if encoding["name"] == "default":
        key_prefix = meta["_prefix"] + "c" + separator
    elif encoding["name"] == "v2":
        key_prefix = meta["_prefix"]
    else:
        raise Unsupported(
            f"{where}: chunk_key_encoding {encoding['name']!r}, fastload's own reader reads "
            "'default' or 'v2'",
            f"chunk key encodings {encoding['name']!r}",
        )
    codecs = meta["codecs"]
    shard: ShardSpec | None = None
    if any(c["name"] == "sharding_indexed" for c in codecs):
        if len(codecs) != 1:
            raise Unsupported(
                f"{where}: codecs {[c['name'] for c in codecs]} around sharding_indexed; "
                "fastload's own reader reads sharding_indexed alone",
                "codecs around sharding_indexed",
            )
        config = codecs[0]["configuration"]
        inner = _shape(where, shape, config["chunk_shape"])[1]
        if any(s % c for s, c in zip(chunks, inner, strict=True)):
            raise DatasetError(
                f"{where}: shards {chunks} are not a whole number of inner chunks {inner}; "
                "rewrite the metadata"
            )
        shard = _shard_spec(where, chunks, inner, config)
        chunks, codecs = inner, config["codecs"]
    permutation, endian, after_bytes = _v3_chain(where, codecs, len(shape))
    stored = np.dtype(("<" if endian == "little" else ">") + _V3_DTYPES[data_type])
    dtype = _native(stored)
    return ZarrArray(
        name=name,
        zarr_format=3,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        stored_dtype=stored,
        fill_value=_fill_v3(where, meta.get("fill_value"), dtype),
        codecs=_checked_codecs(where, list(reversed(after_bytes))),
        permutation=permutation,
        key_prefix=key_prefix,
        separator=separator,
        shard=shard,
    )


def _v3_chain(
    where: str, codecs: list[dict[str, Any]], ndim: int
) -> tuple[tuple[int, ...] | None, str, list[dict[str, Any]]]:
    """(transpose permutation, bytes endian, numcodecs configs in encoding order) of a v3
    codec chain (an array's, or the inner chunks' of a shard)."""
    permutation: tuple[int, ...] | None = None
    endian: str | None = None
    after_bytes: list[dict[str, Any]] = []
    for codec in codecs:
        codec_name, config = codec["name"], codec.get("configuration") or {}
        if endian is None and codec_name == "transpose":
            order = config["order"]
            step = (
                tuple(range(ndim))
                if order == "C"
                else tuple(reversed(range(ndim)))
                if order == "F"
                else tuple(int(i) for i in order)
            )
            if sorted(step) != list(range(ndim)):
                raise DatasetError(f"{where}: transpose order {order!r} is not a permutation")
            permutation = step if permutation is None else tuple(permutation[i] for i in step)
        elif endian is None and codec_name == "bytes":
            endian = config.get("endian", "little")
        elif endian is not None and codec_name in _V3_BYTES_CODECS:
            after_bytes.append({"id": _V3_BYTES_CODECS[codec_name]})
        elif endian is not None and codec_name.startswith("numcodecs."):
            after_bytes.append({**config, "id": codec_name.removeprefix("numcodecs.")})
        else:
            raise Unsupported(
                f"{where}: codec {codec_name!r} is not read by fastload's own reader; it reads "
                "[transpose], bytes, then blosc/gzip/zstd/crc32c/numcodecs.* compressors "
                "(sharded or not)",
                f"arrays with codec {codec_name!r}",
            )
    if endian is None:
        raise DatasetError(f"{where}: no 'bytes' codec; expected one to turn chunks into bytes")
    if endian not in ("little", "big"):
        raise DatasetError(f"{where}: bytes endian {endian!r}, expected 'little' or 'big'")
    return permutation, endian, after_bytes


def _shard_spec(
    where: str, shards: tuple[int, ...], inner: tuple[int, ...], config: dict[str, Any]
) -> ShardSpec:
    location = config.get("index_location", "end")
    if location not in ("start", "end"):
        raise DatasetError(f"{where}: index_location {location!r}, expected 'start' or 'end'")
    names = [c["name"] for c in config.get("index_codecs") or []]
    if names not in (["bytes"], ["bytes", "crc32c"]):
        raise Unsupported(
            f"{where}: shard index codecs {names}; fastload's own reader reads bytes, then "
            "an optional crc32c",
            f"shard index codecs {names}",
        )
    endian = (config["index_codecs"][0].get("configuration") or {}).get("endian", "little")
    if endian not in ("little", "big"):
        raise DatasetError(f"{where}: index bytes endian {endian!r}, expected 'little' or 'big'")
    if names[-1] == "crc32c":
        _checked_codecs(where, [{"id": "crc32c"}])  # google-crc32c is there, or say so now
    return ShardSpec(
        shape=shards,
        per_shard=tuple(s // c for s, c in zip(shards, inner, strict=True)),
        index_at_start=location == "start",
        index_dtype=np.dtype("<u8" if endian == "little" else ">u8"),
        index_crc32c=names[-1] == "crc32c",
    )


def _checked_codecs(where: str, configs: list[dict[str, Any]]) -> tuple[str, ...]:
    """Codec configs as JSON, each made once now so an unknown one fails at open."""
    out = tuple(json.dumps(c, sort_keys=True) for c in configs)
    for c in out:
        try:
            _codec(c)
        except ImportError:
            raise
        except Exception as e:
            raise Unsupported(
                f"{where}: numcodecs cannot make codec {json.loads(c)} ({e}); upgrade "
                "numcodecs or register the codec",
                f"arrays with codec {json.loads(c).get('id')!r}",
            ) from e
    return out


_FLOAT_WORDS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float(value: Any, itemsize: int) -> Any:
    if isinstance(value, str) and value.startswith("0x"):  # v3: the float's bits in hex
        return np.array(int(value, 16), dtype=f"u{itemsize}").view(f"f{itemsize}")[()]
    if isinstance(value, str):
        return _FLOAT_WORDS[value]
    return float(value)


def _scalar(value: Any, dtype: np.dtype[Any]) -> Array:
    if dtype.kind == "f":
        value = _float(value, dtype.itemsize)
    elif dtype.kind == "c":
        re, im = value if isinstance(value, list) else (value, 0)
        value = complex(_float(re, dtype.itemsize // 2), _float(im, dtype.itemsize // 2))
    return np.array(value, dtype=dtype)


def _fill_v2(where: str, value: Any, dtype: np.dtype[Any]) -> Array:
    try:
        if value is None:
            return np.zeros((), dtype=dtype)  # undefined in v2; zarr-python reads zeros too
        if dtype.kind in "SV":
            return np.frombuffer(base64.b64decode(value), dtype=dtype).reshape(())
        if dtype.kind in "mM":
            return np.array(int(value), dtype="i8").view(dtype)
        return _scalar(value, dtype)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{where}: fill_value {value!r} does not fit dtype {dtype}") from e


def _fill_v3(where: str, value: Any, dtype: np.dtype[Any]) -> Array:
    try:
        return _scalar(value, dtype)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{where}: fill_value {value!r} does not fit {dtype}") from e
