"""Knobs, fault injection and request counters shared by the loopback test servers.

Both :class:`~fastload.testing.RangeHTTPServer` and :class:`~fastload.testing.S3Server`
inherit :class:`RemoteControls`, so tests drive them the same way: adjust latency and
bandwidth at runtime, queue faults for the next N requests, and read counters back.
:meth:`RemoteBehavior.realistic` is what object storage looks like from a training node:
a heavy-tailed time to first byte and now and then a burst of ``503 SlowDown``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from socket import socket as Socket
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "Admission",
    "Fault",
    "FaultKind",
    "RemoteBehavior",
    "RemoteControls",
    "RequestStats",
]

logger = logging.getLogger("fastload.testing")

# Without a bandwidth cap, bodies go out in chunks of this size.
_UNPACED_CHUNK = 256 * 1024
# With a cap, chunks are sized to about 1/50 s of transfer so pacing stays smooth.
_PACED_CHUNK_MIN = 1024
_PACED_CHUNK_MAX = 64 * 1024


_CLOSE_TIMEOUT_S = 5.0


class _Unset(enum.Enum):
    """Marks "not given" where None is a meaningful value (no bandwidth cap)."""

    UNSET = enum.auto()


# z of the 99th percentile of a normal distribution: a lognormal's p99 / median = exp(z * sigma).
_Z_P99 = 2.3263478740408408
# How many drawn latencies a server keeps for ``latency_draws`` (the latest ones).
_LATENCY_DRAWS_KEPT = 1 << 16


@dataclass(frozen=True, kw_only=True)
class RemoteBehavior:
    """How a loopback server behaves for every request (change it with ``set_behavior``).

    ``latency_s`` is slept before each response (time to first byte). With
    ``latency_p99_s`` each request draws its own latency from a lognormal distribution
    whose median is ``latency_s`` and whose 99th percentile is ``latency_p99_s``, from a
    generator seeded with ``seed`` (so the sequence of draws is the same on every run):
    real object storage has a heavy tail, and a loader that waits on its slowest GET
    shows it only against one.
    ``bandwidth_bytes_per_s`` caps each response body's send rate; it applies per
    response, which equals per connection because a connection carries one response at
    a time, so N parallel connections together get up to N times the cap. ``None`` means
    unlimited.
    ``slowdown_every_s`` / ``slowdown_for_s``: every ``slowdown_every_s`` seconds, counted
    from the first request after the behavior was set, every request for
    ``slowdown_for_s`` seconds is answered ``503 SlowDown``, as S3 answers a prefix over
    its request rate (so the first request meets a burst); they count as injected faults.
    """

    latency_s: float = 0.0
    latency_p99_s: float | None = None
    bandwidth_bytes_per_s: float | None = None
    slowdown_every_s: float | None = None
    slowdown_for_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.latency_p99_s is not None and not self.latency_p99_s >= self.latency_s > 0:
            raise ValueError(
                f"latency_p99_s needs 0 < latency_s <= latency_p99_s, got "
                f"latency_s={self.latency_s}, latency_p99_s={self.latency_p99_s}"
            )
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"bandwidth_bytes_per_s must be > 0 or None, got {self.bandwidth_bytes_per_s}"
            )
        if self.slowdown_every_s is not None and not (
            0 < self.slowdown_for_s <= self.slowdown_every_s
        ):
            raise ValueError(
                f"slowdown bursts need 0 < slowdown_for_s <= slowdown_every_s, got "
                f"{self.slowdown_for_s} every {self.slowdown_every_s}"
            )

    @classmethod
    def realistic(cls, *, seed: int = 0) -> RemoteBehavior:
        """S3 as a training node sees it: 20 ms to first byte at the median, 200 ms at
        p99, and 250 ms of ``503 SlowDown`` every 10 s."""
        return cls(
            latency_s=0.020,
            latency_p99_s=0.200,
            slowdown_every_s=10.0,
            slowdown_for_s=0.25,
            seed=seed,
        )

    @property
    def latency_sigma(self) -> float:
        """Sigma of the lognormal latency (0: every request waits ``latency_s``)."""
        if self.latency_p99_s is None:
            return 0.0
        return math.log(self.latency_p99_s / self.latency_s) / _Z_P99

    def latency_draws(self, count: int) -> list[float]:
        """The first ``count`` latencies a server with this behavior sleeps, in order."""
        rng = random.Random(self.seed)
        return [self._draw_latency(rng) for _ in range(count)]

    def _draw_latency(self, rng: random.Random) -> float:
        if self.latency_p99_s is None:
            return self.latency_s
        return rng.lognormvariate(math.log(self.latency_s), self.latency_sigma)


class FaultKind(enum.Enum):
    """What an injected fault does to the request it hits."""

    STATUS = "status"  # answer with an error status (S3 servers add an XML <Error> body)
    TRUNCATE = "truncate"  # advertise the full Content-Length, send half the body, close
    RESET = "reset"  # send nothing and reset the TCP connection (RST)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault, as handed to the server for the request it hits."""

    kind: FaultKind
    status: int = 500
    code: str | None = None  # S3 error code; None picks the usual one for ``status``


