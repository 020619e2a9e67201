"""The scale benchmark's data: the two synthetic buckets (computed, never stored), the
peers' scaled indexes, and the loopback S3 server that serves them."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastload.bench.scale.config import (
    FOLDER_BUCKET,
    PEER_BUCKETS,
    PEER_MODULES,
    TAR_BUCKET,
    ScaleBenchConfig,
)

_PAYLOADS = 8
# The small buckets each child opens first (bucket name + this).
WARMUP_SUFFIX = "-warmup"


def layouts(config: ScaleBenchConfig) -> dict[str, Any]:
    """The synthetic buckets by name: the two of the cases, and a small one of each
    format that children open first (``_warm_up``)."""
    from fastload.testing.synthetic import ImageFolderLayout, TarShardsLayout, random_payloads

    small = random_payloads(2, 1000, seed=2)
    return {
        f"{FOLDER_BUCKET}{WARMUP_SUFFIX}": ImageFolderLayout(objects=20, classes=2, payloads=small),
        f"{TAR_BUCKET}{WARMUP_SUFFIX}": TarShardsLayout(
            shards=2, samples_per_shard=10, payloads=small, shard_index=True
        ),
        FOLDER_BUCKET: ImageFolderLayout(
            objects=config.objects,
            classes=config.classes,
            payloads=random_payloads(_PAYLOADS, config.object_bytes),
        ),
        TAR_BUCKET: TarShardsLayout(
            shards=config.shards,
            samples_per_shard=config.shard_samples,
            payloads=random_payloads(_PAYLOADS, config.sample_bytes, seed=1),
            shard_index=True,
        ),
    }


def peer_indexes(root: Path, config: ScaleBenchConfig, python: str) -> dict[str, str]:
    """Writes each peer's ``index.json`` for the tar case's shards and samples into bucket
    folders under root (from the index its own writer makes for a few samples); returns the
    peers it could not write for, with the reason."""
    work = root.parent / "peer-template"
    script = (
        "import json, os, sys\n"
        "out, which = sys.argv[1], sys.argv[2]\n"
        "rows = [{'jpg': os.urandom(100), 'cls': i} for i in range(3)]\n"
        "if which == 'mosaicml-streaming':\n"
        "    import streaming\n"
        "    with streaming.MDSWriter(out=out, columns={'jpg': 'bytes', 'cls': 'int'}) as w:\n"
        "        for row in rows: w.write(row)\n"
        "else:\n"
        "    from litdata.streaming.writer import BinaryWriter\n"
        "    w = BinaryWriter(out, chunk_size=len(rows))\n"
        "    for i, row in enumerate(rows): w[i] = row\n"
        "    w.done(); w.merge()\n"
    )
    skipped = {}
    span = 3 * 512 + -(-config.sample_bytes // 512) * 512  # a tar sample's bytes, roughly
    for system, bucket in PEER_BUCKETS.items():
        out = work / bucket
        shutil.rmtree(out, ignore_errors=True)
        made = subprocess.run(
            [python, "-c", script, str(out), system],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if made.returncode != 0 or not (out / "index.json").exists():
            tail = (made.stderr.strip().splitlines() or ["no output"])[-1]
            skipped[system] = f"its writer failed: {tail[:200]}"
            continue
        template = json.loads((out / "index.json").read_text())
        bytes_per_shard = config.shard_samples * span
        for name, shards in ((bucket, config.shards), (f"{bucket}{WARMUP_SUFFIX}", 1)):
            index = _scaled_index(system, template, shards, config.shard_samples, bytes_per_shard)
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "index.json").write_text(json.dumps(index))
    return skipped


def _scaled_index(
    system: str, template: dict[str, Any], shards: int, samples: int, shard_bytes: int
) -> dict[str, Any]:
    """A peer's index.json for ``shards`` shards of ``samples`` samples each, every entry
    a copy of the first in ``template`` (what its writer made) with its name and counts."""
    index: dict[str, Any] = json.loads(json.dumps(template))
    if system == "mosaicml-streaming":
        first = index["shards"][0]
        index["shards"] = [
            {
                **first,
                "samples": samples,
                "raw_data": {
                    **first["raw_data"],
                    "basename": f"shard.{s:05d}.mds",
                    "bytes": shard_bytes,
                },
            }
            for s in range(shards)
        ]
    else:
        first = index["chunks"][0]
        index["chunks"] = [
            {
                **first,
                "chunk_bytes": shard_bytes,
                "chunk_size": samples,
                "filename": f"chunk-0-{s}.bin",
            }
            for s in range(shards)
        ]
        index["config"]["chunk_size"] = samples
    return index


def peers_python() -> tuple[str | None, dict[str, str]]:
    """The peers' Python and, per peer, why it is skipped (nothing when it imports)."""
    from fastload.bench.e2e.e2e_process import default_peers_python

    python = default_peers_python()
    if python is None:
        reason = "no .venv-peers (make bench-peers) and no $FASTLOAD_PEERS_PYTHON"
        return None, dict.fromkeys(PEER_MODULES, reason)
    return python, {}


@contextmanager
def serve_buckets(root: Path, config: ScaleBenchConfig) -> Iterator[Any]:
    from fastload.testing import RemoteBehavior
    from fastload.testing.s3_folder import S3FolderProcess

    with S3FolderProcess(
        root, synthetic=layouts(config), behavior=RemoteBehavior(latency_s=config.latency_s)
    ) as server:
        yield server
