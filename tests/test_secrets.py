"""No credential, signature or session token in anything fastload shows.

obstore and botocore sign with the secret and send the access key id and the session
token in headers (a presigned URL, should one be made, carries all of them). Whatever goes wrong
(403, 404, a 503 that outlasts the retries, a timeout, a reset connection), none of them
may appear in the raised exception (its text, notes, and the chain a traceback prints),
the warm report and its JSON, the ``fastload`` script's stderr and ``--json`` stdout, a
loader's ``stats()``, or the DEBUG logs of fastload, aiohttp, botocore and s3fs. What a user
needs is there instead: the public URL, the status, the S3 error code and the attempts.

Every test runs once per transport (the ``transport`` fixture): obstore and the s3fs
fallback. Another transport (``hf://`` with its token) joins by adding one entry to
``TRANSPORTS``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import fastload as fl
from fastload import transport as transports
from fastload.errors import RemoteAccessError, RemoteError, RemoteNotFoundError
from fastload.remote import open_filesystem
from fastload.stage import FetchConfig
from fastload.testing import S3FolderServer

pytest.importorskip("s3fs")

KEY_ID = "AKIAFASTLOADTESTKEY"
SECRET = "s3cr3t-FASTLOAD-wJalrXUtnFEMIK7MDENG"
TOKEN = "FwoGZXIvYXdzE-token-FASTLOAD-IQoJb3JpZ2luX2VjEJr"
# None of these may be shown, in any case (compared case-insensitively).
FORBIDDEN = (KEY_ID, SECRET, TOKEN, "Signature=", "X-Amz-Signature", "X-Amz-Credential")

BUCKET, PREFIX = "bkt", "d"
URL = f"s3://{BUCKET}/{PREFIX}"
FAULTY = "f1.bin"  # the object every fault hits; the other one is served
FAULTY_URL = f"{URL}/{FAULTY}"
QUICK = FetchConfig(jobs=2, min_jobs=1, retries=1, backoff_s=0.01, backoff_max_s=0.02, timeout_s=10)
ATTEMPTS = f"after {QUICK.retries + 1} attempts"
FETCH_TIMEOUT_S = 0.2  # for the timeout fault: the server answers after 30 s


@dataclass(frozen=True)
class TransportSettings:
    storage_options: dict[str, Any]  # beside the credentials and the endpoint
    fsspec_config: dict[str, Any]  # the same for the fastload script (FSSPEC_S3)
    obstore: bool  # whether GETs go through obstore


TRANSPORTS = {
    "obstore": TransportSettings({}, {}, obstore=True),
    # A setting obstore does not carry sends every GET through s3fs.
    "s3fs": TransportSettings(
        {"s3_additional_kwargs": {"ChecksumMode": "ENABLED"}},
        {"s3_additional_kwargs": {"ChecksumMode": "ENABLED"}},
        obstore=False,
    ),
}


@dataclass
class Transport:
    name: str
    server: S3FolderServer
    storage_options: dict[str, Any]  # credentials given in code
    env: dict[str, str]  # credentials from the environment, for the fastload script
    cache_dir: Path


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    """Two objects in s3://bkt/d on a loopback S3 server, reached with a key id, a secret
    and a session token, through one transport."""
    settings = TRANSPORTS[request.param]
    root = tmp_path / "served"
    (root / BUCKET / PREFIX).mkdir(parents=True)
    (root / BUCKET / PREFIX / "a.bin").write_bytes(b"a" * 1000)
    (root / BUCKET / PREFIX / FAULTY).write_bytes(b"f" * 1000)
    (tmp_path / "fsspec-config").mkdir()
    with S3FolderServer(root) as server:
        options = {
            "key": KEY_ID,
            "secret": SECRET,
            "token": TOKEN,
            "client_kwargs": {"endpoint_url": server.endpoint_url},
            # botocore's own retries back off for seconds; fastload's retries are the test's.
            "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}},
            **settings.storage_options,
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
        env.update(
            AWS_ACCESS_KEY_ID=KEY_ID,
            AWS_SECRET_ACCESS_KEY=SECRET,
            AWS_SESSION_TOKEN=TOKEN,
            AWS_ENDPOINT_URL=server.endpoint_url,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_MAX_ATTEMPTS="1",
            AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
            FSSPEC_CONFIG_DIR=str(tmp_path / "fsspec-config"),
            FASTLOAD_CACHE_DIR=str(tmp_path / "cli-cache"),
        )
        if settings.fsspec_config:
            env["FSSPEC_S3"] = json.dumps(settings.fsspec_config)
        fs, _ = open_filesystem(URL, options)
        assert transports._eligible(fs) == settings.obstore, "the fixture's premise"
        yield Transport(request.param, server, options, env, tmp_path / "cache")


@dataclass(frozen=True)
class Fault:
    inject: Callable[[S3FolderServer], None]  # persists past every retry
    raises: type[RemoteError] | None  # None: the warm reports it and goes on
    says: tuple[str, ...]  # what the message tells beside the URL


def _status(status: int) -> Callable[[S3FolderServer], None]:
    return lambda s: s.fail_next(1000, status, path_contains=FAULTY, methods=["GET"])


FAULTS = {
    "403": Fault(_status(403), RemoteAccessError, ("403 AccessDenied", "Access Denied")),
    "404": Fault(_status(404), RemoteNotFoundError, ("404 NoSuchKey",)),
    "503": Fault(_status(503), None, ("503 SlowDown (Please reduce your request rate.)", ATTEMPTS)),
    "timeout": Fault(lambda s: s.set_behavior(latency_s=30), None, ("within", ATTEMPTS)),
    "reset": Fault(
        lambda s: s.reset_next(1000, path_contains=FAULTY, methods=["GET"]), None, (ATTEMPTS,)
    ),
}


def assert_clean(text: str, where: str) -> None:
    lowered = text.lower()
    for secret in FORBIDDEN:
        assert secret.lower() not in lowered, f"{secret!r} in {where}:\n{text}"


def printed_chain(exc: BaseException) -> list[BaseException]:
    """exc and what a traceback of it prints: causes, and contexts not suppressed."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        suppressed = current.__cause__ is not None or current.__suppress_context__
        current = current.__cause__ if suppressed else current.__context__
    return chain


