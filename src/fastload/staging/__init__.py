"""The stage stage: fetch the objects a plan needs into the cache, concurrently and patiently.

:mod:`.config` (``FetchConfig``, ``StageResult``), :mod:`.stager` (``Stager``: what to fetch,
retries, range reads), :mod:`.rounds` (one staging call on this process's GET threads),
:mod:`.throttle` (AIMD per remote), :mod:`.holding` (what a full cache turned away, kept
in memory until read), :mod:`.process` and :mod:`.process_main` (staging in a process of
its own, so the training process's GIL stays with the step).
"""

from __future__ import annotations

from fastload.staging.config import FetchConfig, Outcome, StageResult
from fastload.staging.holding import Holding
from fastload.staging.stager import Stager

__all__ = ["FetchConfig", "Holding", "Outcome", "StageResult", "Stager"]
