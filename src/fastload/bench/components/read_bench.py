"""Reading cached bytes: the native reader against the ways Python code reads files today.

Two cases, both from the page cache (every system gets an untimed warm-up pass):

* one large file read in fixed blocks into one destination buffer;
* many small files (the size of an encoded ImageNet JPEG) read a batch at a time into a
  reused batch buffer, as a loader does.

Systems: ``cat`` to /dev/null (the ceiling: no Python, no copy out of the kernel's buffer
into ours is skipped either), fastload's native reader, fastload's pure-Python fallback
(``os.preadv`` on threads), and a plain ``readinto`` loop. Ratios are to ``cat``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fastload.bench.runner import Measurement, Report, measure, relate
from fastload.reader import BatchReader, aligned_empty

CEILING = "cat > /dev/null"


@dataclass(frozen=True, kw_only=True)
class ReadBenchConfig:
    large_file_bytes: int = 1 << 30
    block_bytes: int = 4 << 20
    small_files: int = 20_000
    small_file_bytes: int = 100_000
    batch_files: int = 256
    repeats: int = 3
    num_threads: int | None = None  # None: the reader's default

    def __post_init__(self) -> None:
        for name in (
            "large_file_bytes",
            "block_bytes",
            "small_files",
            "small_file_bytes",
            "batch_files",
            "repeats",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def quick(cls) -> ReadBenchConfig:
        return cls(large_file_bytes=256 << 20, small_files=2_000)


def generate(data_dir: Path, config: ReadBenchConfig) -> tuple[Path, list[Path]]:
    """Random-content files (incompressible, like JPEGs); existing ones of the right size stay."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    large = data_dir / "large.bin"
    if not large.exists() or large.stat().st_size != config.large_file_bytes:
        with open(large, "wb") as f:
            for start in range(0, config.large_file_bytes, 64 << 20):
                n = min(64 << 20, config.large_file_bytes - start)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    small_dir = data_dir / "small"
    small_dir.mkdir(exist_ok=True)
    small = [small_dir / f"{i:06d}.bin" for i in range(config.small_files)]
    for path in small:
        if not path.exists() or path.stat().st_size != config.small_file_bytes:
            path.write_bytes(
                rng.integers(0, 256, config.small_file_bytes, dtype=np.uint8).tobytes()
            )
    return large, small


def _cat(paths: Sequence[Path]) -> None:
    for start in range(0, len(paths), 1000):  # stay well under ARG_MAX
        subprocess.run(
            ["cat", *map(str, paths[start : start + 1000])],
            stdout=subprocess.DEVNULL,
            check=True,
            timeout=600,
        )


def _readinto_blocks(path: Path, dest: npt.NDArray[np.uint8], block: int) -> None:
    view = memoryview(dest.data)
    with open(path, "rb", buffering=0) as f:
        for at in range(0, len(view), block):
            f.readinto(view[at : at + block])


def _readinto_files(
    paths: Sequence[Path], dest: npt.NDArray[np.uint8], size: int, batch: int
) -> None:
    view = memoryview(dest.data)
    for start in range(0, len(paths), batch):
        for slot, path in enumerate(paths[start : start + batch]):
            with open(path, "rb", buffering=0) as f:
                f.readinto(view[slot * size : (slot + 1) * size])


def _reader_blocks(
    reader: BatchReader, path: Path, dest: npt.NDArray[np.uint8], block: int
) -> None:
    reader.read(
        [(path, at, min(block, len(dest) - at), dest, at) for at in range(0, len(dest), block)],
        exact=True,
    )


def _reader_files(
    reader: BatchReader, paths: Sequence[Path], dest: npt.NDArray[np.uint8], size: int, batch: int
) -> None:
    for start in range(0, len(paths), batch):
        reader.read(
            [
                (p, 0, size, dest, slot * size)
                for slot, p in enumerate(paths[start : start + batch])
            ],
            exact=True,
        )


def run(data_dir: str | os.PathLike[str], config: ReadBenchConfig | None = None) -> Report:
    config = config or ReadBenchConfig()
    large, small = generate(Path(data_dir), config)
    report = Report(name="read", params={**config.__dict__, "data_dir": str(data_dir)})
    big_dest = aligned_empty(config.large_file_bytes)
    batch_dest = aligned_empty(config.batch_files * config.small_file_bytes)
    size, batch, block = config.small_file_bytes, config.batch_files, config.block_bytes
    large_case = f"1 file of {config.large_file_bytes >> 20} MiB in {block >> 20} MiB blocks"
    small_case = f"{len(small):,} files of {size // 1000} KB, {batch} per batch"
    rows: list[Measurement] = []

    def add(
        case: str, system: str, fn: Callable[[], object], items: int, nbytes: int, note: str = ""
    ) -> None:
        rows.append(
            measure(
                fn,
                benchmark="read",
                case=case,
                system=system,
                items=items,
                nbytes=nbytes,
                repeats=config.repeats,
                note=note,
            )
        )

    with (
        BatchReader(num_threads=config.num_threads, backend="python") as py_reader,
        BatchReader(num_threads=config.num_threads) as reader,
    ):
        systems_large = {
            CEILING: lambda: _cat([large]),
            f"fastload {reader.backend} reader": lambda: _reader_blocks(
                reader, large, big_dest, block
            ),
            "os.preadv threads (fastload fallback)": lambda: _reader_blocks(
                py_reader, large, big_dest, block
            ),
            "Python readinto loop": lambda: _readinto_blocks(large, big_dest, block),
        }
        n_blocks = -(-config.large_file_bytes // block)
        for system, fn in systems_large.items():
            add(large_case, system, fn, n_blocks, config.large_file_bytes)
        systems_small = {
            CEILING: lambda: _cat(small),
            f"fastload {reader.backend} reader": lambda: _reader_files(
                reader, small, batch_dest, size, batch
            ),
            "os.preadv threads (fastload fallback)": lambda: _reader_files(
                py_reader, small, batch_dest, size, batch
            ),
            "Python readinto loop": lambda: _readinto_files(small, batch_dest, size, batch),
        }
        for system, fn in systems_small.items():
            # cat maps a fresh buffer per file, so its page faults dominate small files.
            note = "fresh buffer per file" if system == CEILING else ""
            add(small_case, system, fn, len(small), len(small) * size, note)
    report.rows = relate(rows, CEILING)
    return report
