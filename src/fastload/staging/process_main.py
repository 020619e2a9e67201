"""The staging process itself (``python -m fastload.staging.process_main PARENT_PID``): it
opens its own cache and :class:`~fastload.staging.stager.Stager` and answers the parent's
rounds until its stdin closes (see :mod:`fastload.staging.process`)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import IO, Any

from fastload.cache import Cache
from fastload.manifest import Manifest
from fastload.staging.config import FetchConfig, StageResult
from fastload.staging.lifetime import PARENT_ENV, exit_with_parent, lifetime_set
from fastload.staging.process import error_message, receive, send
from fastload.staging.stager import Stager

_PROGRESS_EVERY_S = 0.1


class _Reporter:
    """Sends a round's progress to the parent, at most every _PROGRESS_EVERY_S."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._last = 0.0

    def __call__(self, done: Any) -> None:
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S:
            self._last = now
            message = ("progress", done.objects_done, done.bytes_done, done.fetched_bytes)
            send(self._stream, message)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # Importing fastload made this process end with its parent (staging.lifetime); a
    # parent that did not say so in the environment is watched by the pid it passed.
    if not lifetime_set():
        os.environ.setdefault(PARENT_ENV, f"{int(args[0])}:watch")
        exit_with_parent()
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the parent decides,
    # and ends this process by closing the pipe (or by dying).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the pipe
    settings = receive(stdin)
    if settings is None:
        return
    fs, root, cache_config, fetch = settings
    c = cache_config
    cache = Cache(
        c.cache_dir,
        max_bytes=c.max_bytes,
        policy=c.policy,
        budget_counts=c.budget_counts,
        lock_timeout_s=c.lock_timeout_s,
        fsync=c.fsync,
    )
    in_process: FetchConfig = fetch.in_process()
    send(stdout, ("ready",))  # started ahead, the parent stages in its threads until this
    while (request := receive(stdin)) is not None:
        _, manifest_url, objects, wants_progress = request
        manifest = Manifest(url=manifest_url, objects=(), listed_at=0.0)
        stager = Stager(cache=cache, manifest=manifest, fs=fs, root=root, config=in_process)
        try:
            results: list[StageResult] = stager.stage(
                objects, progress=_Reporter(stdout) if wants_progress else None
            )
        except BaseException as exc:  # handed to the parent, which raises it
            send(stdout, error_message(exc))
            continue
        answers = [(r.url, r.outcome, r.nbytes, r.attempts, r.error) for r in results]
        send(stdout, ("done", answers))
    cache.close()


if __name__ == "__main__":
    main()
