"""What an installed fastload must do on a Python it supports, run by scripts/check-wheel in
a fresh venv: import (no compiler, from the wheel), the native reader and the native JPEG
transform loaded (libjpeg-turbo from the wheel's own copy), a warm of a generated folder, an
epoch of the plan resumed mid-way, and, where torch is installed (scripts/check-wheel installs
it on every Python unless told not to), one ``fl.DataLoader`` epoch through the native decode
with ``state_dict()`` mid-epoch and ``load_state_dict()`` into a new loader: the batches and
their pixels are the uninterrupted epoch's, and ``len()`` is still the whole epoch's.

    python scripts/wheel-smoke.py      (prints one line per check; exits non-zero on a failure)
"""

from __future__ import annotations

import importlib.util
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

import fastload as fl
from fastload.decode.native_jpeg import jpeg_transform, native_jpeg_status
from fastload.plan import Plan


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def jpegs(root: Path, count: int = 24) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        path = root / f"class_{i % 3}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
        out.append(buf.getvalue())
    return out


def bundled_libjpeg() -> str | None:
    """The libjpeg this process mapped (the wheel's copy lives in fastload.libs/)."""
    maps = Path("/proc/self/maps").read_text()
    return next((line.split()[-1] for line in maps.splitlines() if "libjpeg" in line), None)


def main() -> None:
    print(f"python {sys.version.split()[0]}, fastload from {Path(fl.__file__).parent}")
    check(fl.native_available(), f"native reader: {fl.native_status()}")
    check(native_jpeg_status() == "loaded", f"native JPEG transform: {native_jpeg_status()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = jpegs(root / "data")
        report = fl.warm(str(root / "data"), cache_dir=str(root / "cache"), progress=False)
        check(report.ok, f"warm of a local folder: {len(images)} objects")

        transform = jpeg_transform(2)
        sizes = transform.sizes(images)
        check(bool((sizes == [48, 64]).all()), "native JPEG headers read")
        boxes = np.array([[1, 0, 48, 0, 64, 0]] * len(images), dtype=np.int32)
        out = np.empty((len(images), 3, 32, 32), dtype=np.float32)
        failed = transform.run(images, boxes, out, 32, 32, False, [0.0] * 3, [1.0] * 3)
        check(not failed and out.min() >= 0 and out.max() <= 255, "native JPEG batch decode")
        library = bundled_libjpeg()
        where = "the wheel's" if library and "fastload.libs" in library else "the system's"
        print(f"     libjpeg: {library} ({where})")

        plan = Plan([1] * len(images), seed=1, shuffle=True)
        whole = plan.rank_order(0, world_size=1, rank=0).tolist()
        state = plan.resume_state(0).then(1, 10)
        rest = plan.rank_order(0, world_size=1, rank=0, resume=state).tolist()
        check(whole[10:] == rest, "an epoch of the plan resumed after 10 samples")

        if importlib.util.find_spec("torch") is None:
            print("     (no torch here (WHEEL_TORCH=no): the loader's epoch is not checked)")
            return
        from fastload.decode import TrainPreset

        def loader() -> fl.DataLoader:
            return fl.DataLoader(
                str(root / "data"), batch_size=4, shuffle=True, decode="cpu",
                transform=TrainPreset(32), cache_dir=str(root / "cache"),
            )  # fmt: skip

        whole_loader = loader()
        whole_batches = [images.clone() for images, _ in whole_loader]
        whole_loader.close()
        first = loader()
        it = iter(first)
        taken = [next(it)[0].clone() for _ in range(2)]
        state_dict = first.state_dict()
        second = loader()
        second.load_state_dict(state_dict)
        check(len(second) == len(whole_batches), f"len() after the resume: {len(second)}")
        rest_batches = [images.clone() for images, _ in second]
        same = all(a.equal(b) for a, b in zip(taken + rest_batches, whole_batches, strict=True))
        check(same, f"a loader epoch ({len(whole_batches)} batches) resumed after 2, exact")
        check(first.stats()["path"] == "fastload", "the loader's fast path")
        first.close()
        second.close()


if __name__ == "__main__":
    main()
