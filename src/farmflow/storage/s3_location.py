"""Where an S3 store is and who may use it: its location string and its credentials.

Location: ``s3://bucket/prefix``, with non-secret options as query parameters (`OPTIONS`), so
one string carries the whole store to every task and worker. Credentials never appear in it:
they come from the standard AWS chain or from a Prefect ``Secret`` block (`block_credentials`).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from farmflow.config.credentials import CredentialsInValue, refuse_credentials
from farmflow.storage.errors import StoreError

OPTIONS = {
    "endpoint_url": "S3-compatible endpoint (MinIO: http://host:9000); default $AWS_ENDPOINT_URL_S3 / "
    "$AWS_ENDPOINT_URL, else AWS",
    "region": "AWS region; default the AWS chain's ($AWS_DEFAULT_REGION, profile)",
    "profile": "named AWS profile (~/.aws/credentials, ~/.aws/config)",
    "credentials_block": "name of a Prefect Secret block with aws_access_key_id and aws_secret_access_key",
    "max_attempts": "attempts per S3 request; transient errors are retried with backoff (botocore standard mode)",
    "cache_dir": "local folder for downloaded models and checkpoints",
}


def parse_s3_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    """``s3://bucket/prefix?opt=value`` → (bucket, prefix, options); unknown options are an error."""
    try:
        refuse_credentials(uri, "S3 credentials come from profile, credentials_block or the AWS environment")
    except CredentialsInValue as err:
        raise StoreError(f"store URI: {err}") from None
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        raise StoreError(f"store URI {uri.split('?')[0]!r}: expected s3://bucket/prefix")
    options = dict(parse_qsl(parts.query, keep_blank_values=False))
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise StoreError(
            f"store URI s3://{parts.netloc}{parts.path}: unknown option(s) {unknown}; known: {', '.join(OPTIONS)}"
        )
    return parts.netloc, parts.path.strip("/"), options


def s3_location(bucket: str, prefix: str, options: dict[str, Any]) -> str:
    """The inverse of `parse_s3_uri` (options that are None are left out)."""
    query = urlencode({k: v for k, v in options.items() if v is not None})
    return f"s3://{bucket}/{prefix}".rstrip("/") + (f"?{query}" if query else "")


def block_credentials(name: str) -> dict[str, str]:
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except Exception as err:  # noqa: BLE001 - any failure to load is one clear error
        raise StoreError(
            f"cannot load the Prefect Secret block {name!r} with the S3 credentials ({type(err).__name__})"
        ) from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict) or not {"aws_access_key_id", "aws_secret_access_key"} <= set(value):
        raise StoreError(
            f"Prefect Secret block {name!r}: expected JSON with aws_access_key_id and aws_secret_access_key"
        )
    return {
        "key": value["aws_access_key_id"],
        "secret": value["aws_secret_access_key"],
        "token": value.get("aws_session_token"),
    }
