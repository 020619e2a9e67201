"""The settings obstore sends S3 requests with are the same whether fastload read them off
s3fs's botocore session (as before) or resolved them without importing s3fs: endpoint,
region, addressing, TLS trust, anonymity and the keys themselves, for each way a user
gives them (storage options, the environment). Where only botocore can say (a profile, a
config file, requester-pays...), the lazy filesystem opens s3fs's session as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastload.remote.lazy_s3 import LazyS3Filesystem
from fastload.remote.obstore import ObjectStoreTransport
from fastload.remote.s3_session import plain_session

_ENDPOINT = "http://127.0.0.1:9"
_CA = "/etc/ssl/certs/ca-certificates.crt"  # a PEM file of authorities
_KEYS = {"key": "AKIAOPTIONS", "secret": "options-secret"}

# (storage options, environment): each resolved without botocore
_PLAIN = {
    "client endpoint": ({**_KEYS, "client_kwargs": {"endpoint_url": _ENDPOINT}}, {}),
    "top endpoint": ({**_KEYS, "endpoint_url": _ENDPOINT}, {}),
    "both endpoints equal": (
        {**_KEYS, "endpoint_url": _ENDPOINT, "client_kwargs": {"endpoint_url": _ENDPOINT}},
        {},
    ),
    "aws, no region": (dict(_KEYS), {}),
    "aws, region option": ({**_KEYS, "client_kwargs": {"region_name": "eu-west-1"}}, {}),
    "aws, region env": (dict(_KEYS), {"AWS_DEFAULT_REGION": "ap-south-1"}),
    "aws endpoint named": ({**_KEYS, "endpoint_url": "https://s3.eu-west-1.amazonaws.com"}, {}),
    "token option": ({**_KEYS, "token": "tok", "endpoint_url": _ENDPOINT}, {}),
    "env keys": (
        {"endpoint_url": _ENDPOINT},
        {"AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "env-secret"},
    ),
    "env keys and token": (
        {"endpoint_url": "https://s3.example.com"},
        {"AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"},
    ),
    "options beat env": (
        {**_KEYS, "endpoint_url": _ENDPOINT},
        {"AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"},
    ),
    "anon": ({"anon": True, "endpoint_url": _ENDPOINT}, {}),
    "anon with keys": ({**_KEYS, "anon": True}, {}),
    "verify off": ({**_KEYS, "client_kwargs": {"endpoint_url": "https://h", "verify": False}}, {}),
    "ca bundle env": ({**_KEYS, "endpoint_url": "https://h"}, {"AWS_CA_BUNDLE": _CA}),
}

# Only botocore can say: the lazy filesystem opens s3fs's session.
_BOTOCORE = {
    "profile env": ({**_KEYS, "endpoint_url": _ENDPOINT}, {"AWS_PROFILE": "p"}),
    "requester pays": ({**_KEYS, "requester_pays": True}, {}),
    "config kwargs": ({**_KEYS, "config_kwargs": {"s3": {"addressing_style": "path"}}}, {}),
    "endpoint env": (dict(_KEYS), {"AWS_ENDPOINT_URL_S3": _ENDPOINT}),
    "half a pair": ({"key": "AKIAONLY", "endpoint_url": _ENDPOINT}, {}),
}


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No AWS_* variable and no ~/.aws of this machine's: each case sets its own."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role probe
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # sessions made under another case's variables
    return monkeypatch


def _settings(fs: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    transport = ObjectStoreTransport.from_s3fs(fs, 30.0)
    assert transport is not None
    settings = dict(transport._settings)
    provider = settings.pop("credential_provider", None)
    keys = None if provider is None else {k: v for k, v in provider().items() if k != "expires_at"}
    return settings, keys


def _s3fs(options: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


@pytest.mark.parametrize("case", sorted(_PLAIN))
def test_settings_resolved_without_botocore_equal_botocore_s(
    aws_env: pytest.MonkeyPatch, case: str
) -> None:
    options, env = _PLAIN[case]
    for name, value in env.items():
        aws_env.setenv(name, value)
    aws_env.delenv("AWS_EC2_METADATA_DISABLED")  # (a variable of its own, not plain)
    assert plain_session({**options, "max_concurrency": 1}) is not None
    lazy = LazyS3Filesystem({**options, "max_concurrency": 1})
    got = _settings(lazy)
    assert lazy._fs is None  # s3fs's filesystem never made
    assert got == _settings(_s3fs(options))


@pytest.mark.parametrize("case", sorted(_BOTOCORE))
def test_what_only_botocore_resolves_goes_through_s3fs_s_session(
    aws_env: pytest.MonkeyPatch, case: str
) -> None:
    options, env = _BOTOCORE[case]
    for name, value in env.items():
        aws_env.setenv(name, value)
    assert plain_session(options) is None
    lazy = LazyS3Filesystem(options)
    try:
        made = ObjectStoreTransport.from_s3fs(lazy, 30.0)
    except Exception:  # botocore's own refusal (an unknown profile): as before
        made = None
    if made is not None:
        assert _settings(lazy) == _settings(_s3fs(options))
    assert lazy._fs is not None


_CREDENTIALS_FILE = "[default]\naws_access_key_id = AKIAFILE\naws_secret_access_key = f\n"
# (~/.aws/config, ~/.aws/credentials, storage options, environment, said without botocore)
_FILES = {
    "config region": ("[default]\nregion = eu-central-1\n", None, _KEYS, {}, True),
    "env region beats config": (
        "[default]\nregion = eu-central-1\noutput = json\n",
        None,
        _KEYS,
        {"AWS_DEFAULT_REGION": "ap-south-1"},
        True,
    ),
    "credentials file": (None, _CREDENTIALS_FILE, {"endpoint_url": _ENDPOINT}, {}, True),
    "options beat credentials file": (None, _CREDENTIALS_FILE, _KEYS, {}, True),
    "env beats credentials file": (
        "[default]\nregion = us-west-2\n",
        _CREDENTIALS_FILE + "aws_session_token = ft\n",
        {"endpoint_url": _ENDPOINT},
        {"AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "env-secret"},
        True,
    ),
    "other profiles only": (
        "[profile x]\nrole_arn = arn:aws:iam::1:role/r\n",
        None,
        _KEYS,
        {},
        True,
    ),
    "role in config": ("[default]\nrole_arn = arn:aws:iam::1:role/r\n", None, _KEYS, {}, False),
    "endpoint in config": (f"[default]\nendpoint_url = {_ENDPOINT}\n", None, _KEYS, {}, False),
    "profile default": ("[profile default]\nregion = eu-west-3\n", None, _KEYS, {}, False),
    "region in credentials": (None, _CREDENTIALS_FILE + "region = eu-west-3\n", {}, {}, False),
}


@pytest.mark.parametrize("case", sorted(_FILES))
def test_aws_files_read_as_botocore_reads_them(aws_env: pytest.MonkeyPatch, case: str) -> None:
    import os

    config, credentials, options, env, plain = _FILES[case]
    home = Path(os.environ["HOME"])
    (home / ".aws").mkdir()
    for name, text in (("config", config), ("credentials", credentials)):
        if text is not None:
            (home / ".aws" / name).write_text(text)
    for name, value in env.items():
        aws_env.setenv(name, value)
    if plain:
        aws_env.delenv("AWS_EC2_METADATA_DISABLED")
    assert (plain_session(dict(options)) is not None) == plain
    lazy = LazyS3Filesystem(dict(options))
    assert _settings(lazy) == _settings(_s3fs(dict(options)))
    assert (lazy._fs is None) == plain  # s3fs's filesystem made only where botocore must say
