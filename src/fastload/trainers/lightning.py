"""PyTorch Lightning with ``fl.DataLoader``: exact mid-epoch resume from Lightning's own
checkpoints.

Lightning saves a stateful loader's ``state_dict()`` in its checkpoints and loads it on
``Trainer.fit(ckpt_path=...)``, and sets the sampler's epoch itself (the loader follows it).
What it cannot know is that a resumed fastload loader's ``len()`` is the rest of the epoch
(the plan's remaining batches), while Lightning counts batches from where the epoch was: it
would end the resumed epoch that many batches early. :class:`ExactResume` gives Lightning the
epoch's full length back::

    trainer = L.Trainer(callbacks=[ExactResume()], use_distributed_sampler=False)
    trainer.fit(model, fl.DataLoader(url, ...), ckpt_path=...)

``use_distributed_sampler=False`` keeps fastload's plan under DDP (Lightning would otherwise
rebuild the loader around a ``DistributedSampler``); the plan reads the rank from
torch.distributed or the launcher's ``RANK``/``WORLD_SIZE``.
"""

from __future__ import annotations

import math
from importlib.metadata import version
from typing import Any

import lightning.pytorch as L

from fastload.datasets.base import ShardedDataset
from fastload.loader import DataLoader
from fastload.sampler import ShardedSampler


def epoch_batches(loader: DataLoader) -> int | None:
    """The batches one whole epoch of this rank has (None: not a loader sharded by the plan)."""
    sampler = loader.sampler
    if not isinstance(sampler, ShardedSampler) or loader.batch_size is None:
        return None
    samples = sampler.plan.rank_length(world_size=sampler.world_size, epoch=sampler.epoch)
    if loader.drop_last:
        return samples // loader.batch_size
    return math.ceil(samples / loader.batch_size)


class ExactResume(L.Callback):
    """A resumed epoch runs to its end: Lightning's count of the epoch's batches is the
    epoch's, not the rest that the resumed loader's ``len()`` gives (see the module)."""

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
        full = epoch_batches(loader)
        counted = trainer.fit_loop.max_batches
        if full is None or not isinstance(counted, int) or not counted == len(loader) < full:
            return
        # Both of Lightning's counts took len(): the loop's (when the epoch ends) and its
        # fetcher's (which batch is the last). Lightning 2.6 keeps the second private.
        trainer.fit_loop.max_batches = full
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None or getattr(fetcher, "length", None) != counted:
            raise RuntimeError(
                "ExactResume does not know this Lightning version's data fetcher "
                f"(lightning {version('lightning')}): the resumed epoch would end early"
            )
        fetcher.length = full


__all__ = ["ExactResume", "epoch_batches"]
