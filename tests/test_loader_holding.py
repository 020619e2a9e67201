"""Objects a full ``pin`` cache turns away: fetched once ahead by the loader's staging, held in
memory within a byte bound, read from there (servers on loopback count the GETs)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Remote
from test_loader import served as serve_source
from test_loader import write_source

import fastload as fl
from fastload.datasets.base import ShardedDataset
from fastload.errors import RemoteError, RemoteNotFoundError
from fastload.loader.pipeline import Pipeline
from fastload.loader.stats import LoaderStats
from fastload.staging import FetchConfig, Holding
from fastload.staging.process import close_all

QUICK = FetchConfig(jobs=8, retries=4, backoff_s=0.01, backoff_max_s=0.02, timeout_s=10)


@pytest.fixture(autouse=True)
def _staging_processes_closed() -> Iterator[None]:
    """A staging process lives as long as the process that started it (every store of its
    settings reuses it); a test's are closed at its end, as they are at exit."""
    yield
    close_all()


def open_files(remote: Remote, cache: Path, **options: Any) -> ShardedDataset:
    return fl.open_dataset(
        remote.url,
        format="files",
        cache_dir=str(cache),
        storage_options=dict(remote.storage_options),
        **options,
    )


def half_budget(remote: Remote) -> int:
    return sum(map(len, remote.files.values())) // 2


def open_pinned(remote: Remote, cache: Path, **options: Any) -> ShardedDataset:
    """The dataset behind a pin cache of half its size: half of it is turned away."""
    return open_files(
        remote,
        cache,
        max_bytes=half_budget(remote),
        budget_counts="entries",
        policy="pin",
        **options,
    )


def epochs(
    dataset: ShardedDataset, count: int, **loader: Any
) -> tuple[list[bytes], dict[str, Any]]:
    """Every sample of ``count`` epochs in the loader's order, and its stats."""
    with fl.DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=list, **loader) as dl:
        samples = [bytes(s) for _ in range(count) for batch in dl for s in batch]
        return samples, dl.stats()


def all_cached(remote: Remote, tmp_path: Path, count: int) -> list[bytes]:
    samples, _ = epochs(open_files(remote, tmp_path / "all"), count, num_workers=2)
    return samples


def turned_away(dataset: ShardedDataset) -> list[str]:
    return [k for k in dataset.store.object_keys() if dataset.store.local_path(k) is None]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_turned_away_objects_are_fetched_once_per_epoch_and_read_from_memory(
    served: Remote, tmp_path: Path, num_workers: int
) -> None:
    assert served.server is not None
    expected = all_cached(served, tmp_path, 2)
    dataset = open_pinned(served, tmp_path / "pin")
    served.server.reset_stats()

    samples, stats = epochs(dataset, 2, num_workers=num_workers)

    held = turned_away(dataset)
    assert held  # the budget is half the dataset
    assert samples == expected
    gets = {k: served.gets(k) for k in served.files}
    # Cached ones once in all; held ones once per epoch (held for their read, then dropped).
    assert gets == {k: 2 if k in held else 1 for k in served.files}
    counts = stats["counts"]
    assert counts["stage_held"] == counts["held_reads"] == 2 * len(held)
    assert counts.get("cache_reads", 0) == 0  # no sample was read one at a time
    assert counts["cache_misses"] == len(served.files) + len(held)
    assert stats["held"]["objects"] == 0  # each dropped once read
    assert 0 < stats["held"]["peak_bytes"] <= stats["held"]["max_bytes"]


def test_the_holding_area_stays_within_its_bound_and_the_rest_comes_from_the_remote(
    served: Remote, tmp_path: Path
) -> None:
    expected = all_cached(served, tmp_path, 1)
    bound = 200_000  # about two of the objects: most are pushed out or do not fit
    dataset = open_pinned(
        served,
        tmp_path / "pin",
        fetch=FetchConfig(hold_bytes=bound),
    )
    samples, stats = epochs(dataset, 1, num_workers=2, lookahead_bytes=10**9)
    assert samples == expected
    assert stats["held"]["max_bytes"] == bound
    assert stats["held"]["peak_bytes"] <= bound


