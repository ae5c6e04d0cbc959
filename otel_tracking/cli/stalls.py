"""``otel-tracking stalls``: the stalls a run reported so far, at one glance.

Reads the ``ml.stall`` records (``runtime/stalls.py``) from the file sink's events files
(``<experiment>.events.jsonl``), and prints one row per stuck phase: its latest report (the
longest it was seen open), who (rank, role, pid, host), which phase at which step, how long, and
the line it was stuck in; ``--stacks`` adds each report's stacks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from otel_tracking.signals.semconv import RANK, ROLE, STALL_EVENT


def events_files(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(path.rglob("*.events.jsonl")))
        elif path.is_file():
            found.append(path)
    return found


def stall_records(files: Iterable[Path]) -> Iterator[dict[str, Any]]:
    for path in files:
        with open(path, "rb") as handle:
            for line in handle:
                if b'"ml.stall"' not in line:  # most lines are spans: skip them unparsed
                    continue
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if record.get("type") == "log" and record.get("event_name") == STALL_EVENT:
                    yield record


def latest_per_phase(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest report of each stuck span (its trace and span id), in the order they began."""
    latest: dict[tuple[Any, Any], dict[str, Any]] = {}
    for record in records:
        key = (record.get("trace_id"), record.get("span_id"))
        seen = latest.get(key)
        if seen is None or _open_s(record) >= _open_s(seen):
            latest[key] = record
    return sorted(latest.values(), key=_began)


def _open_s(record: dict[str, Any]) -> float:
    return float((record.get("attributes") or {}).get("ml.stall.open_s", 0))


def _began(record: dict[str, Any]) -> float:
    return float(record.get("time_unix_nano") or 0) - _open_s(record) * 1e9


def _row(record: dict[str, Any]) -> list[str]:
    a, r = record.get("attributes") or {}, record.get("resource") or {}
    return [
        str(r.get(RANK, "-")),
        str(r.get(ROLE, "-")),
        str(r.get("process.pid", "-")),
        str(r.get("host.name", "-")),
        str(a.get("ml.phase", "?")),
        str(a.get("ml.step", "-")),
        f"{a.get('ml.stall.open_s', 0):.0f} s",
        f"{a.get('ml.stall.bound_s', 0):g} s",
        str(a.get("ml.stall.frame", "-")),
    ]


_HEADER = ["rank", "role", "pid", "host", "phase", "step", "open", "bound", "stuck in"]


def main(paths: list[str], stacks: bool = False, out: TextIO = sys.stdout) -> int:
    """Exit code 0 when no stall was reported, 1 when some were, 2 when there was nothing to read."""
    files = events_files([Path(p) for p in paths] or [Path.cwd()])
    if not files:
        out.write("otel-tracking stalls: no events file (<experiment>.events.jsonl) found; name one or its directory\n")
        return 2
    stalls = latest_per_phase(stall_records(files))
    if not stalls:
        out.write(f"otel-tracking stalls: no stall reported in {len(files)} events file(s)\n")
        return 0
    rows = [_HEADER, *(_row(record) for record in stalls)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER) - 1)]
    out.write(f"otel-tracking stalls: {len(stalls)} stuck phase(s) in {len(files)} events file(s)\n")
    for index, row in enumerate(rows):
        out.write("  " + "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) + "\n")
        if stacks and index:
            body = str(stalls[index - 1].get("body") or "")
            out.write("\n".join("      " + line for line in body.splitlines()) + "\n\n")
    return 1
