"""A real S3 server for tests: moto in server mode on 127.0.0.1, on a free port.

`s3_server` (session): the running server; fake credentials in the environment, and the
AWS config files pointed at nothing so no developer profile leaks in.
`s3_uri` (per test): a fresh bucket and the store location on it, with a per-test cache.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from contextlib import contextmanager
from urllib.request import Request, urlopen

import pytest

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "farmflow-test-key",
    "AWS_SECRET_ACCESS_KEY": "farmflow-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def client(self, **credentials):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", **credentials)

    def bucket(self) -> str:
        name = f"farm-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str) -> dict[str, bytes]:
        """Every object in the bucket: key → bytes."""
        client = self.client()
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])
        ]
        return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}

    @contextmanager
    def authentication(self):
        """Turn on moto's IAM authentication; yields (access key id, secret) of a user allowed s3:*."""
        iam = __import__("boto3").client("iam", endpoint_url=self.endpoint, region_name="us-east-1")
        user = f"farm-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self._reset_auth(0)
        try:
            yield key["AccessKeyId"], key["SecretAccessKey"]
        finally:
            self._reset_auth(float("inf"))

    def _reset_auth(self, count: float) -> None:
        request = Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=str(count).encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urlopen(request, timeout=10).read()

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    saved = {
        k: os.environ.get(k)
        for k in [
            *FAKE_ENV,
            "AWS_PROFILE",
            "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_SESSION_TOKEN",
        ]
    }
    nothing = tmp_path_factory.mktemp("aws") / "none"
    os.environ.update(FAKE_ENV, AWS_CONFIG_FILE=str(nothing), AWS_SHARED_CREDENTIALS_FILE=str(nothing))
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    server = S3Server()
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_uri(s3_server, tmp_path):
    """A store location in a fresh bucket, with its own local download cache."""
    bucket = s3_server.bucket()
    return f"s3://{bucket}/farm?endpoint_url={s3_server.endpoint}&cache_dir={tmp_path / 'cache'}"


class FlakyProxy:
    """A loopback HTTP proxy in front of the S3 server that answers the first `failures`
    requests with 503 SlowDown (a transient S3 error), then forwards everything."""

    def __init__(self, endpoint: str, failures: int):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(endpoint)
        proxy = self
        self.failures, self.failed, self.forwarded = failures, 0, 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers 'Expect: 100-continue' before reading a body

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = b""
                while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data

            def _handle(self):
                body = self._body()
                with proxy._lock:
                    fail = proxy.failed < proxy.failures
                    proxy.failed += fail
                    proxy.forwarded += not fail
                if fail:
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error if self.command != "HEAD" else b"")
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("expect", "transfer-encoding", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header(
                    "Content-Length",
                    resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)),
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
