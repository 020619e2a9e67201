"""``hf://`` URLs: a dataset repository on a loopback Hugging Face Hub
(``fastload.testing.HubServerProcess``, huggingface_hub's own HTTP API) listed, read and
warmed through fastload's cache; the listing pinned at the commit SHA; the Hub's 429s taken
as throttling; the token sent. That the token is required and shown nowhere (errors, reports,
logs, the cache, the ``fastload`` script) is tests/test_secrets.py's, for every transport."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

import fastload as fl
from fastload.datasets import open_dataset
from fastload.manifest import load_manifest
from fastload.remote import throttle
from fastload.sampler import ShardedSampler
from fastload.staging import FetchConfig
from fastload.testing import HubServerProcess
from fastload.warm import NodeShare

TOKEN = "hf_FastloadTestTokenAbCdEfGhIjKlMnOpQr"
QUICK = FetchConfig(jobs=4, min_jobs=1, retries=8, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10)
FASTLOAD = str(Path(sys.executable).parent / "fastload")


def jpeg(seed: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (16 + seed, 12), (seed * 20 % 256, 80, 160))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def make_repo(root: Path) -> dict[str, bytes]:
    """A few JPEG files in class folders below train/, and a README beside them."""
    files = {
        f"train/{c}/{c}_{i}.jpg": jpeg(i + 3 * n)
        for n, c in enumerate(("cat", "dog"))
        for i in range(3)
    }
    files["README.md"] = b"# a dataset\n"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.fixture
def repo(tmp_path: Path) -> dict[str, bytes]:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def hub(
    tmp_path: Path, repo: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubServerProcess]:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    # page_size=4: the tree comes in pages, as from the Hub
    with HubServerProcess(tmp_path / "repo", token=TOKEN, page_size=4) as server:
        yield server


def test_lists_and_reads_class_folders_through_the_cache(
    hub: HubServerProcess, repo: dict[str, bytes], tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    ds = open_dataset(
        hub.url_for("train"),
        format="imagefolder",
        cache_dir=str(cache),
        storage_options=hub.storage_options,
        fetch=QUICK,
    )
    assert ds.classes == ["cat", "dog"]
    expected = sorted((k, v) for k, v in repo.items() if k.startswith("train/"))
    assert [ds[i] for i in range(len(ds))] == [(v, 0 if "/cat/" in k else 1) for k, v in expected]
    stats = hub.stats()
    assert stats["resolve"] == len(expected)  # one GET a file, no HEADs, nothing twice
    assert stats["tree"] >= 2  # paginated
    assert "unauthorized" not in stats  # the token went with every request
    again = [ds[i] for i in range(len(ds))]  # from the cache
    assert hub.stats()["resolve"] == len(expected)
    assert again[0][0] == expected[0][1]
    manifest = load_manifest(hub.url_for("train"), cache, hub.storage_options)
    head = manifest.version(0)
    assert head is not None
    assert head.startswith("commit=")
    assert ";oid=" in head


def test_parquet_from_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    table = pa.table(
        {"image": [jpeg(i) for i in range(6)], "label": list(range(6)), "caption": list("abcdef")}
    )
    pq.write_table(table, root / "data" / "train.parquet", row_group_size=2)
    with HubServerProcess(root, token=TOKEN) as server:
        ds = open_dataset(
            server.url_for("data"),
            format="parquet",
            cache_dir=str(tmp_path / "cache"),
            storage_options=server.storage_options,
            fetch=QUICK,
        )
        assert len(ds) == 6
        rows = [ds[i] for i in range(len(ds))]
        assert [r["label"] if isinstance(r, dict) else r[1] for r in rows] == list(range(6))
        assert "unauthorized" not in server.stats()


def test_a_nodes_parquet_share_is_warmed_by_range_through_429s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastload warm --rank of Hub Parquet: footers and the rank's row groups as byte ranges,
    whose 429s cut the node's concurrency as whole-object fetches do."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    cuts: list[int] = []
    throttled = throttle.Throttle.throttled

    def counted(self: throttle.Throttle) -> None:
        throttled(self)
        cuts.append(self.limit)

    monkeypatch.setattr(throttle.Throttle, "throttled", counted)
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    for f in range(2):
        rows = range(16 * f, 16 * f + 16)
        table = pa.table({"image": [jpeg(i % 8) for i in rows], "label": list(rows)})
        pq.write_table(table, root / "data" / f"train-{f}.parquet", row_group_size=2)
    with HubServerProcess(root, token=TOKEN) as server:
        options = {"cache_dir": str(tmp_path / "c"), "storage_options": server.storage_options}
        share = NodeShare(ranks=(0,), world_size=4, epochs=(0,), format="parquet")
        url = server.url_for("data")
        planned = share.staging(url, **options)  # opening reads the footers
        assert planned.keys == []
        assert len({key for key, _, _ in planned.ranges}) == 2  # a part of each file
        server.throttle_next(4, kind="resolve")
        report = fl.warm(url, share=share, fetch=QUICK, progress=False, **options)
        assert report.ok, report.failures
        assert report.objects == 0
        assert report.ranges == report.fetched == len(planned.ranges)
        assert server.stats()["throttled"] == 4
        assert len(cuts) == 4  # each 429 reached the AIMD
        assert min(cuts) < QUICK.jobs
        ds = open_dataset(url, format="parquet", fetch=QUICK, **options)
        assert all(ds.store.local_path(f.key) is None for f in ds.files)  # no whole file
        resolved = server.stats()["resolve"]
        labels = [ds[i]["label"] for i in ShardedSampler(ds, rank=0, world_size=4)]
        assert len(labels) == 8
        assert server.stats()["resolve"] == resolved  # the rank's rows are all local


def test_the_listing_pins_the_commit_and_a_new_commit_is_fetched_again(
    hub: HubServerProcess, repo: dict[str, bytes], tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    url = hub.url_for("train")
    old = open_dataset(url, format="files", cache_dir=cache, storage_options=hub.storage_options)
    first_commit = old.store.manifest.version(0)
    key = old.keys[0]
    assert old[0] == repo[f"train/{key}"]
    old_sha = first_commit.split(";")[0].removeprefix("commit=")

    changed = b"\xff\xd8 a new picture \xff\xd9"
    (tmp_path / "repo" / "train" / key).write_bytes(changed)
    new_sha = hub.commit()
    assert new_sha != old_sha

    cached = open_dataset(url, format="files", cache_dir=cache, storage_options=hub.storage_options)
    assert cached[0] == repo[f"train/{key}"]  # the cached listing: still the old commit

    new = open_dataset(
        url, format="files", cache_dir=cache, storage_options=hub.storage_options, refresh=True
    )
    versions = [new.store.manifest.version(i) for i in range(len(new.store.manifest))]
    assert all(v is not None and v.startswith(f"commit={new_sha};") for v in versions)
    before = hub.stats()["resolve"]
    assert new[0] == changed  # not the old bytes the cache holds
    assert new[1] == repo[f"train/{new.keys[1]}"]  # unchanged, but a new version: fetched
    assert hub.stats()["resolve"] == before + 2

    pinned = open_dataset(
        hub.url_for("train", revision=old_sha),
        format="files",
        cache_dir=cache,
        storage_options=hub.storage_options,
    )
    assert pinned.store.manifest.version(0).startswith(f"commit={old_sha};")
    assert pinned[0] == repo[f"train/{key}"]  # the old commit's bytes, by its SHA


def test_429s_are_throttling_retried_and_the_warm_succeeds(
    hub: HubServerProcess, repo: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuts: list[int] = []  # the stager's AIMD throttle, each time it is told to slow down
    throttled = throttle.Throttle.throttled

    def counted(self: throttle.Throttle) -> None:
        throttled(self)
        cuts.append(self.limit)

    monkeypatch.setattr(throttle.Throttle, "throttled", counted)
    url = hub.url_for("train")
    hub.throttle_next(2, kind="repo_info")  # the listing too
    listed = fl.warm(
        url, cache_dir=str(tmp_path / "c"), storage_options=hub.storage_options, dry_run=True
    )
    assert listed.objects == 6
    assert hub.stats()["throttled"] == 2
    hub.throttle_next(8, kind="resolve")
    report = fl.warm(
        url,
        cache_dir=str(tmp_path / "c"),
        storage_options=hub.storage_options,
        fetch=QUICK,
        progress=False,
    )
    assert report.ok, report.failures
    assert report.fetched == 6
    stats = hub.stats()
    assert stats["throttled"] == 10
    assert stats["resolve"] == 6 + 8
    # Every 429 reached the stager as throttling, and its concurrency was cut.
    assert len(cuts) == 8
    assert min(cuts) < QUICK.jobs
    ds = open_dataset(
        url, format="files", cache_dir=str(tmp_path / "c"), storage_options=hub.storage_options
    )
    assert {k: ds[i] for i, k in enumerate(ds.keys)} == {
        k.removeprefix("train/"): v for k, v in repo.items() if k.startswith("train/")
    }


def run_fastload(
    args: list[str], hub: HubServerProcess, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "FSSPEC_"))}
    env.update(
        hub.env, HF_HOME=str(tmp_path / "hf-home"), FASTLOAD_CACHE_DIR=str(tmp_path / "cli-cache")
    )
    src = str(Path(fl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_fastload_warm_stages_a_nodes_share_from_the_hub(
    hub: HubServerProcess, tmp_path: Path
) -> None:
    url = hub.url_for("train")
    hub.throttle_next(3, kind="resolve")
    out = run_fastload(["warm", url, "--json"], hub, tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["fetched"] == 6
    assert report["failed"] == 0
    assert hub.stats()["throttled"] == 3
    share = run_fastload(
        [
            "warm",
            url,
            "--rank",
            "0",
            "--world-size",
            "2",
            "--epochs",
            "0..1",
            "--json",
            "--cache-dir",
            str(tmp_path / "share-cache"),
        ],
        hub,
        tmp_path,
    )
    assert share.returncode == 0, share.stderr
    shared = json.loads(share.stdout)
    assert 0 < shared["objects"] <= 6
    assert shared["failed"] == 0


def test_without_huggingface_hub_the_error_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['huggingface_hub'] = None\n"
        "from fastload.errors import MissingBackendError\n"
        "from fastload.remote import check_protocols\n"
        "try:\n"
        "    check_protocols('hf://datasets/org/name/train')\n"
        "except MissingBackendError as e:\n"
        "    print(e)\n"
    )
    src = str(Path(fl.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    assert 'pip install "fastload[hf]"' in out.stdout
