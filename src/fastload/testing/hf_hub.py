"""A loopback Hugging Face Hub: a local folder served as a dataset repository through the
HTTP API that ``huggingface_hub.HfFileSystem`` speaks, for tests of ``hf://`` URLs.

What it answers (the routes huggingface_hub 1.x and 2.x call; see ``hf_api.py`` and
``hf_file_system.py``):

- ``GET /api/datasets/{repo}`` and ``.../revision/{rev}``: the repository's info, its
  ``sha`` the commit the revision points to;
- ``GET /api/datasets/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: the tree, paginated
  as the Hub does (a ``Link: <...>; rel="next"`` header) past ``page_size`` entries;
- ``POST /api/datasets/{repo}/paths-info/{rev}`` (form fields ``paths``, ``expand``);
- ``GET``/``HEAD /datasets/{repo}/resolve/{rev}/{path}``: the file, with byte ranges (206),
  ``ETag``, ``X-Repo-Commit``, ``Content-Length`` and ``Accept-Ranges``; no Xet headers,
  so huggingface_hub never turns to hf_xet.

The folder's contents are read into memory as one commit when the server starts;
:meth:`HubServer.commit` reads it again as a new commit on ``main`` (the old commits stay
readable by their SHA). Started with a token, every request must carry
``Authorization: Bearer <token>`` (401 otherwise, as the Hub answers). Faults, each for the
next n requests (of one kind, whose path contains a string, if given): ``fail_next``
answers an error status with the Hub's ``X-Error-Code`` and ``X-Error-Message`` headers,
``throttle_next`` a 429 with ``Retry-After``, ``reset_next`` resets the connection (a TCP
RST, no answer); ``set_latency`` delays every answer (of one kind). ``stats()`` counts
requests by kind.

:class:`HubServerProcess` runs one in a process of its own (``python -m
fastload.testing.hf_hub``) and drives it over ``/_fastload/...`` control routes.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.testing.faults import ConnectionTrackingMixin
from fastload.testing.process import ChildServer

__all__ = ["HubServer", "HubServerProcess"]

_CONTROL = "/_fastload/"
_TOKEN_ENV = "FASTLOAD_TEST_HUB_TOKEN"
_MAIN = "import sys; from fastload.testing.hf_hub import main; main(sys.argv[1:])"
_API = re.compile(r"^/api/datasets/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# The kinds of request the server tells apart (for faults and ``stats()``).
_KINDS = ("repo_info", "tree", "paths_info", "resolve")
_RATE_LIMITED = "You have been rate-limited; retry later."


@dataclass
class _Fault:
    """A fault for the next ``remaining`` requests that match: an error status with its
    headers, or (status None) a reset connection."""

    status: int | None
    headers: dict[str, str]
    remaining: int
    kind: str | None
    path_contains: str | None

    def matches(self, kind: str, path: str) -> bool:
        return self.kind in (None, kind) and (
            self.path_contains is None or self.path_contains in path
        )


class _HTTPServer(ConnectionTrackingMixin, http.server.ThreadingHTTPServer):
    """Resets a connection on demand, and drops every open one when it closes."""


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: dict[str, tuple[bytes, str]]  # path -> (bytes, git blob oid)

    def folders(self) -> set[str]:
        found = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                found.add("/".join(parts[:i]))
        return found

    def entry(self, path: str) -> dict[str, Any] | None:
        if path in self.files:
            data, oid = self.files[path]
            return {"type": "file", "oid": oid, "size": len(data), "path": path}
        if path in self.folders():
            oid = hashlib.sha1(f"tree {self.sha} {path}".encode()).hexdigest()
            return {"type": "directory", "oid": oid, "path": path}
        return None

    def tree(self, path: str, recursive: bool) -> list[dict[str, Any]] | None:
        """Entries below folder path ("" the root), or None where it is not a folder."""
        if path and path not in self.folders():
            return None
        prefix = f"{path}/" if path else ""
        names = sorted(p for p in (*self.files, *self.folders()) if p.startswith(prefix))
        if not recursive:
            names = [n for n in names if "/" not in n[len(prefix) :]]
        return [e for n in names if (e := self.entry(n)) is not None]


class HubServer:
    """The loopback Hub in this process's threads (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        repo_id: str = "fastload/demo",
        token: str | None = None,
        page_size: int = 1000,
    ) -> None:
        self.root = Path(root)
        self.repo_id = repo_id
        self.token = token
        self.page_size = page_size
        self._lock = threading.Lock()
        self._commits: dict[str, _Commit] = {}
        self._main = ""
        self._faults: list[_Fault] = []
        self._latency_s = 0.0
        self._latency_kind: str | None = None
        self._closing = threading.Event()  # wakes the answers waiting out a latency
        self._counts: Counter[str] = Counter()
        self.commit()
        self._httpd = _HTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._httpd.server_address[:2]
        self.endpoint = f"http://{host!s}:{port}"

    # --- control ------------------------------------------------------------------------

    def commit(self) -> str:
        """Reads the folder again as a new commit on main; returns its SHA."""
        files = {}
        for path in sorted(self.root.rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                files[path.relative_to(self.root).as_posix()] = (data, _git_blob_oid(data))
        digest = hashlib.sha1(f"{self._main}:{len(self._commits)}".encode())
        for name, (_, oid) in files.items():
            digest.update(f"{name}\0{oid}\n".encode())
        sha = digest.hexdigest()
        with self._lock:
            self._commits[sha] = _Commit(sha, files)
            self._main = sha
        return sha

    @property
    def head(self) -> str:
        return self._main

    def fail_next(
        self,
        count: int,
        status: int,
        *,
        code: str | None = None,
        message: str | None = None,
        retry_after: int | None = None,
        kind: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Answers the next count requests (of kind only, if given: "repo_info", "tree",
        "paths_info", "resolve"; whose path contains path_contains, if given) status, with
        code and message in ``X-Error-Code`` and ``X-Error-Message`` (and a JSON body) as the
        Hub sends them, and ``Retry-After`` if given. Faults queue: a request takes the
        oldest one that matches."""
        if not 400 <= status <= 599:
            raise ValueError(f"status must be a 4xx or 5xx code, got {status}")
        headers = {}
        if message is not None:
            headers["X-Error-Message"] = message
        if code is not None:
            headers["X-Error-Code"] = code
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        self._queue(_Fault(status, headers, count, kind, path_contains))

    def throttle_next(self, count: int, *, retry_after: int = 1, kind: str | None = None) -> None:
        """Answers the next count requests (of kind only, if given) 429 Too Many Requests
        with ``Retry-After``, as the Hub rate-limits."""
        self.fail_next(count, 429, message=_RATE_LIMITED, retry_after=retry_after, kind=kind)

    def reset_next(
        self, count: int, *, kind: str | None = None, path_contains: str | None = None
    ) -> None:
        """Resets the connection of the next count requests that match (see
        :meth:`fail_next`) without an answer."""
        self._queue(_Fault(None, {}, count, kind, path_contains))

    def set_latency(self, seconds: float, *, kind: str | None = None) -> None:
        """Waits seconds before answering every request (of kind only, if given)."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        with self._lock:
            self._latency_s, self._latency_kind = seconds, kind

    def _queue(self, fault: _Fault) -> None:
        if fault.remaining < 1:
            raise ValueError(f"count must be >= 1, got {fault.remaining}")
        if fault.kind is not None and fault.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS} or None, got {fault.kind!r}")
        with self._lock:
            self._faults.append(fault)

    def stats(self) -> dict[str, int]:
        """Requests by kind (``upload``: a POST or PUT that would write to the repository,
        which this server never does), and ``throttled`` (429s sent), ``unauthorized`` (401s sent),
        ``faults`` (the other injected faults: statuses and resets)."""
        with self._lock:
            return dict(self._counts)

    def reset_stats(self) -> None:
        with self._lock:
            self._counts.clear()

    def close(self) -> None:
        self._closing.set()
        self._httpd.shutdown()
        self._httpd.close_all_connections()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- requests -----------------------------------------------------------------------

    def _admit(
        self, kind: str, path: str, authorization: str | None
    ) -> tuple[int | None, dict[str, str]] | None:
        """None to answer the request, else the error status and headers to send (status
        None: reset the connection). Waits out the latency first."""
        with self._lock:
            self._counts[kind] += 1
            latency_s = self._latency_s if self._latency_kind in (None, kind) else 0.0
        if latency_s > 0 and self._closing.wait(latency_s):
            return None, {}  # closing: no answer
        with self._lock:
            if self.token is not None and authorization != f"Bearer {self.token}":
                self._counts["unauthorized"] += 1
                if authorization is None:
                    return 401, {
                        "X-Error-Code": "RepoNotFound",
                        "X-Error-Message": "Invalid username or password.",
                    }
                return 401, {"X-Error-Message": "Invalid credentials in Authorization header"}
            for i, fault in enumerate(self._faults):
                if fault.matches(kind, path):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        del self._faults[i]
                    self._counts["throttled" if fault.status == 429 else "faults"] += 1
                    return fault.status, fault.headers
        return None

    def _revision(self, revision: str) -> _Commit | None:
        revision = urllib.parse.unquote(revision)
        with self._lock:
            sha = self._main if revision == "main" else revision
            return self._commits.get(sha)


def _handler_for(hub: HubServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "fastload-test-hub"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the client's side is what the tests watch

        def _send(
            self, status: int, body: bytes = b"", headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(value).encode()
            self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, headers: dict[str, str]) -> None:
            message = headers.get("X-Error-Message", http.HTTPStatus(status).phrase)
            self._json(status, {"error": message}, headers)

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_POST(self) -> None:
            self.do_GET()

        def do_PUT(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            parts = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(parts.query)
            body = self._body() if self.command == "POST" else b""
            if parts.path.startswith(_CONTROL):
                self._control(parts.path[len(_CONTROL) :], query)
                return
            api = _API.match(parts.path)
            resolve = _RESOLVE.match(parts.path)
            kind = "other"
            if api is not None:
                kind = {None: "repo_info", "revision": "repo_info", "tree": "tree"}.get(
                    api.group(2), "paths_info"
                )
            elif resolve is not None:
                kind = "resolve"
            if self.command in ("POST", "PUT") and kind != "paths_info":
                kind = "upload"  # preupload, commit, LFS: a write to the repository
            refused = hub._admit(
                kind, urllib.parse.unquote(parts.path), self.headers.get("Authorization")
            )
            if refused is not None:
                status, headers = refused
                if status is None:
                    self.close_connection = True
                    assert isinstance(self.server, _HTTPServer)
                    self.server.reset_connection(self.connection)
                else:
                    self._error(status, headers)
                return
            found = api or resolve
            repo = found.group(1) if found is not None else None
            if repo is None or urllib.parse.unquote(repo) != hub.repo_id:
                self._error(
                    404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}
                )
                return
            if resolve is not None:
                self._resolve(resolve.group(2), urllib.parse.unquote(resolve.group(3)))
                return
            assert api is not None
            commit = hub._revision(api.group(3) or "main")
            if commit is None:
                self._error(
                    404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
                )
                return
            if kind == "repo_info":
                self._json(
                    200,
                    {
                        "id": hub.repo_id,
                        "sha": commit.sha,
                        "private": hub.token is not None,
                        "siblings": [{"rfilename": p} for p in sorted(commit.files)],
                        "tags": [],
                    },
                )
            elif kind == "tree":
                path = urllib.parse.unquote(api.group(4) or "").strip("/")
                self._tree(commit, path, query, parts.path)
            else:
                form = urllib.parse.parse_qs(body.decode())
                infos = [commit.entry(p.strip("/")) for p in form.get("paths", [])]
                self._json(200, [e for e in infos if e is not None])

        def _tree(
            self, commit: _Commit, path: str, query: dict[str, list[str]], route: str
        ) -> None:
            recursive = (query.get("recursive") or ["False"])[0].lower() == "true"
            entries = commit.tree(path, recursive)
            if entries is None:
                self._error(
                    404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}
                )
                return
            cursor = int((query.get("cursor") or ["0"])[0])
            page = entries[cursor : cursor + hub.page_size]
            headers = {}
            if cursor + hub.page_size < len(entries):
                nxt = urllib.parse.urlencode(
                    {"recursive": recursive, "expand": False, "cursor": cursor + hub.page_size}
                )
                headers["Link"] = f'<{hub.endpoint}{route}?{nxt}>; rel="next"'
            self._json(200, page, headers)

        def _resolve(self, revision: str, path: str) -> None:
            commit = hub._revision(revision)
            if commit is None:
                self._error(
                    404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}
                )
                return
            if path not in commit.files:
                self._error(
                    404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}
                )
                return
            data, oid = commit.files[path]
            headers = {
                "Content-Type": "application/octet-stream",
                "Accept-Ranges": "bytes",
                "ETag": f'"{oid}"',
                "X-Repo-Commit": commit.sha,
            }
            wanted = self.headers.get("Range")
            match = _RANGE.match(wanted.strip()) if wanted else None
            if match is None or not (match.group(1) or match.group(2)):
                self._send(200, data, headers)
                return
            size = len(data)
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)) + 1, size) if match.group(2) else size
            else:
                start, end = max(0, size - int(match.group(2))), size
            if start >= size or start >= end:
                self._send(416, b"", {"Content-Range": f"bytes */{size}"})
                return
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            self._send(206, data[start:end], headers)

        def _control(self, action: str, query: dict[str, list[str]]) -> None:
            try:
                self._act(action, {name: values[0] for name, values in query.items()})
            except ValueError as exc:  # a bad argument: the caller's to fix
                self._json(400, {"error": str(exc)})

        def _act(self, action: str, args: dict[str, str]) -> None:
            count = int(args.get("count", "1"))
            kind, path_contains = args.get("kind"), args.get("path_contains")
            if action == "stats":
                self._json(200, hub.stats())
            elif action == "reset":
                hub.reset_stats()
                self._json(200, {})
            elif action == "commit":
                self._json(200, {"sha": hub.commit()})
            elif action == "fail":
                retry_after = args.get("retry_after")
                hub.fail_next(
                    count,
                    int(args.get("status", "500")),
                    code=args.get("code"),
                    message=args.get("message"),
                    retry_after=None if retry_after is None else int(retry_after),
                    kind=kind,
                    path_contains=path_contains,
                )
                self._json(200, {})
            elif action == "reset_next":
                hub.reset_next(count, kind=kind, path_contains=path_contains)
                self._json(200, {})
            elif action == "latency":
                hub.set_latency(float(args.get("seconds", "0")), kind=kind)
                self._json(200, {})
            else:
                self._send(404)

    return Handler


