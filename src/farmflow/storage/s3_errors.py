"""What an S3 client error means: its code, a lost conditional PUT, an endpoint that cannot be reached."""

from __future__ import annotations

import asyncio

LOST_RACE_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}
"""Answers to a conditional PUT (If-None-Match: *) whose object exists or is being written: AWS sends 412
PreconditionFailed or 409 ConditionalRequestConflict; s3fs maps only some of them to FileExistsError."""
ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}


def error_code(err: BaseException) -> str | None:
    """The S3 error code (NoSuchBucket, InvalidAccessKeyId, ...) anywhere in an exception's chain."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        response = getattr(err, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
        err = err.__cause__ or err.__context__
    return None


def is_connection_error(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from, says the endpoint could not be reached."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, HTTPClientError

    kinds: tuple[type, ...] = (
        BotoConnectionError,
        ConnectTimeoutError,
        EndpointConnectionError,
        HTTPClientError,
        ConnectionError,
        asyncio.TimeoutError,
    )
    try:
        import aiohttp

        kinds += (aiohttp.ClientConnectionError,)
    except ImportError:  # pragma: no cover
        pass
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, kinds):
            return True
        err = err.__cause__ or err.__context__
    return False
