"""The AIMD throttle of a remote, as staging configures it (the throttle itself is
``fastload.remote.throttle``: listings share it)."""

from __future__ import annotations

from fastload.remote.throttle import Throttle as _RemoteThrottle
from fastload.remote.throttle import throttle_of
from fastload.remote.transport import Transport
from fastload.staging.config import FetchConfig


class Throttle(_RemoteThrottle):
    """A throttle made from a FetchConfig (jobs at most, min_jobs at least)."""

    def __init__(self, config: FetchConfig) -> None:
        super().__init__(config.jobs, config.min_jobs)


def throttle_for(transport: Transport, config: FetchConfig) -> _RemoteThrottle:
    """The throttle of transport's remote in this process."""
    return throttle_of(transport, config.jobs, config.min_jobs)
