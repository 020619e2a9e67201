"""Staging in a process of its own, so the training process's GIL stays with the training step.

Beside a training step that holds the GIL, staging threads in the same process wait out
the interpreter's switch interval (5 ms) at every hand-off: 24 small objects/s where 2,000
are possible. A staging process has a GIL of its own. The training process hands it a
round (the objects to stage) over a pipe and blocks reading the answer, which releases its
GIL; a round costs one message each way, whatever its number of objects. The default for
remote datasets (``FetchConfig.staging_process``; ``False`` stages in this process,
``True`` always there, started as the store lists the dataset), started only where it will
be used: by ``open_dataset`` before the listing for a format whose rounds bring many small
objects (a file folder: :meth:`StagingProcess.start`), so the listing hides the fresh
interpreter's start-up (0.3-0.65 s of CPU); otherwise by the first staging round that
misses more than a chunk of objects (``Stager.stage``), overlapping it. Not for a cached
warm, nor tar shards or Parquet files (a few large objects: all staged here before it
would start), nor a ``plan`` cache whose plan keeps staging in this process. Its first
message says it is ready (:meth:`StagingProcess.ready`), and until then staging goes on
in this process's threads a chunk at a time, as a batch waiting for its own objects always
does (``here=True``): nothing waits for the start-up.

The process is a fresh interpreter (``python -m fastload.staging.process_main``), so nothing
of the parent's state, obstore's runtime included, is inherited. It is told the filesystem
(pickled: the storage options travel over the pipe, never through a file or the command
line) and the cache settings, opens its own cache handle and
:class:`~fastload.staging.stager.Stager` and answers rounds until its stdin closes. It dies
with its parent (:mod:`fastload.staging.lifetime`; and at the pipe's end) and ignores the
SIGINT and SIGTERM sent to the whole job: the parent ends it. A failure
comes back as the error's class, errno, text and URL and is raised in the parent as the same
class. Nothing is shared but the cache on disk, with its locks, as between any two processes
that use it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

import fsspec

from fastload import errors
from fastload.cache import CacheConfig
from fastload.manifest import RemoteObject
from fastload.remote import scrub
from fastload.staging.child_pipe import readable_within
from fastload.staging.lifetime import env_for_child

_HEADER = struct.Struct("!Q")
_MOST_STARTS = 3  # processes ready() starts at most (then rounds start them, or stage here)
_IDLE_EXIT_S = 0.5  # a staging process between rounds is killed if it takes longer to exit


def send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    """The next message, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def error_message(exc: BaseException) -> tuple[Any, ...]:
    """An exception as the parent rebuilds it: fastload's own classes keep their class,
    errno, text, URL and remote fields; anything else arrives as a RuntimeError."""
    if isinstance(exc, errors.FastloadError) and isinstance(exc, OSError):
        fields = {k: getattr(exc, k, None) for k in ("status", "code", "reason", "what")}
        return ("error", type(exc).__name__, exc.errno, exc.strerror, exc.filename, fields)
    text = f"the staging process failed: {type(exc).__name__}: {scrub(str(exc))}"
    return ("error", "RuntimeError", None, text, None, {})


def _rebuild(
    name: str, errno_: int | None, text: str, url: str | None, fields: dict[str, Any]
) -> BaseException:
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.FastloadError) and issubclass(cls, OSError):
        error = cls(errno_, text, url) if url is not None else cls(errno_, text)
        for key, value in fields.items():
            if value is not None:
                setattr(error, key, value)
        return error
    return RuntimeError(text)


