"""The transport: GETs and listings of one remote behind one small, blocking interface.

Two implementations, chosen per filesystem by :func:`transport_for`:

- :class:`ObjectStoreTransport` for ``s3://`` when obstore is installed (the ``s3`` extra):
  Rust's object_store signs and sends each GET with the GIL released, at a fraction of the
  CPU of botocore's request pipeline or of aiohttp, and zero-copy into a buffer. Its
  endpoint, region, addressing, TLS trust and credentials are those of the s3fs session
  fastload opened for the URL (botocore resolves them: storage_options, the environment,
  profiles, instance roles); obstore's own environment lookup is overridden key by key and
  its retries are off, so fastload's retries and AIMD throttle stay in charge.
- :class:`FsspecTransport` for everything else, and for S3 settings obstore does not carry
  (requester-pays, SSE-C keys, proxies, client certificates, virtual-host addressing on a
  custom endpoint) or answers it cannot follow (a redirect to another region).

obstore's runtime hangs in a forked child once the parent has used it; a forked process
(a DataLoader worker) therefore never gets an ObjectStoreTransport, whatever its parent did.
Version strings (ETag and LastModified as s3fs lists them) are the same from both, so no
cached object is refetched because the transport changed.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import ssl
import threading
from typing import Any, Protocol

import fsspec
import fsspec.asyn

from fastload.remote import HTTPResponseError, scrub

Buffer = bytes | memoryview


class Transport(Protocol):
    """GETs (blocking; the GIL is released while waiting where the backend allows it)."""

    def get(self, path: str, start: int | None = None, end: int | None = None) -> Buffer:
        """Bytes [start, end) of the object at path (a path of the fsspec filesystem);
        raises what :func:`fastload.remote.classify` sorts, never text with a secret."""
        ...

    def find(self, root: str) -> dict[str, dict[str, Any]] | None:
        """``fs.find(root, detail=True)``'s answer, or None to let fsspec list."""
        ...


