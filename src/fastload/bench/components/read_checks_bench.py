"""What checking cached entries' checksums on read costs a warm epoch (issue 29): the same
loader epoch with the checks and without them, alternated in one run on the same cached
data, for the worst case (raw bytes of whole files: no decode to hide the hashing), a
folder of JPEGs decoded on the CPU, and tar shards (members read in part of cached shards).

"Without" replaces the checks in this process (``EntryChecks`` and the store's once-per-
process check); nothing else differs between the two.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastload as fl
from fastload.cache.read_checks import ReadChecks
from fastload.loader import batches
from fastload.loader.entry_checks import EntryChecks
from fastload.testing.synthetic import jpeg_payloads


@dataclass(frozen=True, kw_only=True)
class ReadChecksConfig:
    files: int = 4000
    distinct_jpegs: int = 64
    shards: int = 16
    rounds: int = 3
    batch_size: int = 128

    @classmethod
    def quick(cls) -> ReadChecksConfig:
        return cls(files=1000, shards=8, rounds=3)


class _NoChecks(EntryChecks):
    def add(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    whole = ReadChecks.whole_entry_holds
    setattr(batches, "EntryChecks", _NoChecks)  # noqa: B010 (a module's name, replaced)
    ReadChecks.whole_entry_holds = lambda self, location: True  # type: ignore[method-assign]
    try:
        yield
    finally:
        setattr(batches, "EntryChecks", EntryChecks)  # noqa: B010
        ReadChecks.whole_entry_holds = whole  # type: ignore[method-assign]


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


def _epoch_s(ds: Any, decode: str | None, batch_size: int) -> float:
    loader = fl.DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        decode=decode,
        collate_fn=None if decode else list,
    )
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def run(workdir: Path, config: ReadChecksConfig) -> list[dict[str, Any]]:
    """One row per case: median warm-epoch seconds with and without the checks."""
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
        _epoch_s(ds, decode, config.batch_size)  # fills the cache: every later epoch is warm
        on, off = [], []
        for _ in range(config.rounds):
            on.append(_epoch_s(ds, decode, config.batch_size))
            with checks_off():
                off.append(_epoch_s(ds, decode, config.batch_size))
        rows.append(
            {
                "case": name,
                "samples": len(ds),
                "checked_s": statistics.median(on),
                "unchecked_s": statistics.median(off),
                "ratio": statistics.median(on) / statistics.median(off),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<26} {'samples':>7} {'checked s':>10} {'unchecked s':>12} {'ratio':>6}"]
    lines += [
        f"{r['case']:<26} {r['samples']:>7} {r['checked_s']:>10.3f} "
        f"{r['unchecked_s']:>12.3f} {r['ratio']:>6.3f}"
        for r in rows
    ]
    return "\n".join(lines)