def assert_exception_clean(exc: BaseException) -> None:
    for i, e in enumerate(printed_chain(exc)):
        assert_clean(str(e), f"str() of chained exception {i} ({type(e).__name__})")
        assert_clean(repr(e), f"repr() of chained exception {i}")
        for note in getattr(e, "__notes__", ()):
            assert_clean(note, f"a note of chained exception {i}")
    assert_clean("".join(traceback.format_exception(exc)), "the traceback")


@pytest.fixture
def debug_logs() -> Iterator[list[str]]:
    """Every record the client side logs at DEBUG, formatted with its traceback. The loopback
    server's own access log (``fastload.testing``) is the remote's side: not ours to show."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith("fastload.testing"):
                lines.append(f"{record.name}: {self.format(record)}")

    handler = Collect(logging.DEBUG)
    names = ("fastload", "aiohttp", "botocore", "aiobotocore", "s3fs", "fsspec")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        yield lines
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def assert_logs_clean(lines: list[str]) -> None:
    assert any(line.startswith("botocore") for line in lines), "DEBUG logs were captured"
    assert_clean("\n".join(lines), "the DEBUG logs")


def warm(transport: Transport, fetch: FetchConfig = QUICK) -> fl.WarmReport:
    return fl.warm(
        URL,
        cache_dir=str(transport.cache_dir),
        storage_options=transport.storage_options,
        fetch=fetch,
        progress=False,
    )


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failed_fetch_shows_no_secret_and_says_what_happened(
    transport: Transport, fault: str, debug_logs: list[str]
) -> None:
    case = FAULTS[fault]
    fl.warm(
        URL,
        cache_dir=str(transport.cache_dir),
        storage_options=transport.storage_options,
        dry_run=True,
    )  # lists the objects before the fault (a slow server slows listings too)
    case.inject(transport.server)
    fetch = QUICK
    if fault == "timeout":
        fetch = dataclasses.replace(QUICK, timeout_s=FETCH_TIMEOUT_S)
    if case.raises is not None:
        with pytest.raises(case.raises) as caught:
            warm(transport, fetch)
        message = str(caught.value)
        assert_exception_clean(caught.value)
    else:
        report = warm(transport, fetch)
        assert_clean(json.dumps(report.to_dict()), "the warm report's JSON")
        assert_clean(repr(report), "the warm report")
        failed = {f["url"]: f["error"] for f in report.failures}
        assert FAULTY_URL in failed, report.failures
        message = f"{FAULTY_URL}: {failed[FAULTY_URL]}"
        assert "<Error>" not in message  # S3's code and message, not its XML
    assert FAULTY_URL in message
    for words in case.says:
        assert words in message
    assert_logs_clean(debug_logs)


@pytest.mark.parametrize("fault", ["403", "503"])
def test_a_loader_whose_fetch_fails_shows_no_secret(
    transport: Transport, fault: str, debug_logs: list[str]
) -> None:
    dataset = fl.open_dataset(
        URL,
        format="files",
        cache_dir=str(transport.cache_dir),
        storage_options=transport.storage_options,
        fetch=QUICK,
    )
    FAULTS[fault].inject(transport.server)
    loader = fl.DataLoader(dataset, batch_size=1)
    try:
        with pytest.raises(RemoteError) as caught:
            for _ in loader:
                pass
        assert_exception_clean(caught.value)
        assert caught.value.__notes__, "the loader says where it was raised"
        assert_clean(json.dumps(loader.stats()), "the loader's stats()")
    finally:
        loader.close()
    message = str(caught.value)
    assert FAULTY_URL in message
    for words in FAULTS[fault].says:
        assert words in message
    assert_logs_clean(debug_logs)


def test_a_refused_listing_shows_no_secret(transport: Transport, debug_logs: list[str]) -> None:
    transport.server.fail_next(1000, 403, path_contains=f"/{BUCKET}", methods=["GET"])
    with pytest.raises(RemoteAccessError) as caught:
        warm(transport)
    assert_exception_clean(caught.value)
    assert f"{URL}" in str(caught.value)
    assert "403 AccessDenied" in str(caught.value)
    assert_logs_clean(debug_logs)


# --- the fastload script ------------------------------------------------------------------------

FASTLOAD = str(Path(sys.executable).parent / "fastload")
# S3's other 503: s3fs retries SlowDown five more times inside each of fastload's nine
# attempts (seconds each); the text the script shows takes the same path either way.
CLI_FAULTS = {
    "403": Fault(_status(403), RemoteAccessError, ("403 AccessDenied",)),
    "503": Fault(
        lambda s: s.fail_next(
            1000, 503, code="ServiceUnavailable", path_contains=FAULTY, methods=["GET"]
        ),
        None,
        ("503 ServiceUnavailable", f"after {FetchConfig().retries + 1} attempts"),
    ),
}


def run_fastload(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=300, check=False, env=env
    )


@pytest.mark.parametrize(
    "fault", ["403", pytest.param("503", marks=pytest.mark.slow)]
)  # 503: nine attempts with fastload's default backoff, ~10 s
def test_the_fastload_script_shows_no_secret(transport: Transport, fault: str) -> None:
    case = CLI_FAULTS[fault]
    eligible = subprocess.run(
        [
            sys.executable,
            "-c",
            "from fastload import transport, remote;"
            f"print(transport._eligible(remote.open_filesystem({URL!r})[0]))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=transport.env,
    )
    assert eligible.stdout.strip() == str(TRANSPORTS[transport.name].obstore), "the premise"
    case.inject(transport.server)
    out = run_fastload(["warm", URL, "--json"], transport.env)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert_clean(out.stderr, "the script's stderr")
    assert_clean(out.stdout, "the script's --json output")
    if case.raises is not None:
        (line,) = out.stderr.splitlines()
    else:
        report = json.loads(out.stdout)
        assert [f["url"] for f in report["failures"]] == [FAULTY_URL]
        (line,) = [line for line in out.stderr.splitlines() if FAULTY_URL in line]
    assert FAULTY_URL in line
    for words in case.says:
        assert words in line


# --- the last line of defence -------------------------------------------------------------------

SIGNATURE = "2YIml71Ky6eLTsZd28BkQeIi9mA"
SIGNED = (
    f"http://127.0.0.1:9000/{BUCKET}/{PREFIX}/{FAULTY}?AWSAccessKeyId={KEY_ID}"
    f"&Signature={SIGNATURE}%3D&x-amz-security-token={TOKEN}&Expires=1796293203"
)
# What backends write (the shapes of aiohttp's, botocore's and s3fs's texts), and a part
# of it that must stay.
TEXTS = {
    "aiohttp's error": (f"503, message='Service Unavailable', url='{SIGNED}'", "/bkt/d/f1.bin'"),
    "an access log line": (f'"GET /bkt/d/f1.bin?{SIGNED.split("?")[1]} HTTP/1.1" 503', "HTTP"),
    "botocore's string to sign": (
        f"StringToSign:\nGET\n\n1796293203\nx-amz-security-token:{TOKEN}\n/bkt/d/f1.bin",
        "/bkt/d/f1.bin",
    ),
    "botocore's signature": (f"Signature:\n{SIGNATURE}", "Signature:"),
    "botocore's headers": (
        f"headers={{'X-Amz-Security-Token': b'{TOKEN}', 'Authorization': b'AWS4-HMAC-SHA256 "
        f"Credential={KEY_ID}/20261203/us-east-1/s3/aws4_request, SignedHeaders=host, "
        f"Signature={SIGNATURE}', 'amz-sdk-request': b'attempt=1'}}",
        "'amz-sdk-request': b'attempt=1'",
    ),
    "a SigV2 header": (f"Authorization: AWS {KEY_ID}:{SIGNATURE}=\nHost: x", "Host: x"),
    "a SigV4 query": (
        f"?X-Amz-Credential={KEY_ID}%2F20261203&X-Amz-Signature={SIGNATURE}&X-Amz-Date=1",
        "X-Amz-Date=1",
    ),
    "userinfo": (f"https://{KEY_ID}:{SECRET}@example.com/data/x.tar", "https://example.com/"),
    "options": (f"{{'key': '{KEY_ID}', 'secret': '{SECRET}', 'token': '{TOKEN}'}}", "'key'"),
    "an SSE-C key": ("{'Key': 'd/f1.bin', 'SSECustomerKey': 'c2VjcmV0'}", "'Key': 'd/f1.bin'"),
}


@pytest.mark.parametrize(("text", "kept"), TEXTS.values(), ids=TEXTS.keys())
def test_scrub_removes_every_credential_and_keeps_the_rest(text: str, kept: str) -> None:
    from fastload.remote import scrub

    clean = scrub(text)
    for secret in (KEY_ID, SECRET, TOKEN, SIGNATURE, "c2VjcmV0"):
        assert secret not in clean, clean
    assert kept in clean
    assert scrub(clean) == clean


def test_scrub_keeps_what_a_user_needs() -> None:
    from fastload.remote import scrub

    text = (
        "fetching s3://bkt/key=2024/f1.bin failed: 503 SlowDown (Please reduce your request "
        "rate.) after 9 attempts"
    )
    assert scrub(text) == text


def test_a_backend_error_that_carries_a_signed_url_leaves_only_its_scrubbed_text_in_the_chain() -> (
    None
):
    aiohttp = pytest.importorskip("aiohttp")
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL as YURL

    from fastload.remote import classify, clean_cause

    request = aiohttp.RequestInfo(
        YURL(SIGNED), "GET", CIMultiDictProxy(CIMultiDict()), YURL(SIGNED)
    )

    def fetch() -> None:
        try:
            raise aiohttp.ClientResponseError(request, (), status=500, message="Internal Error")
        except aiohttp.ClientResponseError as exc:
            raise classify(exc, FAULTY_URL) from clean_cause(exc)

    with pytest.raises(RemoteError) as caught:
        fetch()
    assert_exception_clean(caught.value)
    assert "500" in str(caught.value)
    printed = "".join(traceback.format_exception(caught.value))
    assert "aiohttp.client_exceptions.ClientResponseError" in printed  # what it was
    assert f"127.0.0.1:9000/{BUCKET}/{PREFIX}/{FAULTY}" in printed  # and where it went
