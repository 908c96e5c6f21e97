"""Which object-storage reads the engine's own client makes (kvcouple.store.object_storage),
and the client's errors at the boundary; no server needed."""

from __future__ import annotations

import pytest

from kvcouple import _core
from kvcouple.store.object_storage import engine_settings

ENV = {
    "AWS_ACCESS_KEY_ID": "k",
    "AWS_SECRET_ACCESS_KEY": "s",
    "AWS_DEFAULT_REGION": "eu-west-1",
}


def test_explicit_credentials_and_region_from_the_environment():
    settings, why = engine_settings("s3://b/run.zarr", {}, ENV)
    assert dict(settings) == {
        "aws_region": "eu-west-1",
        "aws_access_key_id": "k",
        "aws_secret_access_key": "s",
    }
    assert why == "explicit credentials"


def test_options_override_the_environment_and_http_endpoints_are_allowed():
    env = {**ENV, "AWS_ENDPOINT_URL": "https://elsewhere", "AWS_SESSION_TOKEN": "t-env"}
    opts = {"key": "k2", "secret": "s2", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    settings = dict(engine_settings("s3://b/x", opts, env)[0])
    assert settings["aws_endpoint_url"] == "http://127.0.0.1:9"
    assert settings["aws_allow_http"] == "true"
    assert settings["aws_access_key_id"] == "k2" and settings["aws_secret_access_key"] == "s2"
    # The environment's session token belongs to the environment's key, not to k2.
    assert "aws_session_token" not in settings
    with_env_key = dict(engine_settings("s3://b/x", {}, env)[0])
    assert with_env_key["aws_session_token"] == "t-env"
    assert with_env_key["aws_endpoint_url"] == "https://elsewhere"
    assert "aws_allow_http" not in with_env_key
    s3_only = dict(engine_settings("s3://b/x", {}, {**env, "AWS_ENDPOINT_URL_S3": "https://s3"})[0])
    assert s3_only["aws_endpoint_url"] == "https://s3"


def test_anonymous_access_needs_no_credentials():
    settings, why = engine_settings("s3://b/x", {"anon": True}, {"AWS_REGION": "us-west-2"})
    assert ("aws_skip_signature", "true") in settings and why == "anonymous"


@pytest.mark.parametrize(
    "url, opts, env, reason",
    [
        ("gs://b/x", {}, ENV, "gs:// is read through fsspec"),
        ("s3://b/x", {"profile": "lab"}, ENV, "'profile' is understood by fsspec only"),
        ("s3://b/x", {"client_kwargs": {"verify": False}}, ENV, "client_kwargs.verify"),
        ("s3://b/x", {}, {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, "no endpoint"),
        ("s3://b/x", {}, {"AWS_REGION": "us-east-1"}, "no explicit credentials"),
        ("s3://b/x", {"key": "k"}, {"AWS_REGION": "us-east-1"}, "no explicit credentials"),
    ],
)
def test_what_only_fsspec_can_do_goes_through_fsspec(url, opts, env, reason):
    settings, why = engine_settings(url, opts, env)
    assert settings is None and reason in why


def test_the_client_refuses_bad_addresses_and_settings_by_name():
    with pytest.raises(_core.InvalidInputError, match="not an s3:// address"):
        _core.ObjectFetcher("gs://b/x", [])
    with pytest.raises(_core.InvalidInputError, match="aws_no_such_setting"):
        _core.ObjectFetcher("s3://b/x", [("aws_no_such_setting", "1")])


def test_an_unreachable_server_is_an_os_error_naming_the_object():
    settings, _ = engine_settings("s3://b/run.zarr", {"endpoint_url": "http://127.0.0.1:9"}, ENV)
    fetcher = _core.ObjectFetcher("s3://b/run.zarr", settings, concurrency=1)
    assert fetcher.url == "s3://b/run.zarr" and "s3://b/run.zarr" in repr(fetcher)
    with pytest.raises(_core.ObjectStoreError, match="cannot fetch p/zarr.json") as err:
        fetcher.fetch(["p/zarr.json"])
    assert isinstance(err.value, OSError)


def test_the_old_module_name_still_reads_with_a_warning():
    """kvcouple.store.remote (renamed object_storage) reads for one release, and warns."""
    with pytest.warns(DeprecationWarning, match="kvcouple.store.object_storage.engine_settings"):
        from kvcouple.store.remote import engine_settings as old
    assert old is engine_settings
