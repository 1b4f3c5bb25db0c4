"""Content-addressed artifact store: a local folder (default) or an S3/MinIO bucket.

Every stage output is an artifact at ``<root>/<stage>/<key>/`` holding either
``data.parquet`` (a table with the explicit schema of its format, see `schemas`) or
``model/`` (a Hugging Face ``save_pretrained`` folder with safetensors), plus
``_COMMIT.json``: the `ArtifactRef`, the stage config and input keys, and metrics.
Readers only trust an artifact with a commit record, and the record is written last.

* `LocalStore` (a path or ``file://`` URI): an artifact is assembled in
  ``<root>/.staging/`` and moved into place with one ``rename``; the first rename wins.
* `S3Store` (``s3://bucket/prefix?endpoint_url=...``): data objects go to a fresh attempt
  folder ``<stage>/<key>/<attempt>/``, then the commit record naming that attempt is
  created with a conditional PUT; the first commit wins (see `farmflow.storage.s3`).

Both share one implementation over an fsspec filesystem (`Store`): same layout, same
stage keys, same row logs (``_rows/``), checkpoints (``_checkpoints/``) and Prefect
results (``_prefect/``). `farmflow.storage.sql` puts DuckDB views over a store.

The stage key is ``sha256(stage name, stage code version, stage config, input keys)``
over canonical JSON, so it is the same on every machine and in every process.
"""

from __future__ import annotations

from farmflow.storage.errors import CorruptArtifact, StoreError
from farmflow.storage.local import LocalStore
from farmflow.storage.refs import COMMIT_FILE, ArtifactRef, canonical_json, digest, part_key, stage_key
from farmflow.storage.schemas import SCHEMAS, conform
from farmflow.storage.store import Store


def open_store(uri: str) -> Store:
    """The store for a location: a local path, a ``file://`` URI or ``s3://bucket/prefix[?options]``.

    An S3 store is checked right away (one listing): an unreachable endpoint, a missing
    bucket or bad credentials raise one `StoreError` naming the endpoint and bucket.
    """
    uri = str(uri)
    if uri.startswith("s3://"):
        from farmflow.storage.s3 import S3Store

        return S3Store(uri)
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"store URI {uri.split('?')[0]!r}: only local folders, file:// and s3:// URIs are supported")
    return LocalStore(uri)


__all__ = [
    "COMMIT_FILE",
    "ArtifactRef",
    "CorruptArtifact",
    "LocalStore",
    "SCHEMAS",
    "Store",
    "StoreError",
    "canonical_json",
    "conform",
    "digest",
    "open_store",
    "part_key",
    "stage_key",
]