class FsspecTransport:
    """GETs through the fsspec filesystem itself (any protocol)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, timeout_s: float) -> None:
        self.fs = fs
        self.timeout_s = timeout_s

    def get(self, path: str, start: int | None = None, end: int | None = None) -> Buffer:
        fs: Any = self.fs
        if getattr(fs, "async_impl", False):
            try:
                data = fsspec.asyn.sync(
                    fs.loop, fs._cat_file, path, start=start, end=end, timeout=self.timeout_s
                )
            except fsspec.asyn.FSTimeoutError:
                raise TimeoutError(f"no complete answer within {self.timeout_s:g}s") from None
        else:
            data = fs.cat_file(path, start=start, end=end)
        return data  # type: ignore[no-any-return]

    def find(self, root: str) -> dict[str, dict[str, Any]] | None:
        return None


class Declined(Exception):
    """The remote answered what only s3fs can follow (a redirect to another region, an
    authorization header for another region); that bucket goes back to s3fs."""


_STATUS = re.compile(r"returned non-2xx status code: (\d{3})")
_BODY = re.compile(r"<Error>.*?</Error>", re.DOTALL)
# botocore's default endpoints; obstore builds the same ones from the region.
_AWS_HOST = re.compile(r"^https://s3([.-][a-z0-9-]+)?\.amazonaws\.com(\.cn)?/?$")


class ObjectStoreTransport:
    """S3 GETs and listings through obstore, with s3fs's session (see the module docstring)."""

    def __init__(self, fs: Any, settings: dict[str, Any], fallback: FsspecTransport) -> None:
        self._fs = fs
        self._settings = settings
        self._fallback = fallback
        self._stores: dict[str, Any] = {}
        self._declined: set[str] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @classmethod
    def from_s3fs(cls, fs: Any, timeout_s: float) -> ObjectStoreTransport | None:
        """The transport for an s3fs filesystem, or None where obstore cannot send the same
        requests s3fs would (or is not installed)."""
        if not _eligible(fs) or _runtime_inherited:
            return None
        try:
            import obstore  # noqa: F401
        except ImportError:
            return None
        client = fsspec.asyn.sync(fs.loop, fs.set_session)
        config = client.meta.config
        if getattr(config, "proxies", None) or getattr(config, "client_cert", None):
            return None
        endpoint = client.meta.endpoint_url or ""
        addressing = (getattr(config, "s3", None) or {}).get("addressing_style")
        aws = bool(_AWS_HOST.match(endpoint))
        if not aws and addressing == "virtual":
            return None
        options: dict[str, Any] = {
            "timeout": f"{timeout_s:g}s",
            "connect_timeout": f"{min(timeout_s, 10.0):g}s",
            "pool_max_idle_per_host": "1024",
            "allow_http": endpoint.startswith("http://"),
        }
        verify = (getattr(fs, "client_kwargs", None) or {}).get("verify")
        if verify is False:
            options["allow_invalid_certificates"] = True
        elif endpoint.startswith("https://"):
            cafile = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE")
            if cafile:  # trusted beside the system's roots (botocore trusts it alone)
                options["root_certificate"] = _read_pem(cafile)
        settings: dict[str, Any] = {
            "region": client.meta.region_name or "us-east-1",
            # Every key obstore would otherwise take from its own AWS_* environment.
            "virtual_hosted_style_request": False,
            "request_payer": False,
            "unsigned_payload": False,
            "skip_signature": bool(getattr(fs, "anon", False)),
            "client_options": options,
            "retry_config": {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=0)},
        }
        if not aws:
            settings["endpoint"] = endpoint.rstrip("/")
        if not settings["skip_signature"]:
            settings["credential_provider"] = _Credentials(fs, client)
        return cls(fs, settings, FsspecTransport(fs, timeout_s))

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                global _runtime_used
                _runtime_used = True
                store = self._stores[bucket] = S3Store(bucket, **self._settings)
            return store

    def get(self, path: str, start: int | None = None, end: int | None = None) -> Buffer:
        if os.getpid() != self._pid:  # a forked child: obstore's runtime would hang here
            return self._fallback.get(path, start, end)
        bucket, key, version = self._fs.split_path(path)
        if version or bucket in self._declined:
            return self._fallback.get(path, start, end)
        import obstore

        options: dict[str, Any] = {}
        if start is not None or end is not None:
            if end is None:
                options["range"] = {"offset": start or 0}
            else:
                options["range"] = (start or 0, end)
        try:
            answer = obstore.get(self._store(bucket), key, options=options)  # type: ignore[arg-type]
            return memoryview(answer.bytes())
        except Exception as exc:
            error = _translate(exc, self._fallback.timeout_s)
            if isinstance(error, Declined):
                self._declined.add(bucket)
                return self._fallback.get(path, start, end)
            raise error from None

    def find(self, root: str) -> dict[str, dict[str, Any]] | None:
        """Every object below root in s3fs's ``find(detail=True)`` shape (same names, sizes,
        ETags and LastModified, so versions compare equal); None to let s3fs list.

        object_store normalizes keys (``a/`` and ``a`` are one path to it), so a listing
        with an empty object (a folder marker, or a key it may have rewritten), a
        repeated name or a key it rejects is left to s3fs."""
        if os.getpid() != self._pid:
            return None
        bucket, key, _ = self._fs.split_path(root)
        import obstore

        prefix = key.rstrip("/") or None
        found: dict[str, dict[str, Any]] = {}
        try:
            for page in obstore.list(self._store(bucket), prefix=prefix, chunk_size=1000):
                for meta in page:
                    name = f"{bucket}/{meta['path']}"
                    if meta["size"] == 0 or name in found:
                        return None
                    found[name] = {
                        "name": name,
                        "type": "file",
                        "size": meta["size"],
                        "ETag": meta["e_tag"],
                        "LastModified": meta["last_modified"],
                    }
        except Exception as exc:
            error = _translate(exc, self._fallback.timeout_s)
            if isinstance(error, (Declined, ConnectionError)):
                self._declined.add(bucket)  # ConnectionError: a key object_store rejects
                return None
            raise error from None
        return found


