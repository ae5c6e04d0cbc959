"""Reading an offline wandb run back from its own files (wandb 0.31 ships no reader).

``run-<id>.wandb`` is a record log: a 7-byte header (``<4sHB>``: ``b":W&B"``, ``0xBEE1``, version 0),
then 32 KiB blocks of chunks, each with a ``<IHB>`` header (crc32, length, type: 1 full, 2 first,
3 middle, 4 last), the crc being ``zlib.crc32(data, zlib.crc32(bytes([type])))``.  Each whole record
is a ``wandb_internal_pb2.Record``.  Tables logged with ``wandb.Table`` appear in history as
reference dicts; their rows are in ``files/media/table/**/*.table.json`` under the run folder.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path | str) -> list[Any]:
    """Every whole, checksum-valid record of a ``.wandb`` file (a torn tail is ignored)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        return []
    magic, _, version = _HEADER.unpack_from(data, 0)
    assert magic == b":W&B" and version == 0, f"not a wandb record log: {path}"
    records: list[Any] = []
    pos, pending = _HEADER.size, b""
    while pos + _CHUNK.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK.size:  # block trailer padding
            pos += left_in_block
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        start, end = pos + _CHUNK.size, pos + _CHUNK.size + length
        if end > len(data) or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            break
        chunk = data[start:end]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            break
        pos = end
        if kind == _FULL:
            pending = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        else:
            pending += chunk
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        records.append(record)
        pending = b""
    return records


def run_files(root: Path | str) -> list[Path]:
    return sorted(Path(root).rglob("run-*.wandb"))


def wait_for_exit(path: Path | str, timeout_s: float = 60.0) -> list[Any]:
    """The records of a finished run: polls until its ``exit`` record is written."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_records(path) if Path(path).exists() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"no exit record in {path} after {timeout_s} s")
        time.sleep(0.05)


def _value(item: Any) -> Any:
    return json.loads(item.value_json)


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class WandbRun:
    """What one offline run stored."""

    path: Path  # the .wandb file
    records: list[Any]
    rows: list[dict[str, Any]] = field(default_factory=list)  # history rows, with _step

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def run(self) -> Any:
        return next(r.run for r in self.records if r.WhichOneof("record_type") == "run")

    @property
    def exit_code(self) -> int:
        return next(r.exit.exit_code for r in self.records if r.WhichOneof("record_type") == "exit")

    def config(self) -> dict[str, Any]:
        """The run's config as stored (run record, then config updates), without wandb's ``_wandb``."""
        config: dict[str, Any] = {}
        updates = [self.run.config] + [r.config for r in self.records if r.WhichOneof("record_type") == "config"]
        for update in updates:
            for item in update.update:
                config[_key(item)] = _value(item)
            for item in update.remove:
                config.pop(_key(item), None)
        config.pop("_wandb", None)
        return {
            k: v.get("value") if isinstance(v, dict) and set(v) <= {"value", "desc"} else v for k, v in config.items()
        }

    def triples(self) -> list[tuple[str, int, Any]]:
        """(key, step, value) of every user value in history, in order (NaN kept as float nan)."""
        out = []
        for row in self.rows:
            for key, value in row.items():
                if not key.startswith("_"):
                    out.append((key, row["_step"], value))
        return out

    def table_logs(self, key: str) -> list[dict[str, Any]]:
        """Every table logged under ``key``, in log order: ``step``, ``columns``, ``rows`` (the rows
        of that log's file), ``incremental`` (an INCREMENTAL table's increment) and ``table`` (all
        rows the table holds after that log: for an incremental table, its increments so far)."""
        out: list[dict[str, Any]] = []
        so_far: list[list[Any]] = []
        for row in self.rows:
            ref = row.get(key)
            if not isinstance(ref, dict) or "path" not in ref:
                continue
            stored = json.loads((self.run_dir / "files" / ref["path"]).read_text())
            incremental = ref.get("_type") == "incremental-table-file"
            if incremental:
                so_far = [] if ref.get("increment_num") == 0 else so_far
                so_far = so_far + stored["data"]
                table = so_far
            else:
                table = stored["data"]
            out.append(
                {
                    "step": row["_step"],
                    "columns": stored["columns"],
                    "rows": stored["data"],
                    "incremental": incremental,
                    "table": table,
                }
            )
        return out

    def all_text(self) -> str:
        """Every byte the run left on disk, as text (for secret scans)."""
        parts = []
        for file in sorted(self.run_dir.rglob("*")):
            if file.is_file():
                parts.append(file.read_bytes().decode("utf-8", "replace"))
        return "\n".join(parts)


def load_run(path: Path | str, timeout_s: float = 60.0) -> WandbRun:
    records = wait_for_exit(path, timeout_s)
    run = WandbRun(path=Path(path), records=records)
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            path = [item.key] if item.key else list(item.nested_key)
            target = row
            for part in path[:-1]:  # a logged dict or a media/table reference
                target = target.setdefault(part, {})
            target[path[-1]] = _value(item)
        if "_step" not in row and record.history.HasField("step"):
            row["_step"] = record.history.step.num
        run.rows.append(row)
    return run


def only_run(root: Path | str, timeout_s: float = 60.0) -> WandbRun:
    files = run_files(root)
    assert len(files) == 1, f"expected one wandb run under {root}, found {files}"
    return load_run(files[0], timeout_s)
