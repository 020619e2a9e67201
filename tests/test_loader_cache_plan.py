"""``policy="plan"`` through the loader: the loader hands the cache this rank's future (the
rest of this epoch and the next, ``loader/cache_plan.py``), so at a budget of half the
dataset a shuffled loader's epochs after the first hit about half their objects, where
``lru`` (which ``plan`` acted as before the loader gave it a plan) hits far fewer. A
loopback HTTP server in its own process counts the GETs per object."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import fastload as fl
from fastload.cache import PlanHint, object_id
from fastload.testing import HTTPServerProcess

OBJECTS, EPOCHS = 200, 4


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HTTPServerProcess, int]]:
    root = tmp_path_factory.mktemp("source")
    rng = np.random.default_rng(5)
    total = 0
    for i in range(OBJECTS):
        path = root / "ds" / f"class_{i % 4}" / f"{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.bytes(1000)
        path.write_bytes(data)
        total += len(data)
    with HTTPServerProcess(root) as server:
        yield server, total


def object_gets(server: HTTPServerProcess) -> int:
    return sum(
        n
        for (method, path), n in server.stats().requests.items()
        if method == "GET" and path.startswith("/ds/") and path.endswith(".bin")
    )


def hit_rates(server: HTTPServerProcess, total: int, cache: Path, policy: str) -> list[float]:
    """Per epoch, the share of the objects read that were not fetched."""
    dataset = fl.open_dataset(
        server.url_for("ds"),
        format="files",
        cache_dir=str(cache),
        max_bytes=total // 2,
        budget_counts="entries",  # a share of the data, not the disk
        policy=policy,  # type: ignore[arg-type]
    )
    rates = []
    with (
        dataset,
        fl.DataLoader(
            dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=list, seed=1
        ) as loader,
    ):
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            before = object_gets(server)
            assert sum(len(batch) for batch in loader) == OBJECTS
            rates.append(1 - (object_gets(server) - before) / OBJECTS)
    return rates


def test_plan_through_the_loader_hits_about_half_and_beats_lru(
    remote: tuple[HTTPServerProcess, int], tmp_path: Path
) -> None:
    server, total = remote
    plan = hit_rates(server, total, tmp_path / "plan", "plan")
    lru = hit_rates(server, total, tmp_path / "lru", "lru")
    later = float(np.mean(plan[1:]))  # the first epoch fetches everything
    assert later >= 0.48, plan  # the most any policy can hit here is 0.5
    assert later > float(np.mean(lru[1:])) + 0.1, (plan, lru)


def test_a_late_read_never_moves_the_plan_into_the_next_pass() -> None:
    """Two loading threads: the later batch was read first; the earlier one's read of its
    entries must not jump the plan into the next epoch (where those entries recur)."""
    hint = PlanHint(["a", "b", "c", "a", "b", "c"], current=3)
    hint.advance(object_id("c"))
    assert hint.position == 3
    hint.advance(object_id("a"))  # its use in this pass is behind the plan already
    assert hint.position == 3
    assert hint.next_use(object_id("a")) == 3
