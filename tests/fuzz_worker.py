"""The fuzz suite's worker (tests/test_fuzz.py): parses one example per line of stdin, each
a folder holding the files of one target, and answers one JSON line: what it read, or the
error it raised. Run under an address-space limit by the test; one process parses many
examples, and is started again when an example kills it."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Any

_SAMPLES = 40  # read at most this many samples of a dataset (the first and the last ones)


def _indices(n: int) -> list[int]:
    return sorted({*range(min(n, _SAMPLES // 2)), *range(max(0, n - _SAMPLES // 2), n)})


def _digest(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return zlib.crc32(bytes(value))
    if isinstance(value, dict):
        return {str(k): _digest(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_digest(v) for v in value]
    if hasattr(value, "tobytes"):  # a numpy array or scalar
        return [list(getattr(value, "shape", ())), zlib.crc32(value.tobytes())]
    return value


def dataset(root: Path, cache: Path, fmt: str) -> Any:
    from fastload.datasets import open_dataset

    ds = open_dataset(str(root), format=fmt, cache_dir=str(cache))
    return [len(ds), [_digest(ds[i]) for i in _indices(len(ds))]]


def manifest(root: Path, cache: Path, fmt: str) -> Any:
    from fastload.manifest import Manifest

    m = Manifest.load(root / "m.flm")
    keys = m.keys()
    found = m.indices_of(keys[:_SAMPLES]).tolist()
    return [
        len(m),
        zlib.crc32("\0".join(keys).encode("utf-8", "surrogatepass")),
        [m.size(i) for i in range(len(m))][:_SAMPLES],
        [m.version(i) for i in range(len(m))][:_SAMPLES],
        found,
    ]


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        parse = manifest if request["format"] == "flm" else dataset
        try:
            answer: dict[str, Any] = {
                "ok": parse(Path(request["dir"]), Path(request["cache"]), request["format"])
            }
        except Exception as e:  # every error is reported: the test judges its kind
            answer = {
                "error": type(e).__name__,
                "kinds": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
            }
        sys.stdout.write(json.dumps(answer, default=repr) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
