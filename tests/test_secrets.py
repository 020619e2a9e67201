"""No credential, signature, session token or Hub token in anything fastload shows.

obstore and botocore sign with the secret and send the access key id and the session
token in headers (a presigned URL, should one be made, carries all of them); huggingface_hub
sends the Hub token as ``Authorization: Bearer hf_...``. Whatever goes wrong (403, 404, 429,
a 503 that outlasts the retries, a timeout, a reset connection, a refused listing), none of
them may appear in the raised exception (its text, notes, and the chain a traceback prints),
the warm report and its JSON, the ``fastload`` script's stderr and stdout (with and without
``--json``), a loader's ``stats()``, the files of the cache directory (the index database,
the manifests, the objects), or the DEBUG logs of fastload and the clients below it
(aiohttp, botocore, s3fs; huggingface_hub and its httpx or httpx2). What a user needs is
there instead: the public URL, the status, the remote's error code and message and the
attempts.

Every test runs once per transport (the ``transport`` fixture): obstore and the s3fs
fallback on a loopback S3 server with a key id, a secret and a session token, and
huggingface_hub's client on a loopback Hub (``fastload.testing.HubServerProcess``) with an
``hf_`` token (in storage_options; ``$HF_TOKEN`` for the script). Another transport joins by
adding one entry to ``TRANSPORTS`` and its faults to ``FAULTS`` and ``CLI_FAULTS``.
"""

from __future__ import annotations

import contextlib
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
from fastload.errors import RemoteAccessError, RemoteError, RemoteNotFoundError
from fastload.remote import connect as transports
from fastload.remote import open_filesystem
from fastload.staging import FetchConfig
from fastload.testing import HubServerProcess, S3FolderServer

KEY_ID = "AKIAFASTLOADTESTKEY"
SECRET = "s3cr3t-FASTLOAD-wJalrXUtnFEMIK7MDENG"
TOKEN = "FwoGZXIvYXdzE-token-FASTLOAD-IQoJb3JpZ2luX2VjEJr"
HF_TOKEN = "hf_FastloadTestTokenAbCdEfGhIjKlMnOpQr"
# None of these may be shown, in any case (compared case-insensitively).
FORBIDDEN = (KEY_ID, SECRET, TOKEN, HF_TOKEN, "Signature=", "X-Amz-Signature", "X-Amz-Credential")

BUCKET, PREFIX = "bkt", "d"
FAULTY = "f1.bin"  # the object every fault hits; the other one is served
QUICK = FetchConfig(jobs=2, min_jobs=1, retries=1, backoff_s=0.01, backoff_max_s=0.02, timeout_s=10)
ATTEMPTS = f"after {QUICK.retries + 1} attempts"
FETCH_TIMEOUT_S = 0.2  # for the timeout fault: the server answers after 30 s


@dataclass(frozen=True)
class TransportSettings:
    remote: str  # "s3" or "hf": the loopback server
    storage_options: dict[str, Any]  # beside the credentials and the endpoint
    fsspec_config: dict[str, Any]  # the same for the fastload script (FSSPEC_S3)
    sends: str  # the transport class (fastload.remote) that sends the GETs
    logs_from: str  # a client logger that writes at DEBUG: the premise of the log checks
    refused: str  # what a refused listing says


_S3 = {"remote": "s3", "logs_from": "botocore", "refused": "403 AccessDenied"}
TRANSPORTS = {
    "obstore": TransportSettings(
        storage_options={}, fsspec_config={}, sends="ObjectStoreTransport", **_S3
    ),
    # A setting obstore does not carry sends every GET through s3fs.
    "s3fs": TransportSettings(
        storage_options={"s3_additional_kwargs": {"ChecksumMode": "ENABLED"}},
        fsspec_config={"s3_additional_kwargs": {"ChecksumMode": "ENABLED"}},
        sends="FsspecTransport",
        **_S3,
    ),
    # huggingface_hub lists, fastload GETs each /resolve/ URL with its session (httpx, or
    # httpx2 from huggingface_hub 2); httpcore(2) logs each request at DEBUG.
    "hub": TransportSettings(
        remote="hf",
        storage_options={},
        fsspec_config={},
        sends="HubTransport",
        logs_from="httpcore",
        refused="403 GatedRepo",
    ),
}


@dataclass
class Transport:
    name: str
    settings: TransportSettings
    server: Any  # S3FolderServer or HubServerProcess
    url: str  # the dataset: a.bin and FAULTY
    storage_options: dict[str, Any]  # credentials given in code
    env: dict[str, str]  # credentials from the environment, for the fastload script
    cache_dir: Path

    @property
    def faulty_url(self) -> str:
        return f"{self.url}/{FAULTY}"