def test_holding_never_exceeds_its_bytes_and_drops_the_oldest_first() -> None:
    rng = random.Random(0)
    holding = Holding(10_000)
    order: list[str] = []
    for step in range(2_000):
        key = f"k{rng.randrange(300)}"
        if rng.random() < 0.6:
            if holding.put(key, bytes(rng.randrange(0, 4_000)), reads=rng.randrange(1, 3)):
                order = [k for k in order if k != key] + [key]
        else:
            data = holding.take(key)
            if data is not None and holding.take(key, reads=0) is None:
                order.remove(key)  # its last expected read dropped it
        assert holding.nbytes <= holding.max_bytes, step
    assert holding.peak_bytes <= holding.max_bytes
    assert holding.dropped_unread > 0
    assert not holding.put("big", bytes(10_001), reads=1)
    oldest = order[0] if order else None
    holding.put("new", bytes(9_000), reads=1)
    if oldest is not None:
        assert holding.take(oldest) is None  # pushed out first
    assert holding.take("new") is not None
    assert holding.take("new") is None  # dropped after its one read


def test_a_dataset_within_the_pin_budget_is_staged_as_without_one(
    served: Remote, tmp_path: Path
) -> None:
    """Holding (and loading batches after their staging round) is for a dataset larger
    than the budget; one that fits is staged into the cache as before."""
    assert served.server is not None
    budget = sum(map(len, served.files.values()))
    dataset = open_files(
        served, tmp_path / "pin", max_bytes=budget, budget_counts="entries", policy="pin"
    )
    served.server.reset_stats()
    _, stats = epochs(dataset, 2, num_workers=2)
    assert "held" not in stats
    assert stats["counts"]["cache_misses"] == len(served.files)
    assert {k: served.gets(k) for k in served.files} == dict.fromkeys(served.files, 1)


def test_holding_disabled_reads_turned_away_objects_from_the_remote(
    served: Remote, tmp_path: Path
) -> None:
    expected = all_cached(served, tmp_path, 1)
    dataset = open_pinned(
        served,
        tmp_path / "pin",
        fetch=FetchConfig(hold_bytes=0),
    )
    samples, stats = epochs(dataset, 1, num_workers=2)
    assert samples == expected
    assert stats["counts"]["stage_skipped"] > 0
    assert stats["counts"]["cache_reads"] == len(turned_away(dataset))
    assert "held" not in stats


def test_with_a_staging_process_this_process_fetches_what_the_cache_turned_away(
    served: Remote, tmp_path: Path
) -> None:
    """The staging process skips what a full cache turns away (it keeps no memory for this
    process); this process fetches those into its holding area."""
    assert served.server is not None
    expected = all_cached(served, tmp_path, 1)
    dataset = open_pinned(
        served,
        tmp_path / "pin",
        fetch=FetchConfig(staging_process=True),
    )
    first, _ = epochs(dataset, 1, num_workers=2)  # fills the cache
    held = turned_away(dataset)
    before = {k: served.gets(k) for k in served.files}
    second, stats = epochs(dataset, 1, num_workers=2)
    assert first == second == expected
    gets = {k: served.gets(k) - before[k] for k in served.files}
    assert gets == {k: 1 if k in held else 0 for k in served.files}
    assert stats["counts"]["stage_held"] == stats["counts"]["held_reads"] == len(held)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tar_shards_the_cache_turns_away_give_the_all_cached_batches(
    tmp_path: Path, num_workers: int
) -> None:
    """Shards are held whole where a round reads at least half of their samples, else read
    as ranges from the remote: the samples are the same either way."""
    source = write_source(tmp_path / "src")
    budget = sum(p.stat().st_size for p in (source.root / "tars").iterdir()) // 2
    with serve_source("http", source) as where:

        def samples(cache: Path, **options: Any) -> list[bytes]:
            dataset = where.open("tars", cache, **options)
            with fl.DataLoader(
                dataset, batch_size=4, shuffle=True, collate_fn=list, num_workers=num_workers
            ) as loader:
                return [bytes(s["jpg"]) for _ in range(2) for batch in loader for s in batch]

        expected = samples(tmp_path / "all")
        assert (
            samples(tmp_path / "pin", max_bytes=budget, budget_counts="entries", policy="pin")
            == expected
        )


def test_forked_torch_workers_read_turned_away_objects_from_the_remote(
    served: Remote, tmp_path: Path
) -> None:
    """After this process held objects (through obstore, over S3), torch's forked workers
    neither see its holding area nor call obstore (which hangs in a forked child): they
    read what the cache turned away from the remote."""
    expected = all_cached(served, tmp_path, 1)
    dataset = open_pinned(served, tmp_path / "pin")
    epochs(dataset, 1, num_workers=2)  # holds and reads what the cache turns away
    with fl.DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        collate_fn=list,
        num_workers=2,
        worker_init_fn=lambda _: None,  # torch's worker processes (fork)
        timeout=60,  # a hung worker is an error
    ) as loader:
        assert loader.stats()["path"] == "torch"
        samples = [bytes(s) for batch in loader for s in batch]
    assert sorted(samples) == sorted(expected)


