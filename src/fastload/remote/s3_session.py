"""What botocore would resolve for an s3fs filesystem's session, where it can be said
without botocore: the endpoint, region, TLS trust and keys that :mod:`.obstore` sends with.

Only the plain cases, where the answer is certain: storage options among ``key``,
``secret``, ``token``, ``anon``, ``endpoint_url`` and ``client_kwargs`` (``endpoint_url``,
``region_name``, ``verify``); keys given there or in ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` or the default profile of ``~/.aws/credentials`` (or none, with
``anon``); a ``~/.aws/config`` whose default profile names at most a region; and no
``AWS_*`` variable beyond those, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION`` and
``AWS_CA_BUNDLE``. Anything else (profiles, instance roles, SSO, custom endpoints from the
config, FIPS or dual-stack endpoints...) is botocore's to resolve: None, and the caller
opens s3fs's session as before.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass
from typing import Any

# storage options that change nothing botocore resolves (max_concurrency: s3fs's own)
_PLAIN_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs"}
_QUIET_OPTIONS = {"max_concurrency", "default_block_size", "skip_instance_cache"}
_PLAIN_CLIENT_KWARGS = {"endpoint_url", "region_name", "verify"}
_PLAIN_ENV = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_CA_BUNDLE",
}
# botocore's default region for S3 where nothing names one (its global endpoint's)
_DEFAULT_REGION = "us-east-1"
# Regions of partitions whose S3 endpoints are not *.amazonaws.com(.cn)
_OTHER_PARTITIONS = ("us-iso", "eu-iso")


@dataclass(frozen=True)
class S3Session:
    """The session's settings: endpoint_url None for AWS's own endpoints; credentials
    (access key, secret, token) None when anonymous."""

    endpoint_url: str | None
    region: str
    verify: bool | str | None
    credentials: tuple[str, str, str | None] | None

    def __repr__(self) -> str:
        return f"S3Session(endpoint_url={self.endpoint_url!r}, region={self.region!r})"


# Keys of the default profile that change nothing else botocore resolves
_PLAIN_CONFIG_KEYS = {"region", "output"}
_PLAIN_CREDENTIAL_KEYS = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}


def _aws_files() -> tuple[str | None, tuple[str, str, str | None] | None] | None:
    """(the region of ~/.aws/config's default profile, the keys of ~/.aws/credentials'),
    each None where the file (or the profile) is absent; None where the default profile
    says more than a region (a role, SSO, an endpoint, a credential process...) or keys,
    or a file does not parse."""
    home = os.path.expanduser("~")
    region: str | None = None
    keys: tuple[str, str, str | None] | None = None
    for name, allowed in (("config", _PLAIN_CONFIG_KEYS), ("credentials", _PLAIN_CREDENTIAL_KEYS)):
        path = os.path.join(home, ".aws", name)
        if not os.path.exists(path):
            continue
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError):
            return None
        if parser.has_section("profile default"):
            return None  # which of the two sections botocore reads is for botocore to say
        if not parser.has_section("default"):
            continue
        section = dict(parser.items("default"))
        if not set(section) <= allowed:
            return None
        if name == "config":
            region = section.get("region") or None
        elif section.get("aws_access_key_id") and section.get("aws_secret_access_key"):
            token = section.get("aws_session_token") or None
            keys = (section["aws_access_key_id"], section["aws_secret_access_key"], token)
        elif section:
            return None  # half a pair
    return region, keys


def plain_session(options: dict[str, Any]) -> S3Session | None:
    """The session botocore would make for these s3fs options, or None where only botocore
    can say (see the module docstring)."""
    if not set(options) <= _PLAIN_OPTIONS | _QUIET_OPTIONS:
        return None
    client = options.get("client_kwargs") or {}
    if not isinstance(client, dict) or not set(client) <= _PLAIN_CLIENT_KWARGS:
        return None
    env = os.environ
    if any(name.startswith("AWS_") and name not in _PLAIN_ENV for name in env):
        return None
    files = _aws_files()
    if files is None:
        return None
    region_in_file, keys_in_file = files
    endpoint = options.get("endpoint_url")
    if endpoint and client.get("endpoint_url") and endpoint != client["endpoint_url"]:
        return None  # s3fs refuses both: let it say so
    endpoint = client.get("endpoint_url") or endpoint or None
    if endpoint is not None and not isinstance(endpoint, str):
        return None
    region = (
        client.get("region_name") or env.get("AWS_DEFAULT_REGION") or region_in_file
    ) or _DEFAULT_REGION
    if not isinstance(region, str) or region.startswith(_OTHER_PARTITIONS):
        return None  # endpoints outside amazonaws.com(.cn): botocore knows them
    credentials: tuple[str, str, str | None] | None = None
    if not options.get("anon"):
        key, secret, token = options.get("key"), options.get("secret"), options.get("token")
        if key is None and secret is None and token is None:
            key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
            token = env.get("AWS_SESSION_TOKEN")
            if key is None and secret is None and keys_in_file is not None:
                key, secret, token = keys_in_file  # botocore's shared credentials file
        if not (isinstance(key, str) and key and isinstance(secret, str) and secret):
            return None  # an instance role, a profile, a half-given pair: botocore's
        credentials = (key, secret, token or None)
    return S3Session(endpoint, region, client.get("verify"), credentials)
