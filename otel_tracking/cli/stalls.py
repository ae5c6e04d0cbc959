"""``otel-tracking stalls``: the stalls a run reported so far, at one glance.

Reads the ``ml.stall`` records (``runtime/stalls.py``) from the file sink's events files
(``<experiment>.events.jsonl``), and prints one row per stuck span: its latest report (the
longest it was seen open), who (rank, role, pid, host), which phase at which step, how long, the
line it was stuck in, and how it ended: the span's own line in the same files says whether it
*recovered* (it ended by itself, after how long) or was still open at the end (``finish()`` ended
it, or no end was recorded: the process died).  ``--stacks`` adds each report's stacks.  The exit
code counts only the stalls still open at the end: a run whose stalls all recovered exits 0.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from otel_tracking.signals.semconv import ENDED_BY, RANK, ROLE, STALL_EVENT


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


_SPAN_ID = re.compile(rb'"span_id":"([0-9a-f]{16})"')  # a span line's own id (not "parent_span_id")


def span_ends(files: Iterable[Path], span_ids: set[str]) -> dict[tuple[Any, Any], dict[str, Any]]:
    """The span lines of the spans ``span_ids`` (those a stall was reported for), by (trace, span)."""
    found: dict[tuple[Any, Any], dict[str, Any]] = {}
    wanted = {span_id.encode() for span_id in span_ids}
    for path in files:
        with open(path, "rb") as handle:
            for line in handle:
                if b'"type":"span"' not in line:
                    continue
                match = _SPAN_ID.search(line)
                if match is None or match.group(1) not in wanted:
                    continue
                try:
                    span = json.loads(line)
                except ValueError:
                    continue
                found[(span.get("trace_id"), span.get("span_id"))] = span
    return found


def outcome(record: dict[str, Any], ends: dict[tuple[Any, Any], dict[str, Any]]) -> tuple[bool, str]:
    """(still open at the end, what became of the stall) for a stall's latest report."""
    span = ends.get((record.get("trace_id"), record.get("span_id")))
    if span is None:
        return True, "open at the end (no end recorded)"
    if (span.get("attributes") or {}).get(ENDED_BY):
        return True, "open at the end (ended by finish)"
    start, end = span.get("start_time_unix_nano"), span.get("end_time_unix_nano")
    if isinstance(start, int) and isinstance(end, int):
        return False, f"recovered after {(end - start) / 1e9:.0f} s"
    return False, "recovered"


def _row(record: dict[str, Any], ended: str) -> list[str]:
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
        ended,
        str(a.get("ml.stall.frame", "-")),
    ]


_HEADER = ["rank", "role", "pid", "host", "phase", "step", "open", "bound", "then", "stuck in"]


def main(paths: list[str], stacks: bool = False, out: TextIO = sys.stdout) -> int:
    """Exit code 0 when no stall is still open at the end (none reported, or all recovered), 1
    when some are, 2 when there was nothing to read."""
    files = events_files([Path(p) for p in paths] or [Path.cwd()])
    if not files:
        out.write("otel-tracking stalls: no events file (<experiment>.events.jsonl) found; name one or its directory\n")
        return 2
    stalls = latest_per_phase(stall_records(files))
    if not stalls:
        out.write(f"otel-tracking stalls: no stall reported in {len(files)} events file(s)\n")
        return 0
    ends = span_ends(files, {str(record.get("span_id")) for record in stalls})
    outcomes = [outcome(record, ends) for record in stalls]
    still_open = sum(1 for is_open, _ in outcomes if is_open)
    rows = [_HEADER, *(_row(record, said) for record, (_, said) in zip(stalls, outcomes, strict=True))]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER) - 1)]
    out.write(
        f"otel-tracking stalls: {len(stalls)} stuck phase(s) in {len(files)} events file(s): "
        f"{len(stalls) - still_open} recovered, {still_open} still open at the end\n"
    )
    for index, row in enumerate(rows):
        out.write("  " + "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) + "\n")
        if stacks and index:
            body = str(stalls[index - 1].get("body") or "")
            out.write("\n".join("      " + line for line in body.splitlines()) + "\n\n")
    return 1 if still_open else 0