class StagingProcess:
    """The parent's handle on one staging process (see the module docstring)."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, root: str, cache: CacheConfig, fetch: Any
    ) -> None:
        self._settings = (fs, root, cache, fetch)
        self._lock = threading.Lock()  # one round at a time
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False  # whether the process said it is ready (its first message)
        self._starts = 0  # by ready(), which a process that keeps dying must not loop on
        self._wanted = False  # started once (start() or a round): ready() starts it again
        # Objects the cache lacked that the default mode staged here while this process was
        # not started (the stager starts it once they come to a chunk's worth).
        self.missing_staged_here = 0

    @property
    def started(self) -> bool:
        """Whether the process was ever started (by :meth:`start` or a round)."""
        return self._wanted

    def ready(self) -> bool:
        """Whether the process is running and has started up (never waits: a process still
        importing, or busy with a round, is not ready). One never started is not: only
        :meth:`start` and a round start it; one that ended is started again here."""
        if not self._wanted or not self._lock.acquire(blocking=False):
            return False
        try:
            process = self._process
            if process is not None and process.poll() is not None:
                _discard(process)  # ended (killed): start another, a bounded number of times
                self._process = process = None
            if process is None:
                if self._starts < _MOST_STARTS:
                    self._starts += 1
                    self._process, self._ready = self._start(), False
                return False
            assert process.stdout is not None
            if not self._ready and readable_within(process.stdout, 0):
                self._ready = receive(process.stdout) == ("ready",)
            return self._ready
        finally:
            self._lock.release()

    def start(self) -> None:
        """Starts the process now if it is not running (a round otherwise starts it): it
        imports and opens the cache while this process does something else."""
        with self._lock:
            self._wanted = True
            if self._process is None:
                self._process = self._start()
                self._ready = False

    def _start(self) -> subprocess.Popen[bytes]:
        # The child imports this very fastload, however the parent found it.
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(errors.__file__)))
        path = os.environ.get("PYTHONPATH")
        env = env_for_child(
            {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, path]))}
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "fastload.staging.process_main", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert process.stdin is not None
        with contextlib.suppress(OSError):  # it ended already: the round finds out and says so
            send(process.stdin, self._settings)
        return process

    def stage(
        self,
        objects: Sequence[RemoteObject],
        manifest_url: str,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> list[tuple[str, str, int, int, str | None]]:
        """Stages objects in the process; the results as (url, outcome, nbytes, attempts,
        error) tuples. progress(objects_done, bytes_done, fetched_bytes) is called as
        batches finish."""
        with self._lock:
            self._wanted = True
            for attempt in (1, 2):  # a round is idempotent: a new process may redo it
                if self._process is not None and self._process.poll() is not None:
                    _discard(self._process)  # ended between rounds (killed): start another
                    self._process = None
                if self._process is None:
                    self._process = self._start()
                    self._ready = False
                process = self._process
                try:
                    answer = self._round(process, objects, manifest_url, progress)
                except BaseException:  # interrupted mid-message: this pipe is out of step
                    _discard(process)
                    self._process = None
                    raise
                if isinstance(answer, BaseException):
                    raise answer
                if answer is not None:
                    return answer
                _discard(process)
                self._process = None
                if attempt == 2:
                    raise errors.CacheError(
                        5,
                        f"the staging process ended twice during one round (last exit status "
                        f"{process.returncode}); see its stderr above, or stage in this "
                        "process with FetchConfig(staging_process=False)",
                    )
            raise AssertionError("unreachable")

    @staticmethod
    def _round(
        process: subprocess.Popen[bytes],
        objects: Sequence[RemoteObject],
        manifest_url: str,
        progress: Callable[[int, int, int], None] | None,
    ) -> list[tuple[str, str, int, int, str | None]] | BaseException | None:
        """One round's answer (the results, or the error to raise), or None if the process
        ended first."""
        assert process.stdin is not None
        assert process.stdout is not None
        try:
            send(process.stdin, ("stage", manifest_url, list(objects), progress is not None))
        except OSError:
            return None
        while (message := receive(process.stdout)) is not None:
            kind = message[0]
            if kind == "ready":  # its start-up, if ready() did not read it
                continue
            if kind == "progress" and progress is not None:
                progress(*message[1:])
            elif kind == "done":
                results: list[tuple[str, str, int, int, str | None]] = message[1]
                return results
            elif kind == "error":
                return _rebuild(*message[1:])
        return None

    def close(self, wait_s: float = 10.0) -> None:
        """Ends the process (it exits when its stdin closes, or is killed after wait_s).
        Without the round lock: a round may be waiting on the remote for a long time."""
        process, self._process = self._process, None
        if process is not None:
            # Between rounds (or still starting: started ahead, it may never have had one)
            # it has nothing to finish, so an exit does not wait out its start-up.
            idle = self._lock.acquire(blocking=False)
            if idle:
                self._lock.release()
            _discard(process, min(wait_s, _IDLE_EXIT_S) if idle else wait_s)


def _discard(process: subprocess.Popen[bytes], wait_s: float = 10.0) -> None:
    """Ends a staging process: closes its stdin (it exits between rounds), kills it after
    wait_s, reaps it, then closes its stdout (only then: a round may be reading it)."""
    with contextlib.suppress(OSError):  # a broken pipe: the process is gone already
        if process.stdin is not None:
            process.stdin.close()
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


_processes: dict[tuple[int, int, str, Any, Any], StagingProcess] = {}
_processes_lock = threading.Lock()


def for_stager(
    fs: fsspec.AbstractFileSystem, root: str, cache: CacheConfig, fetch: Any
) -> StagingProcess:
    """This process's staging process for these settings (started at its first round)."""
    key = (os.getpid(), id(fs), root, cache, fetch)
    with _processes_lock:
        process = _processes.get(key)
        if process is None:
            process = _processes[key] = StagingProcess(fs, root, cache, fetch)
        return process


@atexit.register
def close_all() -> None:
    """Closes this process's staging processes (at exit; a test at its end). A later round
    starts a new one."""
    with _processes_lock:
        mine = [p for (pid, *_), p in _processes.items() if pid == os.getpid()]
    for process in mine:  # a process mid-round would finish it first: exit promptly
        process.close(wait_s=1.0)
