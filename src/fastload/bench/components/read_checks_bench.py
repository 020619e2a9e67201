"""What checking cached entries' checksums on read costs a warm epoch (issue 29): the same
loader epoch with the checks and without them, alternated in one run on the same cached
data, for the worst case (raw bytes of whole files: no decode to hide the hashing), a
folder of JPEGs decoded on the CPU, and tar shards (members read in part of cached shards).

"Without" is the same dataset opened with ``verify_reads=False``; nothing else differs.
"""

from __future__ import annotations

import io
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastload as fl
from fastload.testing.synthetic import jpeg_payloads


@dataclass(frozen=True, kw_only=True)
class ReadChecksConfig:
    files: int = 4000
    distinct_jpegs: int = 64
    shards: int = 16
    rounds: int = 6
    batch_size: int = 128

    @classmethod
    def quick(cls) -> ReadChecksConfig:
        return cls(files=1000, shards=8, rounds=4)


def _folder(root: Path, config: ReadChecksConfig) -> None:
    payloads = jpeg_payloads(config.distinct_jpegs)
    for i in range(config.files):
        path = root / f"class{i % 10}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payloads[i % len(payloads)])


def _tars(root: Path, config: ReadChecksConfig) -> None:
    payloads = jpeg_payloads(config.distinct_jpegs)
    root.mkdir(parents=True, exist_ok=True)
    per_shard = config.files // config.shards
    for s in range(config.shards):
        with tarfile.open(root / f"shard-{s:04d}.tar", "w") as tar:
            for j in range(per_shard):
                for ext, data in (("jpg", payloads[(s + j) % len(payloads)]), ("cls", b"1")):
                    info = tarfile.TarInfo(f"{s:04d}-{j:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _epoch(ds: Any, decode: str | None, batch_size: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one epoch."""
    loader = fl.DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        decode=decode,
        collate_fn=None if decode else list,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in loader:
        pass
    return time.perf_counter() - wall, time.process_time() - cpu


def run(workdir: Path, config: ReadChecksConfig) -> list[dict[str, Any]]:
    """One row per case: the fastest warm epoch (wall and CPU seconds) with and without the
    checks, alternated (each round swaps which goes first). The fastest, not the median:
    on a shared machine an epoch is only ever slowed by others' work."""
    _folder(workdir / "folder", config)
    _tars(workdir / "tars", config)
    cases = [
        ("files, raw bytes", workdir / "folder", "files", None),
        ("imagefolder, CPU decode", workdir / "folder", "imagefolder", "cpu"),
        ("tar shards, raw bytes", workdir / "tars", "tar", None),
    ]
    rows = []
    for name, root, fmt, decode in cases:
        ds = fl.open_dataset(str(root), format=fmt, cache_dir=str(workdir / "cache"))
        trusting = fl.open_dataset(
            str(root), format=fmt, cache_dir=str(workdir / "cache"), verify_reads=False
        )
        _epoch(ds, decode, config.batch_size)  # fills the cache: every later epoch is warm
        on: list[tuple[float, float]] = []
        off: list[tuple[float, float]] = []
        for r in range(config.rounds):
            for checked in (True, False) if r % 2 == 0 else (False, True):
                if checked:
                    on.append(_epoch(ds, decode, config.batch_size))
                else:
                    off.append(_epoch(trusting, decode, config.batch_size))
        rows.append(
            {
                "case": name,
                "samples": len(ds),
                "checked_s": min(w for w, _ in on),
                "unchecked_s": min(w for w, _ in off),
                "ratio": min(w for w, _ in on) / min(w for w, _ in off),
                "checked_cpu_s": min(c for _, c in on),
                "unchecked_cpu_s": min(c for _, c in off),
                "cpu_ratio": min(c for _, c in on) / min(c for _, c in off),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':<24} {'samples':>7} {'wall on/off s':>15} {'ratio':>6}"
    lines = [head + f" {'CPU on/off s':>15} {'ratio':>6}"]
    lines += [
        f"{r['case']:<24} {r['samples']:>7} "
        f"{r['checked_s']:>7.3f}/{r['unchecked_s']:<7.3f} {r['ratio']:>6.3f} "
        f"{r['checked_cpu_s']:>7.3f}/{r['unchecked_cpu_s']:<7.3f} {r['cpu_ratio']:>6.3f}"
        for r in rows
    ]
    return "\n".join(lines)