class _Credentials:
    """obstore's credential provider: the keys of s3fs's botocore session, refreshed as
    botocore refreshes them (an instance role's, an assumed role's)."""

    def __init__(self, fs: Any, client: Any) -> None:
        self._fs = fs
        self._credentials = client._request_signer._credentials

    def __call__(self) -> dict[str, Any]:
        credentials = self._credentials
        frozen = fsspec.asyn.sync(self._fs.loop, credentials.get_frozen_credentials)
        expiry = getattr(credentials, "_expiry_time", None)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            # obstore asks again before this; botocore refreshes ahead of its own expiry.
            "expires_at": expiry - datetime.timedelta(minutes=5) if expiry else None,
        }


def _translate(exc: BaseException, timeout_s: float) -> BaseException:
    """obstore's exception as one :func:`fastload.remote.classify` sorts, without its text
    (which carries the request's URL): the status and S3's code and message, or a
    connection error naming what failed."""
    text = str(exc)
    match = _STATUS.search(text)
    if match is None:
        if type(exc).__name__ == "FileNotFoundError" or isinstance(exc, FileNotFoundError):
            return FileNotFoundError("not found")
        if "timed out" in text or "Timeout" in text:
            return TimeoutError(f"no complete answer within {timeout_s:g}s")
        certificate = _CERTIFICATE.search(text)
        if certificate is not None:  # rustls's words for a certificate nobody vouches for
            return ssl.SSLCertVerificationError(f"certificate not trusted: {certificate.group(1)}")
        head = text.split(" - ", 1)[-1].split("\n", 1)[0]
        return ConnectionError(scrub(head)[:200])
    status = int(match.group(1))
    body = _BODY.search(text)
    error = HTTPResponseError.from_body(status, body.group(0).encode() if body else b"")
    if 300 <= status < 400 or (status == 400 and error.error_code in _REGION_CODES):
        return Declined(status)
    return error


_CERTIFICATE = re.compile(r"InvalidCertificate\(\s*(\w+)")
_REGION_CODES = {"AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}


@functools.cache
def _read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _eligible(fs: Any) -> bool:
    return (
        type(fs).__name__ == "S3FileSystem"
        and not getattr(fs, "s3_additional_kwargs", None)
        and not getattr(fs, "req_kw", None)  # requester-pays
        and hasattr(fs, "set_session")
        and hasattr(fs, "split_path")
    )


# obstore's runtime (its threads and connections) does not survive fork: a child of a
# process that used it hangs on its first request. Such a child uses fsspec instead.
_runtime_used = False
_runtime_inherited = False


def _after_fork_in_child() -> None:
    global _runtime_inherited
    _runtime_inherited = _runtime_inherited or _runtime_used


os.register_at_fork(after_in_child=_after_fork_in_child)

_by_fs: dict[tuple[int, int, float, bool], Transport] = {}
_by_fs_lock = threading.Lock()


def transport_for(
    fs: fsspec.AbstractFileSystem, timeout_s: float = 60.0, *, fsspec_only: bool = False
) -> Transport:
    """The transport for fs in this process (one per filesystem and process, so its
    connections are reused across staging calls)."""
    key = (os.getpid(), id(fs), timeout_s, fsspec_only)
    with _by_fs_lock:
        transport = _by_fs.get(key)
    if transport is None:
        made = None if fsspec_only else ObjectStoreTransport.from_s3fs(fs, timeout_s)
        transport = made if made is not None else FsspecTransport(fs, timeout_s)
        with _by_fs_lock:
            transport = _by_fs.setdefault(key, transport)
    return transport
