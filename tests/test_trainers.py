"""fastload under the trainers that drive a loader themselves, on CPU in one process: PyTorch
Lightning (``Trainer.fit``, checkpoint and ``ckpt_path`` resume through its state_dict hooks,
with the loader alone: no callback) and Hugging Face accelerate (``accelerator.prepare(loader)``,
``save_state``/``load_state``). Exact: the batches after a resume, pixels of the augmented
images included, are those the uninterrupted run saw, and the trained weights end equal."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import process_group
import pytest
import torch
from test_loader import write_source

import fastload as fl
from fastload.decode import TrainPreset

SIZE = 16
BATCH = 8  # 60 samples: 8 batches an epoch, the last one short
EPOCHS = 3
STOP_AT = 10  # batches trained before the checkpoint: mid-epoch 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainers")
    write_source(root)
    return root / "folder"


def make_loader(folder: Path, cache_dir: Path) -> fl.DataLoader:
    return fl.DataLoader(
        str(folder), batch_size=BATCH, shuffle=True, decode="cpu", transform=TrainPreset(SIZE),
        cache_dir=str(cache_dir), seed=3,
    )  # fmt: skip


def digest(batch: Any) -> str:
    images, labels = batch
    return hashlib.md5(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()


def expected_stream(folder: Path, cache_dir: Path) -> list[str]:
    """The loader's batches for EPOCHS epochs, driven by hand (no trainer)."""
    loader = make_loader(folder, cache_dir)
    stream = [digest(batch) for _ in range(EPOCHS) for batch in loader]
    loader.close()
    return stream


# --- PyTorch Lightning -------------------------------------------------------------------------


