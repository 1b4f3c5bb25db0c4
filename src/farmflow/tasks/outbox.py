"""The outbox between a launched stage's child and its parent (`farmflow.tasks.launch`).

The child writes the artifacts it would commit into an output folder (`OutboxStore`: reads go to the real store,
writes to the folder, by the main process only, in the order they happen); the parent commits them afterwards
(`commit_outbox`), so the stage key, the artifact and its record are the same as for a stage run inline.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from farmflow.storage import ArtifactRef, canonical_json
from farmflow.storage.refs import utc_now
from farmflow.storage.schemas import conform

RECORD = "artifact.json"


def commit_outbox(store, out: Path) -> list[ArtifactRef]:
    """Commit every artifact a child wrote into `out`, in the order it wrote them."""
    order = json.loads((out / "order.json").read_text()) if (out / "order.json").exists() else []
    refs = []
    for name in order:
        folder = out / name
        rec = json.loads((folder / RECORD).read_text())
        stage, key = rec["stage"], rec["key"]
        if store.get(stage, key) is not None:  # committed meanwhile (another run): first commit wins
            refs.append(store.get(stage, key))
            continue
        if rec["kind"] == "model":
            with store.put_model(stage, key, rec["format"], config=rec["config"], inputs=rec["inputs"]) as (
                model,
                metrics,
            ):
                model.rmdir()
                shutil.move(str(folder / "model"), str(model))
                metrics.update(rec["metrics"])
        else:
            tables = {name: (pq.read_table(folder / name), fmt) for name, fmt in rec.get("extra_tables", {}).items()}
            extra = {
                p.name: p.read_bytes() for p in folder.iterdir() if p.name not in (RECORD, "data.parquet", *tables)
            }
            store.put_table(
                stage,
                key,
                pq.read_table(folder / "data.parquet"),
                rec["format"],
                config=rec["config"],
                inputs=rec["inputs"],
                metrics=rec["metrics"],
                extra_files=extra,
                extra_tables=tables,
                parts=rec.get("parts"),
            )
        refs.append(store.get(stage, key))
    return refs


class OutboxStore:
    """The store a child stage sees: reads from `real`, writes artifacts into `out` (main process only), never
    commits."""

    def __init__(self, real, out: Path, writer: bool):
        self.real, self.out, self.writer = real, Path(out), writer
        self.written: dict[tuple[str, str], ArtifactRef] = {}

    def __getattr__(self, name: str) -> Any:  # read_table, model_dir, record, save_checkpoint, ...
        return getattr(self.real, name)

    def _folder(self, stage: str, key: str) -> Path:
        name = f"{stage}-{key}"
        folder = self.out / name
        folder.mkdir(parents=True, exist_ok=True)
        order = self.out / "order.json"
        names = json.loads(order.read_text()) if order.exists() else []
        order.write_text(json.dumps([*names, name]))
        return folder

    def _record(
        self,
        folder: Path,
        ref: ArtifactRef,
        config: Any,
        inputs: dict | None,
        extra_tables: dict[str, str] | None = None,
    ) -> None:
        record = {
            "stage": ref.stage,
            "key": ref.key,
            "kind": ref.kind,
            "format": ref.format,
            "metrics": ref.metrics,
            "parts": ref.parts,
            "extra_tables": extra_tables or {},
            "config": json.loads(canonical_json(config)) if config is not None else None,
            "inputs": {k: (v.key if isinstance(v, ArtifactRef) else v) for k, v in (inputs or {}).items()},
        }
        (folder / RECORD).write_text(json.dumps(record))
        self.written[(ref.stage, ref.key)] = ref.model_copy(update={"uri": str(folder)})

    def get(self, stage: str, key: str) -> ArtifactRef | None:
        return self.written.get((stage, key)) or self.real.get(stage, key)

    def put_table(
        self,
        stage: str,
        key: str,
        table: pa.Table,
        format: str,
        *,
        config: Any = None,
        inputs: dict | None = None,
        metrics: dict[str, float] | None = None,
        extra_files: dict[str, bytes] | None = None,
        extra_tables: dict[str, tuple[pa.Table, str]] | None = None,
        parts: dict[str, str] | None = None,
    ) -> ArtifactRef:
        """As `Store.put_table`; the parent commits it (`commit_outbox`), extra tables validated again there."""
        table = conform(table, format, where=f"stage {stage!r}")
        extra = {
            name: (conform(t, fmt, where=f"stage {stage!r} {name}"), fmt)
            for name, (t, fmt) in (extra_tables or {}).items()
        }
        ref = ArtifactRef(
            uri="",
            stage=stage,
            key=key,
            kind="table",
            format=format,
            rows=table.num_rows,
            created=utc_now(),
            metrics=dict(metrics or {}),
            parts=dict(parts or {}),
        )
        if self.writer:
            folder = self._folder(stage, key)
            pq.write_table(table, folder / "data.parquet")
            for name, data in (extra_files or {}).items():
                (folder / name).write_bytes(data)
            for name, (t, _) in extra.items():
                pq.write_table(t, folder / name)
            self._record(folder, ref, config, inputs, {name: fmt for name, (_, fmt) in extra.items()})
        return ref

    @contextmanager
    def put_model(
        self, stage: str, key: str, format: str, *, config: Any = None, inputs: dict | None = None
    ) -> Iterator[tuple[Path, dict]]:
        metrics: dict[str, float] = {}
        if not self.writer:  # other processes take part in gathering the weights, then discard
            with tempfile.TemporaryDirectory() as tmp:
                yield Path(tmp), metrics
            return
        folder = self._folder(stage, key)
        (folder / "model").mkdir()
        yield folder / "model", metrics
        if not any((folder / "model").glob("*.safetensors")):
            raise ValueError(f"stage {stage!r} saved no safetensors weights into its model artifact")
        ref = ArtifactRef(
            uri="", stage=stage, key=key, kind="model", format=format, rows=None, created=utc_now(), metrics=metrics
        )
        self._record(folder, ref, config, inputs)

    def clear_checkpoints(self, stage: str, key: str) -> None:
        """The parent drops them once it has committed the artifact."""

    def save_checkpoint(self, stage: str, key: str, step: int, folder: Path, keep: int = 2) -> None:
        if self.writer:
            self.real.save_checkpoint(stage, key, step, folder, keep)
