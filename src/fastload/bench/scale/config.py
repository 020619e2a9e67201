"""The scale benchmark's settings (:class:`ScaleBenchConfig`), the names of its buckets and
cases, and P11's bounds, shared by its parts."""

from __future__ import annotations

from dataclasses import dataclass

FOLDER_BUCKET = "imagenet"
TAR_BUCKET = "shards"
PEER_BUCKETS = {"mosaicml-streaming": "mds", "litdata": "litdata"}
PEER_MODULES = {"mosaicml-streaming": "streaming", "litdata": "litdata"}
PLAN_PEER = "torch DistributedSampler"
FIRST_OPEN = "fastload first open (empty cache)"
CACHED_OPEN = "fastload cached open (fresh process)"
FIRST_BATCH = "fastload first batch after a cached open"
WORKERS = "torch DataLoader workers (spawn)"
NODE_SHARE = "fastload warm of a node's share"
# P11's bounds.
TARGET_FIRST_OPEN_S = 10.0
TARGET_CPU_US_PER_OBJECT = 5.0
TARGET_CACHED_OPEN_S = 0.5
TARGET_USS_PER_SAMPLE = 100.0
TARGET_PICKLED_BYTES = 1 << 20
TARGET_FIRST_BATCH_S = 1.0
TARGET_PLAN_S = 0.1


@dataclass(frozen=True, kw_only=True)
class ScaleBenchConfig:
    objects: int = 1_281_167
    classes: int = 1000
    object_bytes: int = 110_000
    shards: int = 1024
    shard_samples: int = 1250
    sample_bytes: int = 52_000
    latency_s: float = 0.02
    # Processes of the node cases (0 leaves them out).
    processes: int = 8
    # The node share: ranks 0..ranks_per_node-1 of node_share * ranks_per_node.
    node_share: int = 16
    ranks_per_node: int = 8
    world_size: int = 8  # of the plan case
    batch_size: int = 64
    workers: int = 2
    repeats: int = 3  # cached opens and plans; a first open runs once
    peers: bool = True
    # Also write fastload's own index of the tar shards (``fl.write_index``: reads every
    # shard once, ~4 min at full size) and open and take a first batch with it.
    fastload_index: bool = False

    def __post_init__(self) -> None:
        for name in (
            "objects",
            "classes",
            "object_bytes",
            "shards",
            "shard_samples",
            "sample_bytes",
            "node_share",
            "ranks_per_node",
            "world_size",
            "batch_size",
            "workers",
            "repeats",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.latency_s < 0 or self.processes < 0:
            raise ValueError(
                f"latency_s and processes must be >= 0, got {self.latency_s}, {self.processes}"
            )
        if self.classes > self.objects:
            raise ValueError(f"classes ({self.classes}) must be <= objects ({self.objects})")

    @classmethod
    def quick(cls) -> ScaleBenchConfig:
        """50,000 images; 64 shards of 4 MB (6,400 samples): about 1.5 min."""
        return cls(objects=50_000, shards=64, shard_samples=100, sample_bytes=40_000, repeats=1)

    @property
    def tar_samples(self) -> int:
        return self.shards * self.shard_samples
