"""A source install without libjpeg-turbo's headers builds without ``fastload._native_jpeg``:
it still decodes (the Python path) and says so once, at the first decode that could have used
the native transform, naming how to get it. A real interpreter whose import of the module
fails as it does in such an install."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import sys
sys.modules["fastload._native_jpeg"] = None  # as in a build without libjpeg: not there
import io
import numpy as np
from PIL import Image
from fastload.decode import DecodeConfig, TrainPreset
from fastload.decode.cpu import CPUDecoder
buf = io.BytesIO()
Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(buf, "JPEG")
for _ in range(2):  # two decoders, two batches each: one warning in all
    decoder = CPUDecoder(DecodeConfig(transform=TrainPreset(16), num_threads=1))
    for _ in range(2):
        batch = decoder.decode([buf.getvalue()] * 2, indices=[0, 1])
        assert tuple(batch.images.shape) == (2, 3, 16, 16)
    decoder.close()
print("decoded")
"""


def run(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_NATIVE")}
    return subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=120,
        check=False,
    )


def test_a_build_without_libjpeg_decodes_and_warns_once_how_to_get_the_native_path() -> None:
    done = run()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "decoded"
    assert done.stderr.count("native JPEG transform is missing") == 1, done.stderr
    assert "built without libjpeg-turbo" in done.stderr
    assert "wheel" in done.stderr


def test_turning_it_off_on_purpose_says_nothing() -> None:
    done = run(FASTLOAD_NATIVE_JPEG="0")
    assert done.returncode == 0, done.stderr
    assert "missing" not in done.stderr
