"""The stager: fetch a manifest's objects into the cache, concurrently and patiently.

One staging thread per request in flight does, object after object: cache hit? → take the
object's fetch lock (or wait while another process fetches it) → GET through the
transport (``fastload.remote``; obstore's GETs release the GIL) with retries,
exponential backoff and jitter → verify the size → write and publish. Threads rather than
an event loop: a GET through obstore costs ~0.3 ms of CPU from a thread and ~0.45 ms as an
awaited future, and no hand-off between a loop and a writer thread is needed. Concurrency
adapts to the remote: it halves when the remote throttles and grows back by one per window
of successes (AIMD, as TCP does); the throttle, the threads and the transport's connections
live for the process, across staging calls. An object the cache turns away (a full ``pin``
cache) is skipped, or, for a caller that will read it soon (a loader), fetched all the same
into a :class:`Holding` in memory, where its reads find it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec

from fastload.cache import Cache
from fastload.errors import FastloadError, MissingBackendError, RemoteChangedError, RemoteError
from fastload.manifest import Manifest, RemoteObject
from fastload.progress import Progress
from fastload.remote import (
    backoff_s,
    classify,
    clean_cause,
    integrity_error,
    is_throttling,
    is_transient,
    path_of,
    public_url,
    scrub,
    with_retries,
)
from fastload.remote.connect import transport_for
from fastload.remote.throttle import Throttle
from fastload.remote.transport import Buffer, Transport
from fastload.remote.versions import Pin, changed_error, pin_of
from fastload.staging import process as staging_process
from fastload.staging.config import FetchConfig, StageResult
from fastload.staging.holding import Holding
from fastload.staging.rounds import Round
from fastload.staging.throttle import throttle_for

# Objects staged here per chunk while a staging process starts up (then it is asked again).
_CHUNK_WHILE_STARTING = 256

# A forked child (a DataLoader worker) stages in its own threads, not in a staging process.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class Stager:
    """Brings a manifest's objects into a cache; see the module docstring."""

    cache: Cache
    manifest: Manifest
    fs: fsspec.AbstractFileSystem
    root: str
    config: FetchConfig = field(default_factory=FetchConfig)

    @property
    def transport(self) -> Transport:
        return transport_for(
            self.fs, self.config.timeout_s, fsspec_only=self.config.transport == "fsspec"
        )

    def remote_path(self, obj: RemoteObject) -> str:
        return path_of(self.fs, self.root, obj.key, obj.version)

    def failure(self, obj: RemoteObject, result: StageResult) -> RemoteError:
        """The error to raise for an object whose fetch failed after its retries."""
        error = RemoteError(5, f"{result.url} could not be fetched: {result.error}", result.url)
        error.reason = result.error or ""
        return error

    def stage(
        self,
        objects: Sequence[RemoteObject],
        *,
        progress: Callable[[Progress], None] | None = None,
        here: bool = False,
        hold: Holding | None = None,
        reads: Sequence[int] | None = None,
    ) -> list[StageResult]:
        """Fetches whatever of objects is not cached yet, in the given order of priority.

        A permanent failure (not found, access refused, full disk) stops everything and is
        raised; transient failures that outlast their retries are reported per object.
        ``here`` stages in this process even where a staging process would: for an object
        a reader is waiting for, which must not queue behind a round of staging ahead.
        By default (``FetchConfig.staging_process`` None) objects are staged here while
        the staging process starts up, a chunk at a time, then there; a process not
        started yet is started only for work it will get (:meth:`_start_if_used`).
        With ``hold``, what the cache turns away is fetched all the same and held there
        for ``reads[i]`` reads (1 each by default; 0: not held): outcome "held".
        """
        if not objects:
            return []
        tracker = Progress(callback=progress)
        if here or not self._elsewhere():
            return Round(self, objects, tracker, hold, reads).run()
        if self.config.staging_process:
            return self._there(objects, tracker, hold, reads)
        # The default: not where a pin budget turns objects away (the process would fetch
        # those only to drop them, and this one again); and while the process starts up,
        # here a chunk at a time, so nothing waits for it.
        c = self.cache.config
        if hold is not None and c.policy == "pin" and c.max_bytes is not None:
            return Round(self, objects, tracker, hold, reads).run()
        results: list[StageResult] = []
        process = self._staging_process()
        start = 0
        while start < len(objects) and not process.ready():
            end = start + _CHUNK_WHILE_STARTING
            if not process.started:
                self._start_if_used(process, objects[start:end], more=end < len(objects))
            chunk_reads = None if reads is None else reads[start:end]
            results += Round(self, objects[start:end], tracker, hold, chunk_reads).run()
            start = end
        if start < len(objects):
            rest_reads = None if reads is None else reads[start:]
            results += self._there(objects[start:], tracker, hold, rest_reads)
        return results

    def _start_if_used(
        self, process: staging_process.StagingProcess, chunk: Sequence[RemoteObject], *, more: bool
    ) -> None:
        """Starts the (default) staging process before ``chunk`` is staged here, where it
        will get work: the cache lacks some of the chunk and either more of this round
        follows it (the process starts up while this chunk is staged here), or rounds here
        have staged a chunk's worth of missing objects already. A cached round (a warm of
        what is cached) starts nothing, nor do a few large objects (a tar dataset's shards,
        whole Parquet files), which would all be staged here before it started up: its
        start-up costs 0.3-0.65 s of CPU, 2 ms of GIL per object staged here far less."""
        urls = [self.manifest.object_url(o) for o in chunk]
        missing = self.cache.count_missing(
            urls, [o.version for o in chunk], [o.size for o in chunk]
        )
        if not missing:
            return
        process.missing_staged_here += missing
        if more or process.missing_staged_here >= _CHUNK_WHILE_STARTING:
            process.start()

    def _there(
        self,
        objects: Sequence[RemoteObject],
        tracker: Progress,
        hold: Holding | None,
        reads: Sequence[int] | None,
    ) -> list[StageResult]:
        """Stages objects in the staging process (what it skips for ``hold``, here)."""
        results = self._stage_in_staging_process(objects, tracker)
        if hold is not None:
            self._hold_skipped(objects, results, hold, reads)
        return results

    def _hold_skipped(
        self,
        objects: Sequence[RemoteObject],
        results: list[StageResult],
        hold: Holding,
        reads: Sequence[int] | None,
    ) -> None:
        """Fetches into ``hold``, in this process, what the staging process skipped: it
        keeps no memory of this process's, so the bytes would cross the pipe otherwise."""
        skipped = [i for i, r in enumerate(results) if r.outcome == "skipped"]
        if not skipped:
            return
        held = Round(
            self,
            [objects[i] for i in skipped],
            Progress(),
            hold,
            None if reads is None else [reads[i] for i in skipped],
        ).run()
        for i, result in zip(skipped, held, strict=True):
            results[i] = result

    def _elsewhere(self) -> bool:
        """Whether to stage in a staging process: unless the config says this process, for
        remote objects, from a process that was not forked (a DataLoader worker stages in
        its own threads), and not for the ``plan`` policy's cache, whose eviction needs the
        access order this process holds."""
        return stages_elsewhere(self.fs, self.cache, self.config)

    def _staging_process(self) -> staging_process.StagingProcess:
        return staging_process.for_stager(self.fs, self.root, self.cache.config, self.config)

    def _stage_in_staging_process(
        self, objects: Sequence[RemoteObject], tracker: Progress
    ) -> list[StageResult]:
        process = self._staging_process()

        # After chunks staged here (while it started), its counts add to theirs.
        base = (tracker.objects_done, tracker.bytes_done, tracker.fetched_bytes)

        def progress(objects_done: int, bytes_done: int, fetched_bytes: int) -> None:
            tracker.objects_done = base[0] + objects_done
            tracker.bytes_done = base[1] + bytes_done
            tracker.fetched_bytes = base[2] + fetched_bytes
            tracker.report()

        answers = process.stage(
            objects, self.manifest.url, progress if tracker.callback is not None else None
        )
        results = [StageResult(*answer) for answer in answers]  # type: ignore[arg-type]
        if tracker.callback is not None:  # the exact totals (progress comes at most 10/s)
            tracker.objects_done = base[0] + len(results)
            tracker.bytes_done = base[1] + sum(r.nbytes for r in results)
            fetched = sum(r.nbytes for r in results if r.outcome == "fetched")
            tracker.fetched_bytes = base[2] + fetched
            tracker.report()
        return results

    def _get_with_retries(
        self, obj: RemoteObject, url: str, transport: Transport, throttle: Throttle
    ) -> tuple[Buffer | str, int]:
        """(the bytes, attempts), or (why it failed, attempts) once transient failures
        outlast the retries; raises a permanent failure."""
        attempts = 0
        while True:
            attempts += 1
            try:
                with throttle:
                    data = self._fetch(obj, url, transport)
                throttle.succeeded()
                return data, attempts
            except RemoteError as exc:
                if not is_transient(exc):
                    raise
                if is_throttling(exc):
                    throttle.throttled()
                if attempts > self.config.retries:
                    # The reason without the URL (the report lists it apart), e.g.
                    # "503 SlowDown (Please reduce your request rate.) after 9 attempts"
                    reason = exc.reason or scrub(exc.strerror or str(exc))
                    return f"{reason} after {attempts} attempts", attempts
                c = self.config
                time.sleep(backoff_s(attempts, c.backoff_s, c.backoff_max_s))

    def _fetch(self, obj: RemoteObject, url: str, transport: Transport) -> Buffer:
        """The object's bytes, every GET pinned at its listed version: an object changed on
        the remote since the listing raises RemoteChangedError before a byte of it reaches
        the cache."""
        path = self.remote_path(obj)
        size = obj.size
        pin = pin_of(obj.version, size)
        try:
            if size is not None and size > self.config.range_threshold_bytes:
                step = self.config.range_bytes
                parts = _range_pool().map(
                    lambda start: transport.get(path, start, min(start + step, size), pin),
                    range(0, size, step),
                )
                data: Buffer = b"".join(parts)
            else:
                data = transport.get(path, None, None, pin)
        except RemoteChangedError as exc:
            raise _with_pin(exc, url, pin) from None
        except FastloadError:
            raise
        except ImportError as exc:  # no retry brings a package: fail now, saying which
            raise MissingBackendError(
                f"fetching {public_url(url)} needs a package that is not installed "
                f"({exc}); install fastload's extra for its protocol, e.g. "
                '`pip install "fastload[s3]"` or `"fastload[http]"`'
            ) from None
        except Exception as exc:
            raise _with_pin(classify(exc, url), url, pin) from clean_cause(exc)
        if size is not None and len(data) != size:
            raise integrity_error(url, f"received {len(data)} bytes, expected {size}")
        expected_md5 = _md5_from_version(obj.version)
        if expected_md5 is not None and hashlib.md5(data).digest() != expected_md5:
            raise integrity_error(url, "MD5 does not match the one the remote advertised")
        return data

    def read_remote(self, obj: RemoteObject, start: int | None, end: int | None) -> bytes:
        """Bytes [start, end) of obj straight from the remote (what the cache turned away,
        or a byte range), retried like a staged fetch; a refusal for the request rate
        (S3's 503 SlowDown, the Hub's 429) cuts the remote's concurrency as it does there."""
        transport = self.transport
        throttle = throttle_for(transport, self.config)
        path = self.remote_path(obj)
        url = self.manifest.object_url(obj)
        pin = pin_of(obj.version, obj.size)

        def get() -> Buffer:
            try:
                with throttle:  # under the remote's AIMD limit, as staged fetches are
                    data = transport.get(path, start, end, pin)
            except Exception as exc:
                if is_throttling(classify(exc, url)):
                    throttle.throttled()
                raise
            throttle.succeeded()
            return data

        c = self.config
        try:
            return bytes(with_retries(get, url, retries=c.retries, base_s=c.backoff_s))
        except RemoteChangedError as exc:
            raise _with_pin(exc, url, pin) from None


