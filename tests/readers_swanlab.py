"""Reading an offline SwanLab run back from its own files.

A run folder ``<log_dir>/run-<time>-<id>/`` holds ``run-<id>.swanlab`` (a record log read with
SwanLab's ``DataStoreReader``; each record a ``record_pb2.Record``), ``files/config.yaml`` (each
config key as ``{desc, sort, value}``) and ``media/echarts/<file>.json`` for echarts tables.
``MessageToDict`` is avoided on purpose: it drops step 0 and 0.0 values.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class SwanLabRun:
    path: Path
    name: str = ""
    project: str = ""
    scalars: list[tuple[str, int, float]] = field(default_factory=list)  # (key, step, value) in file order
    media: list[tuple[str, int, list[str]]] = field(default_factory=list)  # (key, step, file names)
    finish_state: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def tables(self, key: str) -> list[tuple[int, dict[str, Any]]]:
        """(step, echarts table JSON) of every table logged under ``key``."""
        found = []
        for media_key, step, files in self.media:
            if media_key == key:
                for name in files:
                    found.append((step, json.loads((self.path / "media" / "echarts" / name).read_text())))
        return found


def run_dirs(log_dir: Path | str) -> list[Path]:
    return sorted(p for p in Path(log_dir).glob("run-*") if p.is_dir())


def read_run(run_dir: Path | str) -> SwanLabRun:
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    run_dir = Path(run_dir)
    (store,) = run_dir.glob("*.swanlab")
    run = SwanLabRun(path=run_dir)
    reader = DataStoreReader()
    reader.open(store)
    try:
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                run.name, run.project = record.start.name, record.start.project
            elif kind == "scalar":
                run.scalars.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
            elif kind == "media":
                files = [item.filename for item in record.media.value.items]
                run.media.append((record.media.key, record.media.step, files))
            elif kind == "finish":
                run.finish_state = (
                    Record.DESCRIPTOR.fields_by_name["finish"]
                    .message_type.fields_by_name["state"]
                    .enum_type.values_by_number[record.finish.state]
                    .name
                )
    finally:
        reader.close()
    config_file = run_dir / "files" / "config.yaml"
    if config_file.exists():
        raw = yaml.safe_load(config_file.read_text()) or {}
        run.config = {key: entry["value"] for key, entry in raw.items()}
    return run


def wait_for_run(log_dir: Path | str, count: int = 1, timeout: float = 20.0) -> list[SwanLabRun]:
    """The ``count`` finished runs under ``log_dir`` (polls until each has its finish record)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = [read_run(d) for d in run_dirs(log_dir)]
        if len(runs) >= count and all(r.finish_state is not None for r in runs):
            return runs
        if time.monotonic() > deadline:
            raise AssertionError(
                f"expected {count} finished swanlab run(s) under {log_dir}, got "
                f"{[(r.path.name, r.finish_state) for r in runs]}"
            )
        time.sleep(0.05)