def _served(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "a.bin").write_bytes(b"a" * 1000)
    (root / FAULTY).write_bytes(b"f" * 1000)


def _script_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """The environment of a fastload script: none of ours that names a credential or a
    configuration, the given settings instead."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "FSSPEC_", "HF_", "HUGGING_FACE_"))
    }
    (tmp_path / "fsspec-config").mkdir()
    env.update(
        FSSPEC_CONFIG_DIR=str(tmp_path / "fsspec-config"),
        FASTLOAD_CACHE_DIR=str(tmp_path / "cli-cache"),
        HF_HOME=str(tmp_path / "hf-home"),  # no saved login, nothing written to ours
        **settings,
    )
    return env


@contextlib.contextmanager
def _s3(
    settings: TransportSettings, tmp_path: Path
) -> Iterator[tuple[Any, str, dict[str, Any], dict[str, str]]]:
    """s3://bkt/d on a loopback S3 server, reached with a key id, a secret and a session token."""
    root = tmp_path / "served"
    _served(root / BUCKET / PREFIX)
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
        env = _script_env(
            tmp_path,
            AWS_ACCESS_KEY_ID=KEY_ID,
            AWS_SECRET_ACCESS_KEY=SECRET,
            AWS_SESSION_TOKEN=TOKEN,
            AWS_ENDPOINT_URL=server.endpoint_url,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_MAX_ATTEMPTS="1",
            AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        )
        if settings.fsspec_config:
            env["FSSPEC_S3"] = json.dumps(settings.fsspec_config)
        yield server, f"s3://{BUCKET}/{PREFIX}", options, env


@contextlib.contextmanager
def _hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, str, dict[str, Any], dict[str, str]]]:
    """hf://datasets/fastload/demo/d on a loopback Hub that takes only ``Bearer HF_TOKEN``:
    the token in storage_options here, in ``$HF_TOKEN`` for the script."""
    pytest.importorskip("huggingface_hub")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "served"
    _served(root / PREFIX)
    with HubServerProcess(root, token=HF_TOKEN) as hub:
        yield hub, hub.url_for(PREFIX), hub.storage_options, _script_env(tmp_path, **hub.env)


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Transport]:
    """Two objects, a.bin and FAULTY, on a loopback remote reached with credentials, through
    one transport."""
    settings = TRANSPORTS[request.param]
    if settings.remote == "s3":
        pytest.importorskip("s3fs")
        remote = _s3(settings, tmp_path)
    else:
        remote = _hub(tmp_path, monkeypatch)
    with remote as (server, url, options, env):
        # A filesystem of its own: the test's makes its session (and logs it) itself.
        fs, _ = open_filesystem(url, {**options, "skip_instance_cache": True})
        sends = type(transports.transport_for(fs)).__name__
        assert sends == settings.sends, "the fixture's premise"
        yield Transport(request.param, settings, server, url, options, env, tmp_path / "cache")


@dataclass(frozen=True)
class Fault:
    inject: Callable[[Any], None]  # given the server; persists past every retry
    raises: type[RemoteError] | None  # None: the warm reports it and goes on
    says: tuple[str, ...]  # what the message tells beside the URL


def _status(status: int) -> Callable[[Any], None]:
    return lambda s: s.fail_next(1000, status, path_contains=FAULTY, methods=["GET"])


def _hub_status(
    status: int, code: str | None = None, message: str | None = None
) -> Callable[[Any], None]:
    return lambda h: h.fail_next(
        1000, status, code=code, message=message, kind="resolve", path_contains=FAULTY
    )


