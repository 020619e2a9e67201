"""An ImageFolder of small random JPEGs, for tests that need a real folder dataset."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def jpeg_folder(root: Path, count: int = 16, *, size: int = 64, class_name: str = "class") -> Path:
    """count images of size x size pixels in two class folders, class_name_0 and _1."""
    rng = np.random.default_rng(0)
    for i in range(count):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
        path = root / f"{class_name}_{i % 2}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root
