"""Child processes that end with their parent, however the parent ends.

A parent killed with SIGKILL (a test's timeout, the OOM killer, a scheduler) runs no
cleanup: its children, and the forkserver and loader workers they started, were found
running 40 minutes later. The parent puts :func:`env_for_child` into a child's environment;
the child calls :func:`exit_with_parent` first thing. On Linux the kernel then sends the
child SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) — but that signal follows the
*thread* that started the child, so a child started from any other thread than the main
one (which may end long before the process) is watched by a thread of its own instead,
which polls ``os.getppid()``. Either way the child's own children go next: the forkserver
sees its client gone and exits, and torch's loader workers watch their parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["PARENT_ENV", "env_for_child", "exit_with_parent", "lifetime_set"]

PARENT_ENV = "FASTLOAD_PARENT"
"""``PID:signal`` (started from the parent's main thread) or ``PID:watch``."""

_PR_SET_PDEATHSIG = 1
_WATCH_EVERY_S = 0.5
_set = False  # exit_with_parent took effect in this process


def env_for_child(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with what :func:`exit_with_parent`
    reads in the child, for a child started from the calling thread."""
    main = threading.current_thread() is threading.main_thread()
    how = "signal" if main and sys.platform.startswith("linux") else "watch"
    return {**(os.environ if env is None else env), PARENT_ENV: f"{os.getpid()}:{how}"}


def exit_with_parent() -> None:
    """Makes this process end when the parent named in its environment does (nothing when
    it names none). Exits at once if that parent is gone already."""
    value = os.environ.pop(PARENT_ENV, "")  # popped: this process's own children get their own
    pid_text, _, how = value.partition(":")
    if not pid_text.isdigit():
        return
    global _set
    parent, _set = int(pid_text), True
    if how == "signal":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            how = "watch"
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    if how != "signal":
        threading.Thread(
            target=_watch, args=(parent,), name="fastload-parent-watch", daemon=True
        ).start()


def lifetime_set() -> bool:
    """Whether :func:`exit_with_parent` tied this process to its parent."""
    return _set


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_EVERY_S)
    os._exit(1)
