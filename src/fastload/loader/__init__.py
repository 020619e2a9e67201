"""``fl.DataLoader``: a drop-in for torch's DataLoader; see ``fastload.loader.dataloader``."""

from fastload.loader.dataloader import DataLoader

__all__ = ["DataLoader"]
