"""The loader's state written when the job is told to stop: a Spot/preemptible node gets
SIGTERM (AWS up to 120 s, GKE ~30 s before SIGKILL), and a restart that resumes from the
last consumed step costs seconds instead of a replayed epoch.

Installed only when asked (``fl.DataLoader(..., on_preempt=path)``), in the main thread,
chained to whatever handler was there: the state is written first (a few KB of JSON,
atomically: a unique file beside ``path``, created exclusively, then renamed over it), then
the previous handler runs, so the script's own checkpoint still runs. Nothing of the
loader is stopped: its threads and any staging process live until the process exits, and
the default action (exit) is taken only where no handler of the script's was there.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from fastload.safe_files import write_atomically

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionHandler:
    """SIGTERM → ``state()`` written to ``path`` as JSON, then the previous handler."""

    def __init__(
        self, path: str | os.PathLike[str], state: Callable[[], dict[str, Any] | None]
    ) -> None:
        self.path = Path(path)
        self._state = state
        self._previous: Handler = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "on_preempt installs a SIGTERM handler, which Python allows only in the main "
                "thread: create the DataLoader there (or write loader.state_dict() yourself)"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        """Puts the previous handler back, if this one is still the current one."""
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def write(self) -> None:
        state = self._state()
        if state is not None:  # None: the loader is gone, and so is what it would say
            write_atomically(self.path, json.dumps(state).encode(), fsync=True)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.write()
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            # What would have happened without us: the process ends (its threads with it).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
