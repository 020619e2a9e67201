"""Adapters for the trainers that drive a DataLoader themselves: PyTorch Lightning
(:mod:`fastload.trainers.lightning`). Each imports its trainer, so neither is imported here."""