GATED = "Access to dataset fastload/demo is restricted. You must have access to it."
FAULTS: dict[str, dict[str, Fault]] = {
    "s3": {
        "403": Fault(_status(403), RemoteAccessError, ("403 AccessDenied", "Access Denied")),
        "404": Fault(_status(404), RemoteNotFoundError, ("404 NoSuchKey",)),
        "503": Fault(
            _status(503), None, ("503 SlowDown (Please reduce your request rate.)", ATTEMPTS)
        ),
        "timeout": Fault(lambda s: s.set_behavior(latency_s=30), None, ("within", ATTEMPTS)),
        "reset": Fault(
            lambda s: s.reset_next(1000, path_contains=FAULTY, methods=["GET"]), None, (ATTEMPTS,)
        ),
    },
    # The Hub's answers: its error code and message in X-Error-Code and X-Error-Message.
    "hf": {
        "403": Fault(
            _hub_status(403, "GatedRepo", GATED), RemoteAccessError, ("403 GatedRepo", GATED)
        ),
        "404": Fault(
            _hub_status(404, "EntryNotFound", "Entry not found"),
            RemoteNotFoundError,
            ("404 EntryNotFound (Entry not found)",),
        ),
        "429": Fault(
            lambda h: h.throttle_next(1000, kind="resolve"),
            None,
            ("429 Too Many Requests (You have been rate-limited; retry later.)", ATTEMPTS),
        ),
        "503": Fault(_hub_status(503), None, ("503 Service Unavailable", ATTEMPTS)),
        "timeout": Fault(lambda h: h.set_latency(30, kind="resolve"), None, ("within", ATTEMPTS)),
        "reset": Fault(
            lambda h: h.reset_next(1000, kind="resolve", path_contains=FAULTY), None, (ATTEMPTS,)
        ),
    },
}


def cases(faults: dict[str, dict[str, Fault]], **marks: Any) -> list[Any]:
    """(transport, fault) for every transport and each fault of its remote; marks by fault."""
    return [
        pytest.param(name, fault, id=f"{name}-{fault}", marks=marks.get(fault, ()))
        for name in sorted(TRANSPORTS)
        for fault in sorted(faults[TRANSPORTS[name].remote])
    ]


def assert_clean(text: str, where: str) -> None:
    lowered = text.lower()
    for secret in FORBIDDEN:
        assert secret.lower() not in lowered, f"{secret!r} in {where}:\n{text}"


def assert_cache_clean(cache_dir: Path) -> None:
    """Every file of a cache directory: the index database (and its WAL), the manifests,
    the objects."""
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert files, f"nothing in {cache_dir}"
    for path in files:
        data = path.read_bytes().lower()
        for secret in FORBIDDEN:
            assert secret.lower().encode() not in data, f"{secret!r} in {path}"


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


# The client side's loggers; huggingface_hub 2 sends through httpx2 (and httpcore2).
CLIENT_LOGGERS = (
    "fastload",
    "aiohttp",
    "botocore",
    "aiobotocore",
    "s3fs",
    "fsspec",
    "huggingface_hub",
    "httpx",
    "httpcore",
    "httpx2",
    "httpcore2",
)


@pytest.fixture
def debug_logs(transport: Transport) -> Iterator[list[str]]:
    """Every record the client side logs at DEBUG, formatted with its traceback. The loopback
    server's own access log (``fastload.testing``) is the remote's side: not ours to show.
    (After ``transport``: importing huggingface_hub sets its loggers' levels.)"""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith("fastload.testing"):
                lines.append(f"{record.name}: {self.format(record)}")

    handler = Collect(logging.DEBUG)
    loggers = [logging.getLogger(n) for n in CLIENT_LOGGERS]
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


def assert_logs_clean(transport: Transport, lines: list[str]) -> None:
    source = transport.settings.logs_from
    assert any(line.startswith(source) for line in lines), f"{source}'s DEBUG logs were captured"
    assert_clean("\n".join(lines), "the DEBUG logs")


def warm(transport: Transport, fetch: FetchConfig = QUICK) -> fl.WarmReport:
    return fl.warm(
        transport.url,
        cache_dir=str(transport.cache_dir),
        storage_options=transport.storage_options,
        fetch=fetch,
        progress=False,
    )


