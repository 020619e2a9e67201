"""S3 GETs and listings through presigned URLs: the cheap path to S3 objects.

s3fs runs each GET through aiobotocore's whole request pipeline (endpoint rules, event
hooks, signing, response parsing down to dateutil timestamps): 2.5-4 ms of Python per
object on the event-loop thread, which holds the GIL against the decode threads and caps a
cold epoch at a few hundred objects/s on 2 cores. A presigned URL costs one signature, and
a plain aiohttp GET a fraction of that pipeline. s3fs's own client signs, so endpoint,
region, addressing and credentials are exactly s3fs's.

Used only where a presigned GET is the same request s3fs would send: no requester-pays,
no ``s3_additional_kwargs`` (SSE-C keys travel in headers), no proxies or client
certificates in the botocore config. A response this path does not handle (a redirect
to another region, a malformed-authorization 400, a server without presigned URLs: 501)
goes back to s3fs, for that object and every later one of the same staging call.
"""

from __future__ import annotations

import datetime
import functools
import os
import ssl
import xml.etree.ElementTree as ElementTree
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus

from fastload.remote import HTTPResponseError

if TYPE_CHECKING:  # aiohttp comes with s3fs; imported where a presigned GET is made
    import aiohttp

_NS = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
_EXPIRES_S = 3600  # a URL is used once, within seconds; an hour leaves room for clock skew


class NotHandled(Exception):
    """This response is s3fs's to handle (it knows regions, redirects and retries)."""


class PresignedGets:
    """``gets = await PresignedGets.open(fs, connections)``, then ``await gets.get(path)``
    and ``await gets.close()``; open gives None where the filesystem is not one this path
    serves the same way."""

    def __init__(self, fs: Any, client: Any, session: aiohttp.ClientSession) -> None:
        self._fs = fs
        self._client = client
        self._session = session
        self.declined = False  # set once the remote answers what only s3fs can follow

    @classmethod
    async def open(cls, fs: Any, connections: int) -> PresignedGets | None:
        if not _eligible(fs):
            return None
        client = await fs.set_session()
        config = client.meta.config
        if getattr(config, "proxies", None) or getattr(config, "client_cert", None):
            return None
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, ssl=_ssl_for(fs)),
            trust_env=True,  # HTTP(S)_PROXY from the environment, as botocore honours them
            auto_decompress=False,
        )
        return cls(fs, client, session)

    async def close(self) -> None:
        await self._session.close()

    async def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes [start, end) (the whole object for None, None), as s3fs's
        ``_cat_file`` gives them. Raises NotHandled, or HTTPResponseError carrying the status
        and S3's error code and message (for :func:`fastload.remote.classify`), never the
        presigned URL (it holds the credentials)."""
        bucket, key, version = self._fs.split_path(path)
        params = {"Bucket": bucket, "Key": key}
        if version:
            params["VersionId"] = version
        headers = {"Accept-Encoding": "identity"}
        if start is not None or end is not None:
            first = start or 0
            headers["Range"] = f"bytes={first}-" if end is None else f"bytes={first}-{end - 1}"
        return await self._request("get_object", params, headers)

    async def find(self, path: str) -> dict[str, dict[str, Any]]:
        """Every object below path (a bucket, or a prefix ending at a ``/``), as s3fs's
        ``find(path, detail=True)`` gives them: name -> info with ``size``, ``ETag`` and
        ``LastModified`` (so versions recorded either way compare equal). botocore parses
        a listing page field by field in Python (~0.2 ms an object); this reads the XML
        with ElementTree."""
        bucket, key, _ = self._fs.split_path(path)
        prefix = f"{key.rstrip('/')}/" if key else ""
        params = {"Bucket": bucket, "Prefix": prefix, "EncodingType": "url"}
        found: dict[str, dict[str, Any]] = {}
        while True:
            page = ElementTree.fromstring(await self._request("list_objects_v2", params, {}))
            for entry in page.iterfind("s3:Contents", _NS):
                name = unquote_plus(entry.findtext("s3:Key", "", _NS))
                if name.endswith("/"):
                    continue  # a folder marker, not an object (find(withdirs=False) skips it)
                size = int(entry.findtext("s3:Size", "0", _NS))
                found[f"{bucket}/{name}"] = {
                    "name": f"{bucket}/{name}",
                    "type": "file",
                    "size": size,
                    "ETag": entry.findtext("s3:ETag", None, _NS),
                    "LastModified": _timestamp(entry.findtext("s3:LastModified", None, _NS)),
                }
            token = page.findtext("s3:NextContinuationToken", None, _NS)
            if page.findtext("s3:IsTruncated", "false", _NS) != "true" or not token:
                return found
            params["ContinuationToken"] = token

    async def _request(
        self, operation: str, params: dict[str, str], headers: dict[str, str]
    ) -> bytes:
        url = await self._client.generate_presigned_url(
            operation, Params=params, ExpiresIn=_EXPIRES_S
        )
        async with self._session.get(url, headers=headers, allow_redirects=False) as response:
            body = await response.read()
            if response.status in (200, 206):
                return body
            if 300 <= response.status < 400 or response.status in (400, 501):
                self.declined = True  # the same answer awaits every object of this bucket
                raise NotHandled(response.status)
            # Not aiohttp's ClientResponseError: its text is the whole signed URL.
            raise HTTPResponseError.from_body(response.status, body)


def _timestamp(text: str | None) -> datetime.datetime | None:
    """S3's ISO 8601 time as botocore gives it (an aware datetime), without dateutil."""
    return None if text is None else datetime.datetime.fromisoformat(text)


async def find(fs: Any, path: str) -> dict[str, dict[str, Any]] | None:
    """``fs.find(path, detail=True)`` through presigned listing pages; None where the
    filesystem is not one this path serves, or the remote declined."""
    gets = await PresignedGets.open(fs, connections=1)
    if gets is None:
        return None
    try:
        return await gets.find(path)
    except NotHandled:
        return None
    finally:
        await gets.close()


def _eligible(fs: Any) -> bool:
    return (
        type(fs).__name__ == "S3FileSystem"
        and not getattr(fs, "s3_additional_kwargs", None)
        and not getattr(fs, "req_kw", None)  # requester-pays
        and hasattr(fs, "set_session")
        and hasattr(fs, "split_path")
    )


def _ssl_for(fs: Any) -> ssl.SSLContext | bool:
    """TLS as botocore would verify it: ``verify`` from client_kwargs, else AWS_CA_BUNDLE,
    else botocore's bundle."""
    verify = (getattr(fs, "client_kwargs", None) or {}).get("verify")
    if verify is False:
        return False
    if not isinstance(verify, str):
        verify = os.environ.get("AWS_CA_BUNDLE")
    if not verify:
        from botocore.httpsession import get_cert_path  # type: ignore[import-untyped]

        verify = get_cert_path(True)
    return _context(verify)


@functools.cache
def _context(cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)  # reads the bundle: once per process