def stages_elsewhere(fs: fsspec.AbstractFileSystem, cache: Cache, config: FetchConfig) -> bool:
    """Whether a stager of fs, cache and config stages in a staging process (see
    :meth:`Stager._elsewhere`)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return (
        not config.stages_in_process()
        and protocol not in ("file", "local")
        and cache.plan is None
        and not _forked
    )


def start_staging_process(
    fs: fsspec.AbstractFileSystem, root: str, cache: Cache, config: FetchConfig
) -> None:
    """Starts the staging process of a stager of these settings now, where its rounds will
    go to one, so its start-up (a fresh interpreter: a second or more) overlaps what comes
    before the first round (the listing, opening the dataset) instead of delaying it. Not
    for a ``plan`` cache: the loader (or warm) that sets its plan stages in this process."""
    if cache.config.policy != "plan" and stages_elsewhere(fs, cache, config):
        staging_process.for_stager(fs, root, cache.config, config).start()


def _with_pin(error: RemoteError, url: str, pin: Pin) -> RemoteError:
    """A RemoteChangedError that says what the listing gave (ETag, version, size)."""
    if isinstance(error, RemoteChangedError):
        return changed_error(public_url(url), pin, error.what)
    return error


_range_pools: dict[int, ThreadPoolExecutor] = {}
_range_pools_lock = threading.Lock()


def _range_pool() -> ThreadPoolExecutor:
    """Threads for the ranges of large objects (apart from the staging threads, which wait
    on them)."""
    with _range_pools_lock:
        pool = _range_pools.get(os.getpid())
        if pool is None:
            pool = _range_pools[os.getpid()] = ThreadPoolExecutor(
                32, thread_name_prefix="fastload-range"
            )
        return pool


def _md5_from_version(version: str | None) -> bytes | None:
    """The MD5 a backend vouches for (GCS md5Hash), if the manifest recorded one."""
    if not version:
        return None
    for part in version.split(";"):
        key, _, value = part.partition("=")
        if key == "md5Hash" and value:
            try:
                return base64.b64decode(value)
            except ValueError:
                return None
    return None
