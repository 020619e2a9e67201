"""PyTorch Lightning with ``fl.DataLoader``: exact mid-epoch resume from Lightning's own
checkpoints, with nothing but the loader.

Lightning saves a stateful loader's ``state_dict()`` in its checkpoints, loads it on
``Trainer.fit(ckpt_path=...)``, and sets the sampler's epoch itself (the loader follows it).
It counts a resumed epoch's batches on from the checkpoint's up to ``len(loader)``, which is
the whole epoch's count after a resume too (as torch's and torchdata's loaders give), so the
resumed epoch runs to its end::

    trainer = L.Trainer(use_distributed_sampler=False)
    trainer.fit(model, fl.DataLoader(url, ...), ckpt_path=...)

``use_distributed_sampler=False`` keeps fastload's plan under DDP (Lightning would otherwise
rebuild the loader around a ``DistributedSampler``); the plan reads the rank from
torch.distributed or the launcher's ``RANK``/``WORLD_SIZE``. :class:`ExactResume` makes a
forgotten ``use_distributed_sampler=False`` an error instead of a silently different order.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L

from fastload.datasets.base import ShardedDataset
from fastload.loader import DataLoader
from fastload.sampler import ShardedSampler


class ExactResume(L.Callback):
    """Refuses a fastload loader that Lightning rebuilt around a sampler of its own: its
    order, its sharding by rank and its exact resume would be gone (see the module)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader: Any = trainer.train_dataloader
        if not isinstance(loader, DataLoader):
            return
        if isinstance(loader.dataset, ShardedDataset) and not isinstance(
            loader.sampler, ShardedSampler
        ):
            raise ValueError(
                f"Lightning rebuilt the loader around a {type(loader.sampler).__name__}: "
                "fastload's plan (its order, sharding and exact resume) is gone. Pass "
                "L.Trainer(use_distributed_sampler=False); the plan shards by rank itself"
            )


__all__ = ["ExactResume"]