@dataclass(frozen=True)
class RequestStats:
    """A snapshot of a server's counters (paths are URL paths, percent-decoded, no query).

    ``bytes_sent`` counts response body bytes as they are handed to the socket (headers
    excluded; a write that fails midway still counts).
    Every request that reached the server is counted, including ones hit by a fault.
    """

    requests: Mapping[tuple[str, str], int]  # (method, path) -> count
    bytes_sent: int
    faults_injected: int

    @property
    def by_path(self) -> Mapping[str, int]:
        counts: Counter[str] = Counter()
        for (_, path), n in self.requests.items():
            counts[path] += n
        return MappingProxyType(dict(counts))

    @property
    def by_method(self) -> Mapping[str, int]:
        counts: Counter[str] = Counter()
        for (method, _), n in self.requests.items():
            counts[method] += n
        return MappingProxyType(dict(counts))

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def count(self, path: str | None = None, method: str | None = None) -> int:
        """Requests matching ``path`` exactly and/or ``method`` (None matches any)."""
        return sum(
            n
            for (m, p), n in self.requests.items()
            if (path is None or p == path) and (method is None or m == method.upper())
        )


class Admission(NamedTuple):
    """What a server does with one request: the behavior it answers with, the fault it
    hits (if any), and the latency to sleep first."""

    behavior: RemoteBehavior
    fault: Fault | None
    latency_s: float


_SLOWDOWN = Fault(kind=FaultKind.STATUS, status=503, code="SlowDown")


@dataclass
class _PendingFault:
    fault: Fault
    remaining: int
    path_contains: str | None
    methods: frozenset[str] | None

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.path_contains is None or self.path_contains in path


