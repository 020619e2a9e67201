"""The end-to-end benchmark's dataset: the same generated JPEGs in four layouts.

JPEGs with natural-image-like content (:func:`natural_image`), 400-500 x 350-500 px,
quality 90, about 105 KB, in ``classes`` classes (sample ``i`` is in class ``i % classes``;
with ``images`` set, a copy of picture ``i % images`` in an object of its own)::

    folder/class_007/000107.jpg        ImageFolder
    tar/shard-00000.tar                WebDataset shards of ``shard_samples`` samples, in a
      000412.jpg  000412.cls             seeded shuffled order (:func:`tar_order`); .cls
      000031.jpg  000031.cls             holds the class index as text
    zarr/images  (N, 256, 256, 3) u1   Zarr v3: each JPEG decoded, shorter side resized to
    zarr/labels  (N,) int64              256, centre-cropped (:func:`zarr_pixels`), chunks of
                                         ``zarr_chunk_rows`` rows, zstd
    parquet/train-00000-of-00004.parquet  Parquet as the Hugging Face Hub stores images: an
      image struct {bytes, path}           ``image`` struct (the ``Image`` feature, named in
      label int64                          the schema's ``huggingface`` metadata) and a label,
                                           the tar order, ``parquet_files`` files of
                                           ``parquet_row_group_rows``-row row groups

fastload's Zarr reader takes fixed-size dtypes, so the Zarr layout holds pixels rather
than encoded bytes. :func:`generate` writes the first three once (images on every core)
and keeps them while the parameters match; :func:`with_parquet` adds the Parquet layout
(from the folder's files, in seconds) where a run asks for it, kept likewise.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import multiprocessing
import os
import shutil
import tarfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.resources import usable_cpus

GENERATOR_VERSION = 1  # bump when generated data changes, so old copies are rebuilt


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    samples: int = 3000
    classes: int = 100
    # Distinct pictures: sample i is a byte-for-byte copy of picture i % images in its own
    # object (None: every sample its own). A short run repeats a few pictures into epochs
    # long enough that fixed costs (worker start-up, the open) weigh as in a full run,
    # without the time to make more; a multiple of classes, so a copy keeps its label.
    images: int | None = None
    shard_samples: int = 64
    zarr_side: int = 256
    zarr_chunk_rows: int = 8
    parquet_files: int = 4
    parquet_row_group_rows: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "samples",
            "classes",
            "shard_samples",
            "zarr_side",
            "zarr_chunk_rows",
            "parquet_files",
            "parquet_row_group_rows",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.images is not None and not (
            0 < self.images <= self.samples and self.images % self.classes == 0
        ):
            raise ValueError(
                f"images must be a multiple of classes ({self.classes}) between 1 and "
                f"samples ({self.samples}), or None, got {self.images}"
            )


@dataclass(frozen=True)
class GeneratedData:
    root: Path
    samples: int
    classes: int
    folder: Path
    tar: Path
    zarr: Path | None  # None where zarr-python is not installed
    nbytes: dict[str, int]
    parquet: Path | None = None  # None until with_parquet (or where pyarrow is missing)

    def labels(self) -> list[int]:
        return [label_of(i, self.classes) for i in range(self.samples)]


def jpegs_line(config: DataConfig) -> str:
    """How many JPEGs a run reads, and from how many pictures where they repeat."""
    if config.images is None or config.images == config.samples:
        return f"{config.samples:,} JPEGs"
    return f"{config.samples:,} JPEGs ({config.images:,} pictures, each in several objects)"


def label_of(index: int, classes: int) -> int:
    return index % classes


def folder_key(index: int, classes: int) -> str:
    return f"class_{label_of(index, classes):03d}/{index:06d}.jpg"


def natural_image(rng: np.random.Generator, height: int, width: int) -> npt.NDArray[np.uint8]:
    """HWC uint8 content like ``decode_bench.natural_image`` (random fields at four scales,
    fine noise; ~0.5 bytes a pixel at quality 90), built coarse to fine with one full-size
    resize instead of four: about 5x faster, so a fresh ``--quick`` run stays short."""
    import torch
    import torch.nn.functional as F

    field_: torch.Tensor | None = None
    for cells, amp in ((4, 60.0), (16, 30.0), (64, 20.0), (160, 12.0)):
        grid = torch.from_numpy(rng.standard_normal((1, 3, cells, cells), dtype=np.float32))
        grid *= amp
        if field_ is not None:
            grid += F.interpolate(field_, size=(cells, cells), mode="bicubic", align_corners=False)
        field_ = grid
    assert field_ is not None
    img = F.interpolate(field_, size=(height, width), mode="bicubic", align_corners=False)[0]
    pixels = img.numpy() + 128.0
    pixels += 14.0 * rng.standard_normal((1, height, width), dtype=np.float32)
    pixels += (14.0 / 3) * rng.standard_normal((3, height, width), dtype=np.float32)
    return np.ascontiguousarray(np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def zarr_pixels(jpeg: bytes, side: int) -> npt.NDArray[np.uint8]:
    """The Zarr layout's row for a JPEG: decoded, shorter side resized to ``side``
    (bilinear), centre-cropped to ``side`` x ``side``."""
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as im:
        rgb = im.convert("RGB")
    w, h = rgb.size
    scale = side / min(w, h)
    new_w, new_h = max(side, round(w * scale)), max(side, round(h * scale))
    rgb = rgb.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = (new_w - side) // 2, (new_h - side) // 2
    return np.asarray(rgb.crop((left, top, left + side, top + side)), dtype=np.uint8)


def _make_images(
    folder: str, indices: Sequence[int], classes: int, zarr_side: int | None
) -> list[npt.NDArray[np.uint8] | None]:
    """Writes the JPEGs of ``indices``; returns their Zarr rows (None without Zarr)."""
    import torch
    from PIL import Image

    torch.set_num_threads(1)
    rows: list[npt.NDArray[np.uint8] | None] = []
    for i in indices:
        rng = np.random.default_rng([i, GENERATOR_VERSION])
        height, width = int(rng.integers(350, 501)), int(rng.integers(400, 501))
        buf = io.BytesIO()
        Image.fromarray(natural_image(rng, height, width)).save(buf, "JPEG", quality=90)
        path = Path(folder) / folder_key(i, classes)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
        rows.append(None if zarr_side is None else zarr_pixels(buf.getvalue(), zarr_side))
    return rows


def _zarr_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("zarr") is not None


def _images_params(config: DataConfig) -> dict[str, object]:
    """What the folder, tar and Zarr layouts depend on (not the Parquet one's settings, so
    changing those rewrites only the Parquet files)."""
    fields = {k: v for k, v in asdict(config).items() if not k.startswith("parquet_")}
    return {"version": GENERATOR_VERSION, **fields, "zarr": _zarr_available()}


def generate(root: Path, config: DataConfig) -> GeneratedData:
    """The folder, tar and Zarr layouts under ``root`` (kept when an earlier run made the
    same ones); :func:`with_parquet` adds the Parquet one."""
    params = _images_params(config)
    stamp = root / "params.json"
    folder, tars, zarr_dir = root / "folder", root / "tar", root / "zarr"
    if not (stamp.exists() and json.loads(stamp.read_text()) == params):
        shutil.rmtree(root, ignore_errors=True)
        folder.mkdir(parents=True)
        side = config.zarr_side if params["zarr"] else None
        rows = _images_in_parallel(folder, config, side)
        _write_tar_shards(tars, folder, config)
        if side is not None:
            _write_zarr(zarr_dir, rows, config)
        stamp.write_text(json.dumps(params))
    nbytes = {
        name: sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        for name, path in (("folder", folder), ("tar", tars), ("zarr", zarr_dir))
        if path.exists()
    }
    return GeneratedData(
        root=root,
        samples=config.samples,
        classes=config.classes,
        folder=folder,
        tar=tars,
        zarr=zarr_dir if params["zarr"] else None,
        nbytes=nbytes,
    )


def _images_in_parallel(
    folder: Path, config: DataConfig, side: int | None
) -> list[npt.NDArray[np.uint8] | None]:
    """Makes the distinct pictures, then copies them into the samples that repeat them."""
    distinct = config.images or config.samples
    made = _made_in_parallel(folder, config, distinct, side)
    for i in range(distinct, config.samples):
        shutil.copyfile(
            folder / folder_key(i % distinct, config.classes),
            folder / folder_key(i, config.classes),
        )
    return [made[i % distinct] for i in range(config.samples)]


def _made_in_parallel(
    folder: Path, config: DataConfig, count: int, side: int | None
) -> list[npt.NDArray[np.uint8] | None]:
    indices = list(range(count))
    procs = min(usable_cpus(), 8)
    if count < 200 or procs == 1:  # starting processes would cost more
        return _make_images(str(folder), indices, config.classes, side)
    parts = [indices[k::procs] for k in range(procs)]
    # forkserver: this process may hold threads (a fork would copy their locks).
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(procs, mp_context=context) as pool:
        done = list(
            pool.map(
                _make_images, [str(folder)] * procs, parts, [config.classes] * procs, [side] * procs
            )
        )
    rows: list[npt.NDArray[np.uint8] | None] = [None] * count
    for part, result in zip(parts, done, strict=True):
        for i, row in zip(part, result, strict=True):
            rows[i] = row
    return rows


def tar_order(config: DataConfig) -> list[int]:
    """Sample indices in the order the tar shards hold them (shuffled once, seeded, as
    WebDataset datasets are written so that each shard mixes classes)."""
    return [int(i) for i in np.random.default_rng(config.seed).permutation(config.samples)]


def _write_tar_shards(tars: Path, folder: Path, config: DataConfig) -> None:
    tars.mkdir(parents=True, exist_ok=True)
    order = tar_order(config)
    for shard, start in enumerate(range(0, len(order), config.shard_samples)):
        tmp = tars / f".shard-{shard:05d}.tar.tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in order[start : start + config.shard_samples]:
                image = (folder / folder_key(i, config.classes)).read_bytes()
                label = str(label_of(i, config.classes)).encode()
                for name, data in ((f"{i:06d}.jpg", image), (f"{i:06d}.cls", label)):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, tars / f"shard-{shard:05d}.tar")


def _write_zarr(
    path: Path, rows: Sequence[npt.NDArray[np.uint8] | None], config: DataConfig
) -> None:
    import zarr

    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    side = config.zarr_side
    images = group.create_array(
        "images",
        shape=(config.samples, side, side, 3),
        chunks=(config.zarr_chunk_rows, side, side, 3),
        dtype="uint8",
    )
    for start in range(0, config.samples, config.zarr_chunk_rows):
        block = rows[start : start + config.zarr_chunk_rows]
        images[start : start + len(block)] = np.stack([r for r in block if r is not None])
    labels = group.create_array(
        "labels", shape=(config.samples,), chunks=(config.samples,), dtype="int64"
    )
    labels[:] = np.array([label_of(i, config.classes) for i in range(config.samples)])


# --- Parquet ---------------------------------------------------------------------------------

# The Hugging Face ``Image`` and ``Value`` features, as the Hub's Parquet files name them in
# their schema's ``huggingface`` metadata (``datasets`` then knows the struct is an image).
HF_FEATURES = {
    "image": {"_type": "Image"},
    "label": {"dtype": "int64", "_type": "Value"},
}
PARQUET_VERSION = 1  # bump when the Parquet files change


def _pyarrow_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def with_parquet(data: GeneratedData, config: DataConfig) -> GeneratedData:
    """``data`` with its Parquet layout (``<root>/parquet``; written from the folder's files
    unless an earlier run wrote the same), or unchanged where pyarrow is not installed."""
    if not _pyarrow_available():
        return data
    out = data.root / "parquet"
    stamp = data.root / "parquet-params.json"
    params = {
        "version": PARQUET_VERSION,
        "images": _images_params(config),
        "files": config.parquet_files,
        "row_group_rows": config.parquet_row_group_rows,
    }
    if not (stamp.exists() and json.loads(stamp.read_text()) == params):
        stamp.unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        write_parquet(
            out,
            data.folder,
            tar_order(config),
            classes=config.classes,
            files=config.parquet_files,
            row_group_rows=config.parquet_row_group_rows,
        )
        stamp.write_text(json.dumps(params))
    nbytes = sum(p.stat().st_size for p in out.glob("*.parquet"))
    return replace(data, parquet=out, nbytes={**data.nbytes, "parquet": nbytes})


def write_parquet(
    out: Path,
    folder: Path,
    order: Sequence[int],
    *,
    classes: int,
    files: int,
    row_group_rows: int,
    prefix: str = "train",
) -> list[Path]:
    """The samples of ``order`` (their JPEGs in the ImageFolder ``folder``) as ``files``
    Parquet files ``<prefix>-00000-of-0000N.parquet`` in ``out``: an ``image`` struct
    ``{bytes, path}`` and an int64 ``label`` (:data:`HF_FEATURES`), ``row_group_rows`` rows
    per row group, pyarrow's default (snappy) compression. Returns the files written."""
    pa: Any = importlib.import_module("pyarrow")  # optional (the parquet extra); untyped here
    pq: Any = importlib.import_module("pyarrow.parquet")

    if not 0 < files <= max(1, len(order)):
        raise ValueError(f"files must be between 1 and the {len(order)} samples, got {files}")
    schema = pa.schema(
        [
            pa.field("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            pa.field("label", pa.int64()),
        ],
        metadata={"huggingface": json.dumps({"info": {"features": HF_FEATURES}})},
    )
    written = []
    for f, part in enumerate(np.array_split(np.asarray(order, dtype=np.int64), files)):
        keys = [folder_key(int(i), classes) for i in part]
        table = pa.table(
            {
                "image": [{"bytes": (folder / k).read_bytes(), "path": Path(k).name} for k in keys],
                "label": [label_of(int(i), classes) for i in part],
            },
            schema=schema,
        )
        path = out / f"{prefix}-{f:05d}-of-{files:05d}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, row_group_size=row_group_rows)
        os.replace(tmp, path)
        written.append(path)
    return written