def lightning_run(
    folder: Path,
    cache_dir: Path,
    checkpoint: Path,
    *,
    stop: bool = False,
    resume: bool = False,
    devices: int = 1,
) -> tuple[list[str], torch.Tensor]:
    L = pytest.importorskip("lightning.pytorch")

    class Model(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(3 * SIZE * SIZE, 3)
            self.seen: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(digest(batch))
            images, labels = batch
            return torch.nn.functional.cross_entropy(self.linear(images.flatten(1)), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class StopAfter(L.Callback):  # type: ignore[misc, name-defined]
        """Checkpoints after STOP_AT batches and stops: the job preempted there."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == STOP_AT:
                trainer.save_checkpoint(checkpoint)
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_epochs=EPOCHS, logger=False,
        strategy="ddp" if devices > 1 else "auto",
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[StopAfter()] if stop else [],
    )  # fmt: skip
    model = Model()
    loader = make_loader(folder, cache_dir)
    path = checkpoint if resume else None
    trainer.fit(model, loader, ckpt_path=path)
    loader.close()
    return model.seen, model.linear.weight.detach().clone()


@pytest.mark.slow
# Lightning 2.6 warns of its own (few workers, a deprecated pytree use on torch 2.13).
@pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)
def test_lightning_fit_resumes_exactly_from_its_checkpoint(folder: Path, tmp_path: Path) -> None:
    cache, checkpoint = tmp_path / "cache", tmp_path / "mid.ckpt"
    expected = expected_stream(folder, cache)
    whole, weights = lightning_run(folder, cache, checkpoint)
    assert whole == expected  # Lightning's set_epoch reaches the augmentations too
    first, _ = lightning_run(folder, cache, checkpoint, stop=True)
    assert first == expected[:STOP_AT]
    rest, resumed_weights = lightning_run(folder, cache, checkpoint, resume=True)
    assert rest == expected[STOP_AT:]  # the resumed epoch runs to its end, the next in full
    assert torch.equal(resumed_weights, weights)


@pytest.mark.slow
@pytest.mark.dist
def test_lightning_ddp_two_ranks_resume_exactly(folder: Path, tmp_path: Path) -> None:
    """Two gloo ranks under Lightning's DDP (launched as torchrun would, no sampler swap):
    each rank trains on its share of the plan, and the checkpoint (rank 0's loader state)
    resumes both exactly; the ranks' shares are disjoint."""
    pytest.importorskip("lightning.pytorch")
    args = ["--folder", str(folder), "--work", str(tmp_path)]
    ranks = process_group.run_group(__file__, 2, tmp_path / "out", args, timeout_s=300)
    for got in ranks:  # (the weights' equality is checked in one process above)
        assert got["first"] == got["expected"][:STOP_AT]
        assert got["rest"] == got["expected"][STOP_AT:]
    assert not set(ranks[0]["expected"]) & set(ranks[1]["expected"])


# --- Hugging Face accelerate -------------------------------------------------------------------


def accelerate_run(
    folder: Path, cache_dir: Path, state_dir: Path, *, stop: bool = False, resume: bool = False
) -> tuple[list[str], torch.Tensor]:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    assert accelerator.num_processes == int(os.environ.get("WORLD_SIZE", "1"))  # gloo ranks
    torch.manual_seed(0)
    model = torch.nn.Linear(3 * SIZE * SIZE, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(folder, cache_dir)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader  # not rebuilt into accelerate's torch DataLoaderShard
    if resume:
        accelerator.load_state(str(state_dir))
    seen: list[str] = []
    for _ in range(loader.epoch, EPOCHS):
        for batch in prepared:
            seen.append(digest(batch))
            images, labels = batch
            loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if stop and len(seen) == STOP_AT:
                accelerator.save_state(str(state_dir))
                break
        if stop and len(seen) == STOP_AT:
            break
    assert prepared.stats()["path"] == "fastload"
    loader.close()
    return seen, accelerator.unwrap_model(model).weight.detach().clone()


@pytest.mark.slow
def test_accelerate_prepare_keeps_the_loader_and_resumes_exactly(
    folder: Path, tmp_path: Path
) -> None:
    cache, state = tmp_path / "cache", tmp_path / "state"
    expected = expected_stream(folder, cache)
    whole, weights = accelerate_run(folder, cache, state)
    assert whole == expected
    first, _ = accelerate_run(folder, cache, state, stop=True)
    assert first == expected[:STOP_AT]
    rest, resumed_weights = accelerate_run(folder, cache, state, resume=True)
    assert rest == expected[STOP_AT:]
    assert torch.equal(resumed_weights, weights)


@pytest.mark.slow
@pytest.mark.dist
def test_accelerate_two_ranks_resume_exactly(folder: Path, tmp_path: Path) -> None:
    """Two gloo ranks under accelerate (launched as `accelerate launch` would): prepare()
    keeps each rank's loader and its share of the plan, save_state/load_state resume both
    exactly; the ranks' shares are disjoint."""
    pytest.importorskip("accelerate")
    args = ["--folder", str(folder), "--work", str(tmp_path), "--trainer", "accelerate"]
    ranks = process_group.run_group(__file__, 2, tmp_path / "out", args, timeout_s=300)
    for got in ranks:
        assert got["first"] == got["expected"][:STOP_AT]
        assert got["rest"] == got["expected"][STOP_AT:]
    assert not set(ranks[0]["expected"]) & set(ranks[1]["expected"])


def _rank_main(argv: list[str]) -> None:
    """One rank of the two-rank tests above (run by process_group)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--trainer", choices=["lightning", "accelerate"], default="lightning")
    a = parser.parse_args(argv)
    os.environ["LOCAL_RANK"] = os.environ["RANK"]  # launched outside the trainer, one node
    rank = int(os.environ["RANK"])
    cache, checkpoint = a.work / f"cache{rank}", a.work / "mid"
    expected = expected_stream(a.folder, cache)  # the loader alone, this rank's share
    if a.trainer == "lightning":
        first, _ = lightning_run(a.folder, cache, checkpoint, stop=True, devices=2)
        rest, _ = lightning_run(a.folder, cache, checkpoint, resume=True, devices=2)
    else:
        first, _ = accelerate_run(a.folder, cache, checkpoint, stop=True)
        rest, _ = accelerate_run(a.folder, cache, checkpoint, resume=True)
    result = {"expected": expected, "first": first, "rest": rest}
    a.out.write_text(json.dumps(result))
    # As the other gloo rank scripts do: a group left to the interpreter's teardown aborted
    # a rank after its result was written ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")  # Lightning's own warnings, as in the tests above
    _rank_main(sys.argv[1:])
