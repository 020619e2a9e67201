"""Staging with no FetchConfig against staging in the training process, beside a GIL-holding
thread and without one (#32): the busy thread's GIL per staged object, and the wall time.

Each case is a fresh process (``small_objects_bench``'s child) staging ``--objects`` objects
of 512 B from the plain loopback S3 server, in one run, turns alternating: ``default`` (no
FetchConfig: the staging process, started at the listing) and ``in-process``
(``FetchConfig(staging_process=False)``), each with the listing timed (everything a user
who calls ``fl.warm`` waits for, the s3fs import included) and with the listing done
untimed first (staging alone; the staging process started during it). ``GIL blocked
ms/obj`` is the busy thread's wall time less its time on a CPU and in the run queue
(``/proc/self/task/TID/schedstat``): the GIL alone, whatever else the machine runs.

Command::

    .venv/bin/python benchmarks/benchmark_default_staging.py --objects 2000
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from fastload.bench.components import small_objects_bench as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--objects", type=int, default=2000)
    args = parser.parse_args()
    config = bench.SmallObjectsBenchConfig(objects=args.objects, repeats=1)
    data = Path(args.out) / "data" / "default_staging"
    bench.generate(data / "remote", config)
    print(f"load average before: {os.getloadavg()}")
    with bench.start_server(data / "remote", "plain") as server:
        for listing in (True, False):
            for busy in (True, False):
                for name, process in (("default", None), ("in-process", False)):
                    scratch = data / "scratch"
                    shutil.rmtree(scratch, ignore_errors=True)
                    scratch.mkdir(parents=True)
                    spec = bench._spec(
                        server,
                        scratch,
                        staging_process=process,
                        list=listing,
                        busy=busy,
                        untimed_first=False,
                    )
                    (result,), run = bench._stage_in_children(server, [spec])
                    blocked = result.get("gil_blocked")
                    gil = (
                        ""
                        if blocked is None
                        else f"  GIL blocked {1000 * blocked / run.objects:.3f} ms/obj"
                    )
                    print(
                        f"{name:10} {'listing timed' if listing else 'staging alone':13} "
                        f"{'busy thread' if busy else 'alone':11} {run.objects} objects "
                        f"{result['wall']:.2f} s{gil}",
                        flush=True,
                    )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
