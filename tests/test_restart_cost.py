"""What a restart does not redo: the plan's order computed a chunk at a time (the first
batches do not wait for the whole epoch's), and the manifest snapshot beside a loader's
state written once, not at every start of the job."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import fastload as fl
from fastload import plan as plan_module
from fastload.datasets import folder
from fastload.manifest import manifest_path
from fastload.plan import Plan
from fastload.warm import warm_from_state


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_rank_order_in_chunks_is_the_rank_order(
    shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan_module, "_CHUNK_SAMPLES", 50)  # many chunks at a small size
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 40, 97)
    sizes[0] = 1
    plan = Plan(sizes, seed=3, shuffle=shuffle, window_shards=4)
    for world_size, consumed in itertools.product((1, 3), (0, 1, 200)):
        resume = plan.resume_state(1).then(world_size, consumed) if consumed else None
        for rank in range(world_size):
            whole = plan.rank_order(1, world_size=world_size, rank=rank, resume=resume)
            chunks = list(plan.rank_chunks(1, world_size=world_size, rank=rank, resume=resume))
            assert len(chunks) > 1
            assert np.array_equal(np.concatenate(chunks), whole)


def test_the_rank_order_in_chunks_is_computed_as_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = Plan(np.ones(200_000, dtype=np.int64), seed=0)
    taken: list[int] = []
    take = plan_module._EpochOrder.take

    def counted(self: plan_module._EpochOrder, begin: int, end: int) -> np.ndarray:
        taken.append(end - begin)
        return take(self, begin, end)

    monkeypatch.setattr(plan_module._EpochOrder, "take", counted)
    first = next(plan.rank_chunks(0, world_size=1, rank=0))
    assert len(first) < 100_000
    assert sum(taken) == len(first)


def _files(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(20):
        (data / f"{i:02d}.bin").write_bytes(bytes([i]) * 100)
    return data


def test_a_loader_saves_the_manifest_snapshot_beside_its_state_once(tmp_path: Path) -> None:
    data = _files(tmp_path)
    checkpoints = tmp_path / "ckpt"

    def start() -> dict[str, str]:
        ds = fl.open_dataset(str(data), format="files", cache_dir=str(tmp_path / "cache"))
        loader = fl.DataLoader(ds, batch_size=4, on_preempt=checkpoints / "loader.json")
        state = loader.state_dict()
        loader.close()
        return dict(state["dataset"]["manifest"])

    entry = start()
    snapshot = checkpoints / entry["file"]
    written = snapshot.stat()
    assert start() == entry  # a restarted job: the same snapshot, not copied again
    assert snapshot.stat().st_mtime_ns == written.st_mtime_ns
    assert snapshot.stat().st_ino == written.st_ino
    snapshot.unlink()  # gone (a checkpoint folder cleaned): written again
    assert start() == entry
    assert snapshot.exists()


def test_a_snapshot_installed_on_an_empty_node_is_checked_and_sealed(tmp_path: Path) -> None:
    data = _files(tmp_path)
    ds = fl.open_dataset(str(data), format="files", cache_dir=str(tmp_path / "node-a"))
    loader = fl.DataLoader(ds, batch_size=4, on_preempt=tmp_path / "ckpt" / "loader.json")
    loader._preemption.write()  # type: ignore[union-attr]  # as SIGTERM would
    loader.close()
    state = tmp_path / "ckpt" / "loader.json"
    snapshot = tmp_path / "ckpt" / json.loads(state.read_text())["dataset"]["manifest"]["file"]
    good = snapshot.read_bytes()
    snapshot.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped
    with pytest.raises(ValueError, match="sha256 differs"):
        warm_from_state(state, cache_dir=str(tmp_path / "node-b"), progress=False)
    installed = manifest_path(tmp_path / "node-b", str(data))
    assert not installed.exists()
    assert not list(installed.parent.iterdir())  # nor a temporary left behind
    snapshot.write_bytes(good)
    assert warm_from_state(state, cache_dir=str(tmp_path / "node-b"), progress=False).ok
    assert installed.read_bytes() == good
    assert not installed.stat().st_mode & 0o222  # sealed: every process maps it


def test_an_empty_node_gets_the_dataset_layout_with_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    for i in range(12):
        (data / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        (data / f"class{i % 3}" / f"{i:02d}.jpg").write_bytes(bytes([i]) * 50)
    ds = fl.open_dataset(str(data), format="imagefolder", cache_dir=str(tmp_path / "node-a"))
    loader = fl.DataLoader(ds, batch_size=4, on_preempt=tmp_path / "ckpt" / "loader.json")
    loader._preemption.write()  # type: ignore[union-attr]  # as SIGTERM would
    loader.close()

    def made_again(*args: object) -> None:
        raise AssertionError("the layout was made again from the listing")

    monkeypatch.setattr(folder, "_layout", made_again)
    state = tmp_path / "ckpt" / "loader.json"
    assert warm_from_state(state, cache_dir=str(tmp_path / "node-b"), progress=False).ok
    again = fl.open_dataset(str(data), format="imagefolder", cache_dir=str(tmp_path / "node-b"))
    assert again.classes == ds.classes
    assert [again.target(i) for i in range(len(again))] == [ds.target(i) for i in range(len(ds))]
