"""fastload itself as an end-to-end system: ``fl.open_dataset`` + ``fl.DataLoader`` on the
layout's URL (Zarr rows get the train preset's torch ops in ``collate_fn``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastload.bench.peers.peer_decoders import TorchOps
from fastload.bench.peers.spec import LABELS_IN_ORDER, Delivered, RunSpec, ensure_dir, train_preset
from fastload.decode.params import TrainPreset


class FastloadLoader:
    def __init__(self, spec: RunSpec, state: Any) -> None:
        import fastload as fl

        ds = fl.open_dataset(
            spec.url,
            cache_dir=ensure_dir(os.path.join(spec.work_dir, "cache")),
            storage_options=spec.storage_options,
        )
        self.samples = len(ds)
        self.extra: dict[str, float] = {}
        self.no_resume = ""
        # Its batches are (images, labels); an epoch's order is a pure function of (seed,
        # epoch), so the resume check compares the labels in order.
        self.delivers = LABELS_IN_ORDER
        self.stats: dict[str, Any] | None = None
        options: dict[str, Any] = {"decode": "cpu", "transform": train_preset(spec)}
        if ds.format == "zarr":
            # fastload's decode takes encoded images; Zarr rows are pixels already, so the
            # train preset's torch ops run in collate_fn, on fastload's threads.
            options = {"collate_fn": _PixelBatch(train_preset(spec), spec.seed)}
        self.loader = fl.DataLoader(
            ds,
            batch_size=spec.batch_size,
            shuffle=True,
            num_workers=spec.workers,
            seed=spec.seed,
            **options,
        )
        if state is not None:
            self.loader.load_state_dict(state)

    def batches(self, epoch: int | None) -> Iterator[Delivered]:
        if epoch is not None:
            self.loader.set_epoch(epoch)
        for batch in self.loader:
            yield [int(label) for label in batch[1]]

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def close(self) -> None:
        if self.stats is None:  # per-stage busy/wait seconds, for the JSON
            self.stats = self.loader.stats()
        self.loader.close()


class _PixelBatch:
    """collate_fn for Zarr rows of HWC uint8 pixels: the train preset's torch ops, stacked."""

    def __init__(self, preset: TrainPreset, seed: int) -> None:
        self.ops = TorchOps(preset, seed)

    def __call__(self, rows: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([self.ops(np.asarray(r["images"])) for r in rows])
        return images, torch.tensor([int(r["labels"]) for r in rows])
