"""The GPU check's JPEGs: made once under ``DIR/data`` (like ``decode_bench``'s: 400-500 x
350-500 px, quality 90, ImageFolder layout) and kept."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
import torch

from fastload.bench.gpu.config import CLASSES, MAX_SIDE


def image_path(data_dir: Path, i: int) -> Path:
    return data_dir / f"class_{i % CLASSES:03d}" / f"{i:06d}.jpg"


def _make_jpeg(path: Path, i: int) -> None:
    from PIL import Image

    from fastload.bench.components.decode_bench import natural_image

    rng = np.random.default_rng([i, 105])  # decode_bench's recipe: the same image i
    height, width = int(rng.integers(350, MAX_SIDE + 1)), int(rng.integers(400, MAX_SIDE + 1))
    buf = io.BytesIO()
    Image.fromarray(natural_image(rng, height, width)).save(buf, "JPEG", quality=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def generate(data_dir: Path, count: int, threads: int) -> list[Path]:
    """``count`` JPEGs like ``decode_bench.generate``'s, made on ``threads`` threads (they
    scale: the work releases the GIL); files already there are kept."""
    paths = [image_path(data_dir, i) for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing:
        intra = torch.get_num_threads()
        torch.set_num_threads(1)  # the pool is the parallelism
        try:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: _make_jpeg(paths[i], i), missing))
        finally:
            torch.set_num_threads(intra)
    return paths