class HubServerProcess(ChildServer):
    """A :class:`HubServer` serving ``root`` as the dataset repository ``repo_id`` from a
    child process; ``close()`` stops it. ``url_for(path)`` is the ``hf://`` URL of a path
    in the repository; ``storage_options`` (the endpoint and token) reach it from this
    process, ``env`` (``HF_ENDPOINT``, ``HF_TOKEN``) from a ``fastload`` script."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        repo_id: str = "fastload/demo",
        token: str | None = None,
        page_size: int = 1000,
    ) -> None:
        self.repo_id = repo_id
        self.token = token
        # -c, not -m: fastload.testing imports this module, which runpy would warn about.
        cmd = [sys.executable, "-c", _MAIN, str(Path(root).resolve())]
        cmd += ["--repo-id", repo_id, "--page-size", str(page_size)]
        env = dict(os.environ)
        env.pop(_TOKEN_ENV, None)
        if token is not None:  # not in argv, where ps would show it
            env[_TOKEN_ENV] = token
        started = self._launch(cmd, "the test Hub", env)
        self.endpoint: str = started["endpoint"]

    def url_for(self, path: str = "", revision: str | None = None) -> str:
        repo = self.repo_id if revision is None else f"{self.repo_id}@{revision}"
        path = path.strip("/")
        return f"hf://datasets/{repo}/{path}" if path else f"hf://datasets/{repo}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """HfFileSystem's keyword arguments that reach this server (with the token)."""
        options: dict[str, Any] = {"endpoint": self.endpoint}
        if self.token is not None:
            options["token"] = self.token
        return options

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point a new process's huggingface_hub here."""
        env = {"HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_XET": "1"}
        if self.token is not None:
            env["HF_TOKEN"] = self.token
        return env

    def _control(self, action: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.endpoint}{_CONTROL}{action}" + (f"?{query}" if query else "")
        request = urllib.request.Request(url, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 400:
                raise
            raise ValueError(json.loads(exc.read())["error"]) from None

    def commit(self) -> str:
        """Reads the folder again as a new commit on main; returns its SHA."""
        return str(self._control("commit")["sha"])

    def fail_next(
        self,
        count: int,
        status: int,
        *,
        code: str | None = None,
        message: str | None = None,
        retry_after: int | None = None,
        kind: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """See :meth:`HubServer.fail_next`."""
        self._control(
            "fail",
            count=count,
            status=status,
            code=code,
            message=message,
            retry_after=retry_after,
            kind=kind,
            path_contains=path_contains,
        )

    def throttle_next(self, count: int, *, retry_after: int = 1, kind: str | None = None) -> None:
        """See :meth:`HubServer.throttle_next`."""
        self.fail_next(count, 429, message=_RATE_LIMITED, retry_after=retry_after, kind=kind)

    def reset_next(
        self, count: int, *, kind: str | None = None, path_contains: str | None = None
    ) -> None:
        """See :meth:`HubServer.reset_next`."""
        self._control("reset_next", count=count, kind=kind, path_contains=path_contains)

    def set_latency(self, seconds: float, *, kind: str | None = None) -> None:
        """See :meth:`HubServer.set_latency`."""
        self._control("latency", seconds=seconds, kind=kind)

    def stats(self) -> dict[str, int]:
        return dict(self._control("stats"))

    def reset_stats(self) -> None:
        self._control("reset")


def main(argv: list[str] | None = None) -> None:
    """Serves ROOT as a dataset repository; prints ``{"endpoint": ...}``, then serves until
    stdin closes. The token, if any, comes from ``$FASTLOAD_TEST_HUB_TOKEN``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fastload.testing.hf_hub")
    parser.add_argument("root")
    parser.add_argument("--repo-id", default="fastload/demo")
    parser.add_argument("--page-size", type=int, default=1000)
    args = parser.parse_args(argv)
    token = os.environ.get(_TOKEN_ENV) or None
    with HubServer(args.root, repo_id=args.repo_id, token=token, page_size=args.page_size) as hub:
        print(json.dumps({"endpoint": hub.endpoint}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