@pytest.mark.parametrize(("transport", "fault"), cases(FAULTS), indirect=["transport"])
def test_a_failed_fetch_shows_no_secret_and_says_what_happened(
    transport: Transport, fault: str, debug_logs: list[str]
) -> None:
    case = FAULTS[transport.settings.remote][fault]
    fl.warm(
        transport.url,
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
        assert transport.faulty_url in failed, report.failures
        message = f"{transport.faulty_url}: {failed[transport.faulty_url]}"
        assert "<Error>" not in message  # S3's code and message, not its XML
    assert transport.faulty_url in message
    for words in case.says:
        assert words in message
    assert_logs_clean(transport, debug_logs)
    assert_cache_clean(transport.cache_dir)


@pytest.mark.parametrize(
    ("transport", "fault"),
    [c for c in cases(FAULTS) if c.values[1] in ("403", "503")],
    indirect=["transport"],
)
def test_a_loader_whose_fetch_fails_shows_no_secret(
    transport: Transport, fault: str, debug_logs: list[str]
) -> None:
    dataset = fl.open_dataset(
        transport.url,
        format="files",
        cache_dir=str(transport.cache_dir),
        storage_options=transport.storage_options,
        fetch=QUICK,
    )
    case = FAULTS[transport.settings.remote][fault]
    case.inject(transport.server)
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
    assert transport.faulty_url in message
    for words in case.says:
        assert words in message
    assert_logs_clean(transport, debug_logs)
    assert_cache_clean(transport.cache_dir)


def test_a_refused_listing_shows_no_secret(transport: Transport, debug_logs: list[str]) -> None:
    if transport.settings.remote == "s3":
        transport.server.fail_next(1000, 403, path_contains=f"/{BUCKET}", methods=["GET"])
    else:  # every request: the repository's info, its tree
        transport.server.fail_next(1000, 403, code="GatedRepo", message=GATED)
    with pytest.raises(RemoteAccessError) as caught:
        warm(transport)
    assert_exception_clean(caught.value)
    assert transport.url in str(caught.value)
    assert transport.settings.refused in str(caught.value)
    assert_logs_clean(transport, debug_logs)


WRONG_HF_TOKEN = "hf_WrongTokenAbCdEfGhIjKlMnOpQrStUv"


# Only the Hub checks credentials: the loopback S3 server does not verify signatures (a
# wrong secret would be served), so S3's refusals are the injected 403s above.
@pytest.mark.parametrize("transport", ["hub"], indirect=True)
@pytest.mark.parametrize("token", [False, WRONG_HF_TOKEN], ids=["none", "wrong"])
def test_a_missing_or_wrong_hub_token_is_refused_and_no_token_is_shown(
    transport: Transport, token: str | bool, debug_logs: list[str]
) -> None:
    with pytest.raises(RemoteAccessError) as caught:
        fl.warm(
            transport.url,
            cache_dir=str(transport.cache_dir),
            storage_options={**transport.storage_options, "token": token},
        )
    assert "401" in str(caught.value)
    assert transport.url in str(caught.value)
    assert transport.server.stats()["unauthorized"] >= 1
    assert_exception_clean(caught.value)
    printed = "".join(traceback.format_exception(caught.value))
    assert WRONG_HF_TOKEN not in printed + "\n".join(debug_logs)
    # Then with the right token: the warm succeeds, and every log line and file is clean.
    report = warm(transport)
    assert report.ok, report.failures
    assert report.fetched == 2
    assert_clean(repr(report) + json.dumps(report.to_dict()), "the report")
    assert WRONG_HF_TOKEN not in "\n".join(debug_logs)
    assert_logs_clean(transport, debug_logs)
    assert_cache_clean(transport.cache_dir)


@pytest.mark.parametrize("transport", ["hub"], indirect=True)
def test_what_the_hub_client_logs_is_scrubbed(transport: Transport, debug_logs: list[str]) -> None:
    """The last line of defence covers the HTTP client huggingface_hub sends with, whichever
    it is (httpx; httpx2 from huggingface_hub 2): a record its loggers make with a token in
    it reaches no handler with the token."""
    import huggingface_hub

    client = type(huggingface_hub.get_session()).__module__.split(".")[0]
    core = client.replace("httpx", "httpcore")  # its connection layer
    for name in (client, f"{core}.http11"):
        assert name in logging.Logger.manager.loggerDict, f"{name} logs (the premise)"
        logging.getLogger(name).debug(
            "send_request_headers.started request=%s",
            [(b"Authorization", f"Bearer {HF_TOKEN}".encode())],
        )
    assert sum(line.startswith((f"{client}:", f"{core}.http11:")) for line in debug_logs) == 2
    assert_clean("\n".join(debug_logs), "the DEBUG logs")


# --- the fastload script ------------------------------------------------------------------------

FASTLOAD = str(Path(sys.executable).parent / "fastload")
SCRIPT_ATTEMPTS = f"after {FetchConfig().retries + 1} attempts"
# S3's other 503: s3fs retries SlowDown five more times inside each of fastload's nine
# attempts (seconds each); the text the script shows takes the same path either way.
CLI_FAULTS: dict[str, dict[str, Fault]] = {
    "s3": {
        "403": Fault(_status(403), RemoteAccessError, ("403 AccessDenied",)),
        "503": Fault(
            lambda s: s.fail_next(
                1000, 503, code="ServiceUnavailable", path_contains=FAULTY, methods=["GET"]
            ),
            None,
            ("503 ServiceUnavailable", SCRIPT_ATTEMPTS),
        ),
    },
    "hf": {
        "403": Fault(_hub_status(403, "GatedRepo", GATED), RemoteAccessError, ("403 GatedRepo",)),
        "503": Fault(_hub_status(503), None, ("503 Service Unavailable", SCRIPT_ATTEMPTS)),
    },
}


def start_fastload(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [FASTLOAD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"fastload ran past 300 s:\n{err}")
    return process.returncode, out, err


# 503: nine attempts with fastload's default backoff, ~10 s (the two runs at once)
@pytest.mark.parametrize(
    ("transport", "fault"), cases(CLI_FAULTS, **{"503": pytest.mark.slow}), indirect=["transport"]
)
def test_the_fastload_script_shows_no_secret(
    transport: Transport, fault: str, tmp_path: Path
) -> None:
    case = CLI_FAULTS[transport.settings.remote][fault]
    premise = subprocess.run(
        [
            sys.executable,
            "-c",
            "from fastload.remote import connect as transport, urls as remote;"
            f"print(type(transport.transport_for(remote.open_filesystem({transport.url!r})[0]))"
            ".__name__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=transport.env,
    )
    assert premise.stdout.strip() == transport.settings.sends, "the premise"
    case.inject(transport.server)
    # The JSON report and the text summary, each into a cache of its own, at once.
    caches = {"json": tmp_path / "cli-cache", "text": tmp_path / "cli-cache-text"}
    runs = {
        "json": start_fastload(["warm", transport.url, "--json"], transport.env),
        "text": start_fastload(
            ["warm", transport.url, "--cache-dir", str(caches["text"])], transport.env
        ),
    }
    for mode, process in runs.items():
        code, out, err = finish(process)
        assert code == 1, err
        assert "Traceback" not in err
        assert_clean(err, f"the script's stderr ({mode})")
        assert_clean(out, f"the script's stdout ({mode})")
        assert_cache_clean(caches[mode])
        if case.raises is not None:
            assert out == ""
            (line,) = err.splitlines()
        else:
            if mode == "json":
                report = json.loads(out)
                assert [f["url"] for f in report["failures"]] == [transport.faulty_url]
            else:
                assert "fetched 1 " in out
                assert "failed 1 " in out
            (line,) = [line for line in err.splitlines() if transport.faulty_url in line]
        assert transport.faulty_url in line
        for words in case.says:
            assert words in line


# --- the last line of defence -------------------------------------------------------------------

SIGNATURE = "2YIml71Ky6eLTsZd28BkQeIi9mA"
SIGNED = (
    f"http://127.0.0.1:9000/{BUCKET}/{PREFIX}/{FAULTY}?AWSAccessKeyId={KEY_ID}"
    f"&Signature={SIGNATURE}%3D&x-amz-security-token={TOKEN}&Expires=1796293203"
)
# What backends write (the shapes of aiohttp's, botocore's, s3fs's and huggingface_hub's
# texts), and a part of it that must stay.
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
    "a Bearer header": (
        f"headers: {{'authorization': 'Bearer {HF_TOKEN}', 'user-agent': 'hf'}}",
        "'user-agent': 'hf'",
    ),
    "huggingface_hub's curl": (
        f"Send: curl -X GET -H 'authorization: Bearer {HF_TOKEN}'\n-H 'host: hub'",
        "-H 'host: hub'",
    ),
    "an hf token field": (f"token={HF_TOKEN}&x=1", "&x=1"),
    "an hf token alone": (f"it was {HF_TOKEN}.", "it was <redacted>."),
}


@pytest.mark.parametrize(("text", "kept"), TEXTS.values(), ids=TEXTS.keys())
def test_scrub_removes_every_credential_and_keeps_the_rest(text: str, kept: str) -> None:
    from fastload.remote import scrub

    clean = scrub(text)
    for secret in (KEY_ID, SECRET, TOKEN, HF_TOKEN, SIGNATURE, "c2VjcmV0"):
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
            raise classify(exc, f"s3://{BUCKET}/{PREFIX}/{FAULTY}") from clean_cause(exc)

    with pytest.raises(RemoteError) as caught:
        fetch()
    assert_exception_clean(caught.value)
    assert "500" in str(caught.value)
    printed = "".join(traceback.format_exception(caught.value))
    assert "aiohttp.client_exceptions.ClientResponseError" in printed  # what it was
    assert f"127.0.0.1:9000/{BUCKET}/{PREFIX}/{FAULTY}" in printed  # and where it went
