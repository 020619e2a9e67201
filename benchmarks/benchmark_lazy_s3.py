"""Cold start of an s3:// dataset served by obstore (#32): wall time from a fresh
interpreter to its first batch, and the import time of s3fs/aiobotocore/botocore in it
(``python -X importtime``), for two fastload source trees in one run, alternated.

Command (~1 min on a 2-core VM)::

    .venv/bin/python benchmarks/benchmark_lazy_s3.py --before /work/main/src --after src

Each run opens a 300-object folder on a loopback S3 server (its own process) with a fresh
cache and no FetchConfig (the default staging process), and takes one batch of 32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

from fastload.staging.lifetime import env_for_child
from fastload.testing import S3Server

_CHILD = textwrap.dedent(
    """
    import time
    start = time.perf_counter()
    import json, sys
    import fastload as fl
    ds = fl.open_dataset(sys.argv[1], format="files", cache_dir=sys.argv[2],
                         storage_options=json.loads(sys.argv[3]))
    with fl.DataLoader(ds, batch_size=32, shuffle=True, collate_fn=list) as dl:
        next(iter(dl))
    print(json.dumps({"first_batch_s": time.perf_counter() - start}), flush=True)
    """
)
_HEAVY = ("s3fs", "aiobotocore", "botocore")


def one(src: str, options: dict[str, object], cache: str) -> tuple[float, float]:
    """(seconds to the first batch, seconds importing s3fs/aiobotocore/botocore)."""
    env = env_for_child({**os.environ, "PYTHONPATH": os.path.abspath(src)})
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _CHILD, "s3://data/ds", cache,
         json.dumps(options)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    heavy_us = 0
    enclosing: list[tuple[int, bool]] = []  # (depth, heavy or below a heavy one)
    # Parents are printed after their children: read upwards, count the outermost only.
    for line in reversed(done.stderr.splitlines()):  # "import time: self | cumul | name"
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = line.split("|")
        if not cumulative.strip().isdigit():
            continue  # the header
        depth = len(name) - len(name.lstrip())
        while enclosing and enclosing[-1][0] >= depth:
            enclosing.pop()
        below = any(heavy for _, heavy in enclosing)
        heavy = name.strip().split(".")[0] in _HEAVY
        if heavy and not below:
            heavy_us += int(cumulative)
        enclosing.append((depth, heavy or below))
    first = json.loads(done.stdout.strip().splitlines()[-1])["first_batch_s"]
    return first, heavy_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a fastload src tree (e.g. main's)")
    parser.add_argument("--after", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, S3Server() as server:
        source = Path(tmp) / "ds"
        for i in range(300):
            path = source / f"class_{i % 3}" / f"{i:04d}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes())
        server.upload_dir(source, "data", prefix="ds")
        results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for r in range(args.repeats):
            for name in ("before", "after"):
                cache = str(Path(tmp) / f"cache-{name}-{r}")
                results[name].append(one(getattr(args, name), server.storage_options, cache))
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    for name, runs in results.items():
        firsts, heavies = zip(*runs, strict=True)
        print(
            f"{name}: first batch median {statistics.median(firsts):.2f} s "
            f"(runs {', '.join(f'{f:.2f}' for f in firsts)}); s3fs/aiobotocore/botocore "
            f"imports median {statistics.median(heavies):.3f} s"
        )


if __name__ == "__main__":
    main()
