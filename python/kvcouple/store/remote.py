"""Which object-storage reads the Rust engine's own client makes, and with what settings.

The engine fetches an ``s3://`` store's objects itself (``kvcouple._core.ObjectFetcher``:
object_store, many requests in flight, the GIL released) when every setting it needs is
given explicitly, in ``storage_options`` or the standard AWS environment variables:

- credentials (``key``/``secret``, or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), or
  anonymous access (``anon=True``);
- an endpoint (``endpoint_url``, ``client_kwargs={"endpoint_url": ...}``,
  ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``) or a region (``client_kwargs={"region_name":
  ...}``, ``AWS_REGION``/``AWS_DEFAULT_REGION``).

Anything else (profiles in ``~/.aws``, SSO, instance roles, a storage option only fsspec
knows, ``gs://``, ``az://``) is read through fsspec, whose credential chain is botocore's: the
same bytes, more slowly. :func:`engine_settings` says which, and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# fsspec (s3fs) storage options the engine's client understands; any other is fsspec's alone.
_UNDERSTOOD = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        if environ.get(n):
            return environ[n]
    return None


def engine_settings(
    url: str, storage_options: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[list[tuple[str, str]] | None, str]:
    """``(settings, why)``: object_store's S3 settings for the engine's own client, or None
    (read through fsspec) with the reason. Options override the environment, as in s3fs."""
    env = os.environ if environ is None else environ
    if not url.startswith("s3://"):
        return None, f"{url.split('://')[0]}:// is read through fsspec"
    unknown = sorted(set(storage_options) - _UNDERSTOOD)
    client = dict(storage_options.get("client_kwargs") or {})
    unknown += sorted(f"client_kwargs.{k}" for k in set(client) - _CLIENT_KWARGS)
    if unknown:
        return None, f"storage option {unknown[0]!r} is understood by fsspec only"
    endpoint = (
        storage_options.get("endpoint_url")
        or client.get("endpoint_url")
        or _first(env, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    )
    region = client.get("region_name") or _first(env, "AWS_REGION", "AWS_DEFAULT_REGION")
    if not endpoint and not region:
        return None, "no endpoint or region is set (botocore would look the region up)"
    settings: list[tuple[str, str]] = []
    if endpoint:
        settings.append(("aws_endpoint_url", str(endpoint)))
        if str(endpoint).startswith("http://"):
            settings.append(("aws_allow_http", "true"))
    # object_store signs for us-east-1 when no region is given, as S3-compatible servers expect.
    settings.append(("aws_region", str(region or "us-east-1")))
    if storage_options.get("anon"):
        return settings + [("aws_skip_signature", "true")], "anonymous"
    key = storage_options.get("key") or env.get("AWS_ACCESS_KEY_ID")
    secret = storage_options.get("secret") or env.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        return None, "no explicit credentials (botocore's chain finds profiles and roles)"
    settings += [("aws_access_key_id", str(key)), ("aws_secret_access_key", str(secret))]
    token = storage_options.get("token") or (
        env.get("AWS_SESSION_TOKEN") if "key" not in storage_options else None
    )
    if token:
        settings.append(("aws_session_token", str(token)))
    return settings, "explicit credentials"
