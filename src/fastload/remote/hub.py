"""``hf://`` (the Hugging Face Hub): its paths and revisions, its listing pinned at one
commit, and its GETs (one ``/resolve/`` request each, whose 429s reach fastload's throttle)."""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import fsspec

from fastload.remote.errors import HTTPResponseError, NotFoundResponse
from fastload.remote.listing import Listing
from fastload.remote.scrub import scrub
from fastload.remote.transport import Buffer, FsspecTransport, total_of
from fastload.remote.versions import Pin, VersionMismatch, check_total


def is_hf(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "hf" in protocols


def hf_commit(version: str | None) -> str | None:
    """The commit an ``hf://`` object's version names (``commit=<sha>;oid=...``), if any."""
    for part in (version or "").split(";"):
        name, _, value = part.partition("=")
        if name == "commit" and value:
            return value
    return None


@dataclasses.dataclass(frozen=True)
class HubPath:
    """An HfFileSystem path's parts: ``type`` ("dataset", "model", "space", ...),
    ``repo_id``, ``revision`` (None: the default branch), ``path_in_repo``; ``is_repo`` is
    False for a bucket (``buckets/...``), which has no commits."""

    type: str
    repo_id: str
    revision: str | None
    path_in_repo: str
    is_repo: bool = True


_SPECIAL_REF = re.compile(r"^(refs/convert/[^/]+|refs/pr/\d+)(?:/|$)")


_HUB_TYPES = {"datasets": "dataset", "spaces": "space", "models": "model"}


def hf_parse(path: str) -> HubPath:
    """The parts of an HfFileSystem path (``datasets/org/name[@rev]/sub``): huggingface_hub's
    own parser where it has one (1.x), the same grammar for repositories otherwise."""
    import huggingface_hub

    parse_hf_uri: Any = getattr(huggingface_hub, "parse_hf_uri", None)
    if parse_hf_uri is not None:
        p = parse_hf_uri(f"hf://{path}")
        return HubPath(p.type, p.id, p.revision, p.path_in_repo, bool(p.is_repo))
    head, _, rest = path.strip("/").partition("/")
    if head == "buckets":
        return HubPath("bucket", "/".join(rest.split("/")[:2]), None, "", is_repo=False)
    kind = _HUB_TYPES.get(head)
    if kind is None:
        kind, rest = "model", path.strip("/")
    org, _, rest = rest.partition("/")
    name, _, rest = rest.partition("/")
    revision = None
    if "@" in name:
        name, _, revision = name.partition("@")
        special = _SPECIAL_REF.match(f"refs/{rest}") if revision == "refs" else None
        if special is not None:  # refs/pr/3, refs/convert/parquet: slashes of the revision
            revision = special.group(1)
            rest = f"refs/{rest}"[len(revision) :]
        revision = urllib.parse.unquote(revision)
    return HubPath(kind, f"{org}/{name}", revision, rest.strip("/"))


def hf_pinned(path: str, commit: str) -> str:
    """An HfFileSystem path (``datasets/org/name[@rev]/sub``) at revision commit instead."""
    parsed = hf_parse(path)
    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(parsed.type, "")
    if parsed.type not in ("dataset", "space", "model"):
        prefix = f"{parsed.type}s/"
    pinned = f"{prefix}{parsed.repo_id}@{commit}"
    return f"{pinned}/{parsed.path_in_repo}" if parsed.path_in_repo else pinned


# The packages whose exceptions huggingface_hub's HTTP session raises, by its version.
_HUB_CLIENT_MODULES = frozenset(
    {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3", "h11", "h2"}
)


class HubTransport:
    """GETs of ``hf://`` files (huggingface_hub's HfFileSystem) as one request each: the
    file's ``/resolve/<revision>/<path>`` URL on the filesystem's endpoint, with the headers
    huggingface_hub sends (its token: from storage_options, ``$HF_TOKEN`` or the saved
    login), through huggingface_hub's shared HTTP client (httpx in huggingface_hub 1.x, httpx2
    in 2.x: only what both share is used). HfFileSystem's own reads cost
    a repository lookup and a listing per file opened and retry a 429 inside themselves,
    seconds at a time, where fastload's stager would not see it; here a 429 (or 503)
    reaches the stager, which backs off and halves its concurrency (AIMD) as for S3's
    SlowDown. Listings are :mod:`fastload.manifest`'s (pinned at a commit)."""

    def __init__(self, fs: Any, timeout_s: float, fallback: FsspecTransport) -> None:
        self._fs = fs
        self._timeout_s = timeout_s
        self._fallback = fallback

    @classmethod
    def from_hf(cls, fs: Any, timeout_s: float) -> HubTransport | None:
        if not is_hf(fs) or not hasattr(fs, "_api") or not hasattr(fs, "endpoint"):
            return None
        return cls(fs, timeout_s, FsspecTransport(fs, timeout_s))

    def get(
        self, path: str, start: int | None = None, end: int | None = None, pin: Pin | None = None
    ) -> Buffer:
        """A file at the commit its path names (:func:`fastload.remote.path_of` pins it at
        the listed one), its size checked against ``pin``'s."""
        from huggingface_hub import get_session, hf_hub_url

        if start is not None and start == end:
            return b""
        parsed = hf_parse(path)
        if not parsed.is_repo or not parsed.path_in_repo:
            return self._fallback.get(path, start, end, pin)  # a bucket's file: HfFileSystem's
        url = hf_hub_url(
            parsed.repo_id,
            parsed.path_in_repo,
            repo_type=parsed.type,
            revision=parsed.revision or "main",
            endpoint=self._fs.endpoint,
        )
        headers = self._fs._api._build_hf_headers()
        if start is not None or end is not None:
            headers["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            response = get_session().get(url, headers=headers, timeout=self._timeout_s)
        except Exception as exc:  # the session's client: httpx, httpx2 or requests by version
            if type(exc).__module__.split(".", 1)[0] not in _HUB_CLIENT_MODULES:
                raise  # not the network's (a bug is not retried as a dropped connection)
            name = type(exc).__name__
            if "Timeout" in name:
                raise TimeoutError(f"no complete answer within {self._timeout_s:g}s") from None
            # Its text names no URL; scrubbed all the same.
            raise ConnectionError(f"{name}: {scrub(str(exc))[:200]}") from None
        status = response.status_code
        if status >= 400:
            code = response.headers.get("X-Error-Code") or None
            message = response.headers.get("X-Error-Message") or None
            answer = NotFoundResponse if status == 404 else HTTPResponseError
            raise answer(status, code, message)
        data = response.content
        ranged = start is not None or end is not None
        total = total_of(response.headers.get("Content-Range")) if status == 206 else None
        if status == 200 and response.headers.get("Content-Encoding") in (None, "identity"):
            total = len(data)
        why = check_total(pin, total) if status in (200, 206) else None
        if why is not None:
            raise VersionMismatch(why)
        if status == 200 and ranged:  # a range answered whole
            data = data[start or 0 : end]
        return data

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        return None


def list_hub(
    fs: fsspec.AbstractFileSystem, root: str, progress: Callable[[int], None] | None
) -> Listing | None:
    """An ``hf://`` repository's files below root, at one commit: the revision the URL names
    (``@rev``, else the default branch) resolved to its commit SHA first, then the tree of
    that commit, so a commit pushed meanwhile cannot mix in. Each version is
    ``commit=<sha>;oid=<git blob id>[;sha256=<LFS oid>]``: a new commit is a new version of
    every file (fetched again), and :func:`fastload.remote.path_of` pins each GET at the
    commit listed. None for a bucket (no commits: fsspec's find lists it)."""
    from huggingface_hub.hf_api import RepoFile

    try:
        from huggingface_hub.errors import EntryNotFoundError
    except ImportError:  # huggingface_hub before 0.25
        from huggingface_hub.utils import EntryNotFoundError  # type: ignore[attr-defined]

    parsed = hf_parse(root)
    if not parsed.is_repo:
        return None
    api: Any = fs._api
    commit = api.repo_info(parsed.repo_id, revision=parsed.revision, repo_type=parsed.type).sha
    base = parsed.path_in_repo.strip("/")
    try:
        entries = [
            e
            for e in api.list_repo_tree(
                parsed.repo_id, base or None, recursive=True, revision=commit, repo_type=parsed.type
            )
            if isinstance(e, RepoFile)
        ]
    except EntryNotFoundError:  # root names a file
        entries = [
            e
            for e in api.get_paths_info(
                parsed.repo_id, [base], revision=commit, repo_type=parsed.type
            )
            if isinstance(e, RepoFile)
        ]
    keys, sizes, versions = [], [], []
    for e in entries:
        if e.path == base or not base:
            key = "" if base else e.path
        elif e.path.startswith(base + "/"):
            key = e.path[len(base) + 1 :]
        else:
            continue  # not below root
        version = f"commit={commit};oid={e.blob_id}"
        if e.lfs is not None:
            version += f";sha256={e.lfs.sha256}"
        keys.append(key)
        sizes.append(e.size)
        versions.append(version)
    if progress is not None:
        progress(len(keys))
    return Listing.of(keys, sizes, versions)