class RemoteControls:
    """Thread-safe knobs, fault queue and counters; the servers inherit this.

    Faults are consumed first-in first-out: each request takes the oldest queued fault
    whose filters match it, if any.
    """

    def __init__(self, behavior: RemoteBehavior | None = None) -> None:
        self._controls_lock = threading.Lock()
        self._behavior = behavior if behavior is not None else RemoteBehavior()
        self._faults: list[_PendingFault] = []
        self._requests: Counter[tuple[str, str]] = Counter()
        self._bytes_sent = 0
        self._faults_injected = 0
        # Random faults: each matching request fails with this probability.
        self._fault_rate = 0.0
        self._rate_faults: tuple[Fault, ...] = ()
        self._rate_methods: frozenset[str] | None = None
        self._rng = random.Random(0)
        self._start_behavior()
        # Set on close so sleeps for latency and bandwidth end at once instead of hanging.
        self._closing = threading.Event()

    # -- knobs -----------------------------------------------------------------------

    @property
    def behavior(self) -> RemoteBehavior:
        with self._controls_lock:
            return self._behavior

    def set_behavior(
        self,
        behavior: RemoteBehavior | None = None,
        *,
        latency_s: float | None = None,
        bandwidth_bytes_per_s: float | _Unset | None = _Unset.UNSET,
    ) -> RemoteBehavior:
        """Replace the behavior, or change single fields; returns the new behavior.

        ``set_behavior(latency_s=0.2)`` keeps the bandwidth cap;
        ``set_behavior(bandwidth_bytes_per_s=None)`` removes it. Requests already being
        answered keep the behavior they started with.
        """
        changes: dict[str, Any] = {}
        if latency_s is not None:
            changes["latency_s"] = latency_s
        if bandwidth_bytes_per_s is not _Unset.UNSET:
            changes["bandwidth_bytes_per_s"] = bandwidth_bytes_per_s
        with self._controls_lock:
            base = behavior if behavior is not None else self._behavior
            self._behavior = dataclasses.replace(base, **changes)
            self._start_behavior()
            return self._behavior

    def _start_behavior(self) -> None:
        """Restart the latency draws from the seed and the burst clock (lock held)."""
        self._latency_rng = random.Random(self._behavior.seed)
        self._latency_draws: deque[float] = deque(maxlen=_LATENCY_DRAWS_KEPT)
        self._bursts_from: float | None = None

    def latency_draws(self) -> list[float]:
        """The latencies drawn for requests since the behavior was last set (the latest
        65,536), in the order requests arrived: what the server slept, not the clock."""
        with self._controls_lock:
            return list(self._latency_draws)

    # -- faults ----------------------------------------------------------------------

    def fail_next(
        self,
        count: int = 1,
        status: int = 503,
        *,
        code: str | None = None,
        path_contains: str | None = None,
        methods: Collection[str] | None = None,
    ) -> None:
        """Answer the next ``count`` matching requests with HTTP ``status`` (4xx/5xx).

        ``code`` sets the S3 error code (default: 503 SlowDown, 500 InternalError,
        403 AccessDenied, 404 NoSuchKey); the plain HTTP server puts it in the body.
        """
        if not 400 <= status <= 599:
            raise ValueError(f"status must be a 4xx or 5xx code, got {status}")
        self._queue(
            Fault(kind=FaultKind.STATUS, status=status, code=code), count, path_contains, methods
        )

    def truncate_next(
        self,
        count: int = 1,
        *,
        path_contains: str | None = None,
        methods: Collection[str] | None = ("GET",),
    ) -> None:
        """Send only half the body of the next ``count`` matching responses, then close.

        Only GETs by default: HEAD responses have no body to cut short.
        """
        self._queue(Fault(kind=FaultKind.TRUNCATE), count, path_contains, methods)

    def reset_next(
        self,
        count: int = 1,
        *,
        path_contains: str | None = None,
        methods: Collection[str] | None = None,
    ) -> None:
        """Reset the connection (TCP RST, no response) for the next ``count`` matching requests."""
        self._queue(Fault(kind=FaultKind.RESET), count, path_contains, methods)

    def set_fault_rate(
        self,
        rate: float,
        faults: Collection[Fault] = (
            Fault(kind=FaultKind.STATUS, status=503),
            Fault(kind=FaultKind.STATUS, status=500),
            Fault(kind=FaultKind.TRUNCATE),
            Fault(kind=FaultKind.RESET),
        ),
        *,
        methods: Collection[str] | None = ("GET",),
        seed: int = 0,
    ) -> None:
        """Fail each matching request with probability ``rate``, with a fault drawn from
        ``faults`` (seeded, so a test sees the same sequence each run). Queued faults
        (``fail_next`` and friends) take precedence. ``rate=0`` turns this off."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], got {rate}")
        if rate and not faults:
            raise ValueError("a non-zero rate needs at least one fault to draw from")
        with self._controls_lock:
            self._fault_rate = rate
            self._rate_faults = tuple(faults)
            self._rate_methods = None if methods is None else frozenset(m.upper() for m in methods)
            self._rng = random.Random(seed)

    def clear_faults(self) -> None:
        with self._controls_lock:
            self._faults.clear()
            self._fault_rate = 0.0

    @property
    def pending_faults(self) -> int:
        """How many injected faults have not been consumed yet."""
        with self._controls_lock:
            return sum(f.remaining for f in self._faults)

    def _queue(
        self,
        fault: Fault,
        count: int,
        path_contains: str | None,
        methods: Collection[str] | None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if isinstance(methods, str):
            raise TypeError("methods must be a collection of method names, not one string")
        wanted = None if methods is None else frozenset(m.upper() for m in methods)
        with self._controls_lock:
            self._faults.append(_PendingFault(fault, count, path_contains, wanted))

    # -- counters --------------------------------------------------------------------

    def stats(self) -> RequestStats:
        """A snapshot of the counters."""
        with self._controls_lock:
            return RequestStats(
                requests=MappingProxyType(dict(self._requests)),
                bytes_sent=self._bytes_sent,
                faults_injected=self._faults_injected,
            )

    def reset_stats(self) -> None:
        """Zero the counters (queued faults and behavior stay)."""
        with self._controls_lock:
            self._requests.clear()
            self._bytes_sent = 0
            self._faults_injected = 0

    # -- for the servers ---------------------------------------------------------------

    def _on_request(self, method: str, path: str) -> Admission:
        """Count a request; return the behavior to apply, the fault it hits, if any, and
        the latency to sleep."""
        method = method.upper()
        with self._controls_lock:
            self._requests[(method, path)] += 1
            behavior = self._behavior
            latency_s = behavior._draw_latency(self._latency_rng)
            if behavior.latency_p99_s is not None:
                self._latency_draws.append(latency_s)
            fault = self._next_fault(method, path, behavior)
            if fault is not None:
                self._faults_injected += 1
            return Admission(behavior, fault, latency_s)

    def _next_fault(self, method: str, path: str, behavior: RemoteBehavior) -> Fault | None:
        """The fault a request hits: a queued one, a slowdown burst, a random one (lock held)."""
        for i, pending in enumerate(self._faults):
            if pending.matches(method, path):
                pending.remaining -= 1
                if pending.remaining == 0:
                    del self._faults[i]
                return pending.fault
        if behavior.slowdown_every_s is not None:
            now = time.monotonic()
            if self._bursts_from is None:
                self._bursts_from = now
            if (now - self._bursts_from) % behavior.slowdown_every_s < behavior.slowdown_for_s:
                return _SLOWDOWN
        if (
            self._fault_rate
            and (self._rate_methods is None or method in self._rate_methods)
            and self._rng.random() < self._fault_rate
        ):
            return self._rng.choice(self._rate_faults)
        return None

    def _count_sent(self, nbytes: int) -> None:
        with self._controls_lock:
            self._bytes_sent += nbytes

    def _stop_serving(self, server: ConnectionTrackingMixin, thread: threading.Thread) -> None:
        """Stops a server's loop and its connections without waiting on a stuck handler."""
        self._closing.set()  # wakes handlers sleeping for latency or bandwidth
        if thread.is_alive():
            server.shutdown()
        server.close_all_connections()
        server.server_close()
        thread.join(_CLOSE_TIMEOUT_S)

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless the server is closing; False means stop serving at once."""
        if seconds <= 0:
            return not self._closing.is_set()
        return not self._closing.wait(seconds)

    def _paced(self, chunks: Iterable[bytes], behavior: RemoteBehavior) -> Iterator[bytes]:
        """Re-chunk a body and pace it to the bandwidth cap, counting bytes as they go out.

        Raises ConnectionAbortedError if the server starts closing meanwhile.
        """
        rate = behavior.bandwidth_bytes_per_s
        if rate is None:
            size = _UNPACED_CHUNK
        else:
            size = int(min(_PACED_CHUNK_MAX, max(_PACED_CHUNK_MIN, rate / 50)))
        started = time.monotonic()
        sent = 0
        for chunk in chunks:
            view = memoryview(chunk)
            for offset in range(0, len(view), size):
                piece = view[offset : offset + size]
                if rate is not None:
                    # Wait until the bytes already sent plus this piece fit the budget.
                    due = started + (sent + len(piece)) / rate
                    if not self._sleep(due - time.monotonic()):
                        raise ConnectionAbortedError("server is closing")
                # Count before handing the piece over, so a client that has the bytes
                # never sees a counter that lags behind.
                self._count_sent(len(piece))
                sent += len(piece)
                yield bytes(piece)


def set_reset_on_close(sock: socket.socket) -> None:
    """Make closing ``sock`` send a TCP RST instead of a FIN (SO_LINGER with timeout 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class ConnectionTrackingMixin(socketserver.BaseServer):
    """For threaded socketservers: never block on close, kill open connections, send RSTs.

    Mixed in before the server class. ``process_request`` runs on the serving thread and
    ``shutdown_request`` on the handler thread when it is done with a connection.
    """

    # Like object storage, accept bursts of hundreds of connections; the default backlog
    # of 5 makes the kernel drop SYNs and clients stall for seconds in retransmits.
    request_queue_size = 1024

    socket: Socket  # the listening socket, as on socketserver.TCPServer
    daemon_threads = True
    block_on_close = False  # close() must never wait for a handler stuck on a client

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connections: set[Socket] = set()
        self._to_reset: set[Socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def reset_connection(self, sock: Socket) -> None:
        """Abort ``sock`` with an RST once its handler finishes (instead of a clean FIN)."""
        set_reset_on_close(sock)
        with self._connections_lock:
            self._to_reset.add(sock)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
            abort = request in self._to_reset
            self._to_reset.discard(request)
        if abort:
            # Skip the usual shutdown(SHUT_WR): a FIN before the RST reads as a clean EOF.
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def close_all_connections(self) -> None:
        """Shut down every open connection so idle keep-alive handlers exit now."""
        with self._connections_lock:
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints tracebacks to stderr; tests read them from logging instead.
        logger.debug("error while serving %s", client_address, exc_info=True)
