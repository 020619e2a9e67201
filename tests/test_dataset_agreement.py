"""Every rank trains on the same dataset: the dataset's fingerprint (a digest of its listing)
is all-gathered at a loader's first iteration in a real gloo process group, and a node whose
listing differs (an older manifest) fails every rank with an error naming the ranks and what
differs; a saved state carries the fingerprint and refuses another listing."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import process_group
import pytest

GROUP_TIMEOUT_S = 60


def make_folder(root: Path, count: int, changed: int | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        data = f"sample {i}".encode() * (2 if i == changed else 1)
        (root / f"ü-{i:03d}.bin").write_bytes(data)


def open_files(root: Path, cache: Path) -> Any:
    import fastload as fl

    return fl.open_dataset(str(root), format="files", cache_dir=str(cache))


# --- the fingerprint -----------------------------------------------------------------------------


def test_the_fingerprint_is_that_of_the_listing(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", 12)
    make_folder(tmp_path / "b", 12)
    make_folder(tmp_path / "grown", 13)
    make_folder(tmp_path / "changed", 12, changed=5)
    same = open_files(tmp_path / "a", tmp_path / "c1").fingerprint
    assert same == open_files(tmp_path / "a", tmp_path / "c2").fingerprint  # another cache
    assert len(same) == 32  # xxh3-128, hex
    others = {
        open_files(tmp_path / name, tmp_path / f"c-{name}").fingerprint
        for name in ("b", "grown", "changed")
    }
    # b's files have other mtimes (versions); grown has one more; changed one other size
    assert same not in others
    assert len(others) == 3


def test_a_state_saved_over_another_listing_is_refused(tmp_path: Path) -> None:
    import fastload as fl
    from fastload.errors import DatasetMismatchError

    make_folder(tmp_path / "ds", 12)
    ds = open_files(tmp_path / "ds", tmp_path / "c")
    loader = fl.DataLoader(ds, batch_size=3, collate_fn=list, rank=0, world_size=1)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))  # plain values
    assert state["fingerprint"] == ds.fingerprint
    assert state["objects"] == 12

    fl.DataLoader(ds, batch_size=3, collate_fn=list).load_state_dict(state)  # same: fine
    make_folder(tmp_path / "ds", 13)  # a new object, listed afresh
    relisted = fl.open_dataset(
        str(tmp_path / "ds"), format="files", cache_dir=str(tmp_path / "c"), refresh=True
    )
    with pytest.raises(DatasetMismatchError, match="12 objects then, 13 now") as caught:
        fl.DataLoader(relisted, batch_size=3, collate_fn=list).load_state_dict(state)
    assert isinstance(caught.value, ValueError)


def test_the_mismatch_names_the_ranks_and_where_they_differ(tmp_path: Path) -> None:
    from fastload.loader.agreement import mismatch, summary

    make_folder(tmp_path / "new", 12)
    make_folder(tmp_path / "old", 11)
    new = summary(open_files(tmp_path / "new", tmp_path / "c1"))
    old = summary(open_files(tmp_path / "old", tmp_path / "c2"))
    assert mismatch([new, new]) is None
    text = mismatch([new, old, new])
    assert text is not None
    assert "ranks 0, 2 list 12 objects" in text
    assert "rank 1 lists 11" in text
    assert "refresh=True" in text


# --- in a real process group -------------------------------------------------------------------


@pytest.mark.dist
def test_ranks_with_different_listings_fail_naming_them(tmp_path: Path) -> None:
    make_folder(tmp_path / "data-0", 10)
    make_folder(tmp_path / "data-1", 10)
    make_folder(tmp_path / "stale-1", 9)  # rank 1's node listed before the 10th arrived
    same = process_group.run_group(
        __file__,
        2,
        tmp_path / "same",
        ["--data", str(tmp_path / "data-0")],
        timeout_s=GROUP_TIMEOUT_S,
    )
    assert [r["error"] for r in same] == [None, None]
    assert sorted(i for r in same for i in r["samples"]) == list(range(10))

    differ = process_group.run_group(
        __file__,
        2,
        tmp_path / "differ",
        ["--data", str(tmp_path / "data-0"), "--rank1-data", str(tmp_path / "stale-1")],
        timeout_s=GROUP_TIMEOUT_S,
    )
    for r in differ:
        assert r["error"] is not None
        assert r["type"] == "DatasetMismatchError"
        assert r["samples"] == []  # refused before the first batch
        assert "rank 0 lists 10 objects" in r["error"]
        assert "rank 1 lists 9" in r["error"]
        assert "first differ" in r["error"]


def _rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rank1-data")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    import fastload as fl

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        rank = dist.get_rank()
        data = args.rank1_data if rank == 1 and args.rank1_data else args.data
        out = Path(args.out)
        ds = open_files(Path(data), out.parent / f"cache-{rank}")
        loader = fl.DataLoader(ds, batch_size=1, collate_fn=list, shuffle=False)
        result: dict[str, Any] = {"error": None, "type": None, "samples": []}
        try:
            for batch in loader:
                result["samples"].append(int(batch[0].decode().split()[1]))
        except fl.FastloadError as exc:
            result["error"], result["type"] = str(exc), type(exc).__name__
        out.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "error")
    _rank_main(sys.argv[1:])