# --- the pipeline: batches are loaded after their staging round --------------------------


def test_with_load_after_stage_no_batch_is_loaded_before_its_round_is_staged() -> None:
    staged: set[int] = set()
    rounds: list[int] = []

    def stage(batches: list[Any]) -> None:
        rounds.append(len(batches))
        time.sleep(0.02)  # workers that did not wait would load these meanwhile
        staged.update(b[0] for b in batches)

    def load(seq: int, batch: list[int]) -> int:
        assert batch[0] in staged, f"batch {seq} loaded before it was staged"
        return batch[0]

    batches = iter([[i] for i in range(40)])
    pipeline = Pipeline(
        batches,
        load,
        workers=3,
        prefetch=6,
        stage=stage,
        lookahead=20,
        stage_round=8,
        load_after_stage=True,
        stats=LoaderStats(),
    )
    assert list(pipeline) == list(range(40))
    assert rounds[:4] == [1, 2, 4, 8]  # a pass starts with small rounds
    assert max(rounds) == 8


def test_a_pass_stages_its_first_batch_alone_first_whether_or_not_it_waits() -> None:
    """A first round of 8 batches made a cold first batch wait for objects the round had
    locked; rounds start at one batch and double up to stage_round."""
    rounds: list[int] = []

    def stage(batches: list[Any]) -> None:
        rounds.append(len(batches))

    pipeline = Pipeline(
        iter([[i] for i in range(40)]),
        lambda seq, batch: batch[0],
        workers=2,
        prefetch=4,
        stage=stage,
        lookahead=20,
        stage_round=8,
        load_after_stage=False,
        stats=LoaderStats(),
    )
    assert list(pipeline) == list(range(40))
    assert rounds[:4] == [1, 2, 4, 8]
    assert sum(rounds) == 40


def test_with_load_after_stage_a_failing_sampler_is_an_error_not_a_hang() -> None:
    def batches() -> Any:
        yield [0]
        yield [1]
        raise ValueError("the sampler broke")

    pipeline = Pipeline(
        batches(),
        lambda seq, batch: batch[0],
        workers=2,
        prefetch=4,
        stage=lambda batches: None,
        lookahead=8,
        stage_round=8,
        load_after_stage=True,
        stats=LoaderStats(),
    )
    got = []
    with pytest.raises(ValueError, match="sampler broke"):
        got.extend(pipeline)
    assert got == [0, 1]


# --- failures, as without holding ----------------------------------------------------------


def pin_warmed(remote: Remote, tmp_path: Path, **options: Any) -> tuple[ShardedDataset, str]:
    """A pin cache filled to its budget, and one object it turned away."""
    dataset = open_pinned(remote, tmp_path / "pin", **options)
    dataset.warm()
    away = sorted(k for k in turned_away(dataset) if remote.files[k])
    return dataset, away[0]


def test_a_turned_away_object_that_is_gone_fails_naming_it(served: Remote, tmp_path: Path) -> None:
    assert served.server is not None
    dataset, key = pin_warmed(served, tmp_path, fetch=QUICK)
    name = key.split("/")[-1]
    served.server.fail_next(50, 404, path_contains=name, methods=["GET"])
    with pytest.raises(RemoteNotFoundError, match=name):
        epochs(dataset, 1, num_workers=2)


def test_transient_faults_on_a_turned_away_object_are_retried(
    served: Remote, tmp_path: Path
) -> None:
    assert served.server is not None
    expected = all_cached(served, tmp_path, 1)
    dataset, key = pin_warmed(served, tmp_path, fetch=QUICK)
    served.server.fail_next(3, 503, path_contains=key.split("/")[-1], methods=["GET"])
    samples, stats = epochs(dataset, 1, num_workers=2)
    assert samples == expected
    assert served.server.pending_faults == 0
    assert stats["counts"]["stage_held"] == len(turned_away(dataset))


def test_transient_faults_that_outlast_the_retries_are_an_error_naming_the_object(
    served: Remote, tmp_path: Path
) -> None:
    assert served.server is not None
    dataset, key = pin_warmed(served, tmp_path, fetch=QUICK)
    name = key.split("/")[-1]
    served.server.fail_next(1000, 500, path_contains=name, methods=["GET"])
    with pytest.raises(RemoteError, match=name):
        epochs(dataset, 1, num_workers=2)
