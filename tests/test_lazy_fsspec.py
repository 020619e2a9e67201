"""Where obstore serves an s3:// dataset, neither the training process nor its staging
process imports s3fs, aiobotocore or botocore (~0.3 s of GIL at every cold start): the
fsspec filesystem is made only where something needs it. Each case runs in a fresh
interpreter (this one imported them long ago), against a real S3 server (moto) on
loopback; a ``sitecustomize`` on the path writes, as each of its Python processes exits,
which of those modules it had imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import make_files

from fastload.staging.lifetime import env_for_child
from fastload.testing import S3Server

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import fastload as fl
    from fastload.staging import FetchConfig
    from fastload.staging.process import for_stager
    from fastload.store import CachedStore

    url, cache, options, staging = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    fetch = FetchConfig(staging_process=staging == "process")
    if staging == "process":  # a round of staging in the staging process, once it is up
        store = CachedStore.open(url, cache_dir=cache, storage_options=options, fetch=fetch)
        stager = store.stager
        process = for_stager(stager.fs, stager.root, store.cache.config, fetch)
        while not process.ready():
            time.sleep(0.05)
        store.stage(store.object_keys()[:8])
    ds = fl.open_dataset(
        url, format="files", cache_dir=cache, storage_options=options, fetch=fetch
    )
    with fl.DataLoader(ds, batch_size=4, shuffle=True, collate_fn=list) as dl:
        batch = [bytes(s) for s in next(iter(dl))]
    print(json.dumps([s.hex() for s in batch]), flush=True)
    """
)

_SITECUSTOMIZE = textwrap.dedent(
    """
    import atexit, json, os, sys

    def _said():
        heavy = ("s3fs", "aiobotocore", "botocore")
        imported = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        with open(os.path.join(os.environ["LAZY_S3_REPORTS"], str(os.getpid())), "w") as f:
            json.dump({"argv": sys.argv, "imported": imported}, f)

    atexit.register(_said)
    """
)


@pytest.mark.parametrize("staging", ["process", "here"])
def test_s3_dataset_through_obstore_imports_no_s3fs(tmp_path: Path, staging: str) -> None:
    source = tmp_path / "ds"
    # No empty object: obstore leaves a listing with one (a folder marker?) to s3fs.
    files = {key: data for key, data in make_files(source).items() if data}
    (source / "class_1" / "img 007.bin").unlink()
    site, reports = tmp_path / "site", tmp_path / "reports"
    site.mkdir()
    reports.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = env_for_child({**os.environ, "PYTHONPATH": path, "LAZY_S3_REPORTS": str(reports)})
    with S3Server() as server:
        server.upload_dir(source, "data", prefix="ds")
        options = json.dumps(server.storage_options)
        args = ["s3://data/ds", str(tmp_path / "cache"), options, staging]
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert done.returncode == 0, done.stderr
    batch = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(batch) == 4
    assert set(batch) <= {data.hex() for data in files.values()}  # the remote's bytes
    said = [json.loads(p.read_text()) for p in reports.iterdir()]
    staging_processes = [s for s in said if "process_main" in " ".join(s["argv"])]
    assert len(staging_processes) == (1 if staging == "process" else 0)
    assert len(said) == 1 + len(staging_processes)
    for process in said:
        assert process["imported"] == [], process["argv"]
