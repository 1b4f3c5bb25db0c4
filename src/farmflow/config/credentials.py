"""Credentials never travel inside a setting: a URL carrying them is refused with a message that does not repeat it.

Used by the config's validators (store URI, annotator endpoints) and by the code that reads the same kind of value from
elsewhere (`farmflow.storage.s3` for a store URI given directly, `farmflow.annotators.cache` for $OPENAI_BASE_URL).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit


class CredentialsInValue(ValueError):
    """A setting that carries credentials; its error message never repeats the value."""


SECRET_QUERY_PARAMS = frozenset(
    {
        "key",
        "api_key",
        "apikey",
        "api-key",
        "token",
        "access_token",
        "auth",
        "secret",
        "password",
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)


def refuse_credentials(url: str | None, where: str) -> str | None:
    """`url` unchanged, or CredentialsInValue when it carries credentials (user:password@host, or a key, token or
    signature query parameter): those would end up in logs, Prefect parameters and artifact records. `where` says
    how to give them instead."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        userinfo = parts.username is not None or parts.password is not None
    except ValueError:
        return url  # not a URL: other checks say what is wrong with it
    secret = sorted({k for k, _ in parse_qsl(parts.query) if k.lower() in SECRET_QUERY_PARAMS})
    if userinfo:
        raise CredentialsInValue(f"must not carry credentials (user:password@ in the URL); {where}")
    if secret:
        raise CredentialsInValue(f"must not carry credentials (query parameter {', '.join(secret)}); {where}")
    for _, value in parse_qsl(parts.query):  # a URL inside, e.g. s3://bucket/prefix?endpoint_url=...
        if "://" in value:
            refuse_credentials(value, where)
    return url
