from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fastload.reader import BatchReader, native_available


@pytest.fixture(params=["native", "python"])
def reader(request: pytest.FixtureRequest) -> Iterator[BatchReader]:
    """A reader of each backend; the native one must exist unless FASTLOAD_NATIVE=0 says not."""
    if request.param == "native" and not native_available():
        if os.environ.get("FASTLOAD_NATIVE") == "0":
            pytest.skip("native backend disabled by FASTLOAD_NATIVE=0")
        pytest.fail("the native extension did not load; see fastload.native_status()")
    with BatchReader(num_threads=4, backend=request.param) as r:
        yield r


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A 1 MiB file of random bytes (odd size, so blocks do not line up with its end)."""
    content = np.random.default_rng(0).integers(0, 256, (1 << 20) + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(content)
    return path, content
