"""Checks a command makes before any work: the store answers, the output can be written, a store to read exists.

Each failure is one line (a `CliError`, or a `StoreError` from the store itself), seconds after the command starts
rather than after Prefect's temporary API, the imports of torch and the first stages. A store URI's scheme is checked
earlier still, by the config (`farmflow.config.StoreConfig`).
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode

from farmflow.cli.errors import CliError, UsageError

STORE_CHECK_S = 10.0
"""Longest wait for an S3 store's first answer before the command gives up."""


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_folder(folder: Path, what: str) -> None:
    """`folder` is (or is now created as) a folder this process can write a file in: tried, not inferred from
    permission bits, which say yes to root on a read-only filesystem or in /proc."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{what} {folder} is a file, not a folder")
    existing = _nearest_existing(folder.absolute())
    if not existing.is_dir():
        raise UsageError(f"{what} {folder}: {existing} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".farmflow-write-check-"):
            pass
    except OSError as err:
        raise UsageError(f"{what} {folder} is not writable ({err.strerror or type(err).__name__})") from None


def writable_output(path: Optional[Path], what: str = "--output") -> None:
    """The file `path` can be written (its folder exists and is writable; it is not a folder)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path} is a folder; give a file name")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise UsageError(f"{what} {path}: the folder {folder} does not exist")
    existed = path.exists()
    try:  # tried, not inferred from permission bits (module doc of `writable_folder`)
        with path.open("ab"):
            pass
    except OSError as err:
        raise UsageError(f"{what} {path} is not writable ({err.strerror or type(err).__name__})") from None
    if not existed:
        path.unlink(missing_ok=True)


def _one_attempt(location: str) -> str:
    base, _, query = location.partition("?")
    return base + "?" + urlencode(dict(parse_qsl(query)) | {"max_attempts": "1"})


def open_s3_quickly(location: str, timeout_s: float = STORE_CHECK_S) -> Any:
    """Open an s3:// store with one attempt per request and a deadline: an unreachable endpoint, a missing bucket or
    bad credentials fail in seconds, in one line (a `StoreError` naming endpoint and bucket, or a CliError)."""
    import farmflow.storage.s3  # noqa: F401 - imported first: on a busy machine the imports alone take seconds
    from farmflow.storage import open_store

    result: dict[str, Any] = {}

    def attempt() -> None:
        try:
            result["store"] = open_store(_one_attempt(location))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = err

    thread = threading.Thread(target=attempt, name="store-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in result:
        raise result["error"]
    if "store" not in result:
        raise CliError(f"store {location.split('?')[0]}: no answer within {timeout_s:g} s (is the endpoint up?)")
    return result["store"]


def check_store(location: str) -> None:
    """The store a run will write: an S3 store answers (`open_s3_quickly`), a local one can be created or written."""
    if location.startswith("s3://"):
        open_s3_quickly(location)
        return
    writable_folder(Path(location.removeprefix("file://")), "store")


def location_of(store: Optional[str]) -> str:
    """The store `--store` names (default $FARMFLOW_STORE, else ./.farmflow/store)."""
    from farmflow.config import StoreConfig

    return store or StoreConfig().location


def writable_store(store: Optional[str]) -> Any:
    """Open the store `--store` names for writing (`check_store` first; a local one is created when missing)."""
    from farmflow.storage import open_store

    location = location_of(store)
    check_store(location)
    return open_store(location)


def existing_store(location: str) -> Any:
    """Open a store a command only reads: a local one must exist (nothing is created); an S3 one must answer."""
    from farmflow.storage import open_store

    if location.startswith("s3://"):
        open_s3_quickly(location)
        return open_store(location)  # with the configured retries for what follows
    root = Path(location.removeprefix("file://"))
    if not root.is_dir():
        raise CliError(
            f"store {root} does not exist" + (" (it is a file)" if root.exists() else "") + "; give --store the folder "
            "a run wrote (default $FARMFLOW_STORE, else ./.farmflow/store)"
        )
    return open_store(location)
