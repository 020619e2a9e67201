"""Where obstore serves an s3:// dataset, the training process never imports s3fs,
aiobotocore or botocore (~0.3 s of GIL at every cold start): the fsspec filesystem is made
only where something needs it. Each case runs in a fresh interpreter (this one imported
them long ago), against a real S3 server (moto) on loopback."""

from __future__ import annotations

import json
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
    import json, sys
    import fastload as fl
    from fastload.staging import FetchConfig

    url, cache, options, staging = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    fetch = FetchConfig(staging_process=staging == "process")
    ds = fl.open_dataset(
        url, format="files", cache_dir=cache, storage_options=options, fetch=fetch
    )
    with fl.DataLoader(ds, batch_size=4, shuffle=True, collate_fn=list) as dl:
        batch = [bytes(s) for s in next(iter(dl))]
    heavy = ("s3fs", "aiobotocore", "botocore")
    print(json.dumps({
        "imported": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
        "batch": [s.hex() for s in batch],
    }), flush=True)
    """
)


@pytest.mark.parametrize("staging", ["process", "here"])
def test_s3_dataset_through_obstore_imports_no_s3fs(tmp_path: Path, staging: str) -> None:
    source = tmp_path / "ds"
    # No empty object: obstore leaves a listing with one (a folder marker?) to s3fs.
    files = {key: data for key, data in make_files(source).items() if data}
    (source / "class_1" / "img 007.bin").unlink()
    with S3Server() as server:
        server.upload_dir(source, "data", prefix="ds")
        options = json.dumps(server.storage_options)
        args = ["s3://data/ds", str(tmp_path / "cache"), options, staging]
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env_for_child(),
        )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["imported"] == []
    contents = {data.hex() for data in files.values()}
    assert len(answer["batch"]) == 4
    assert set(answer["batch"]) <= contents  # the right bytes, from the remote
