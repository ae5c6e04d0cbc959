"""``otel-tracking replay``: deliver what a sink could not take, from its spool, into that sink.

Each spool file (``<spool dir>/<project>/<experiment>-<run id>/<sink>.jsonl``) starts with a header
naming the sink and the run; replay rebuilds that sink from the header and the *current*
environment (so point ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``MLFLOW_TRACKING_URI`` where the data
should go now), reattaches to the backend's run where the bridge supports it (MLflow: the same run
id), and exports every item in order.  A fully replayed file is renamed ``*.replayed`` (so nothing
is delivered twice); items that still fail are written back for the next replay.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from otel_tracking.delivery import Spool, read_spool
from otel_tracking.pipeline import Sink
from otel_tracking.settings import build_settings, spool_root

_OTLP = {"otlp-metrics": "metrics", "otlp-traces": "traces", "otlp-logs": "logs"}


def spool_files(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*.jsonl") if p.is_file()))
        elif path.is_file():
            found.append(path)
    return found


def rebuild_sink(header: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Sink:
    from otel_tracking.registry import build_otlp_sinks, build_sink

    e = dict(os.environ if env is None else env)
    e["OTEL_TRACKING_RUN_ID"] = str(header.get("run_id") or "")
    name = str(header["sink"])
    settings = build_settings(str(header["project"]), str(header["experiment"]), (), env=e, force_otlp=True)
    if name in _OTLP:
        return build_otlp_sinks(settings)[_OTLP[name]]
    return build_sink(name, settings, config=None, resume=header.get("resume"))


class Progress:
    def __init__(self, total: int, label: str, out: TextIO) -> None:
        self.total, self.label, self.out, self.done = total, label, out, 0

    def step(self) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.out.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        if self.done == self.total:
            self.out.write("\n")
        self.out.flush()


def replay_file(path: Path, out: TextIO = sys.stderr, env: Mapping[str, str] | None = None) -> dict[str, int]:
    header, items = read_spool(path)
    sink = rebuild_sink(header, env)
    progress = Progress(len(items), f"{header['sink']} <- {path.name}", out)
    failed: list[tuple[str, Any]] = []
    for kind, payload in items:
        if not sink.deliver(kind, payload):
            failed.append((kind, payload))
        progress.step()
    sink.finish(0)
    if failed:
        retry = path.with_suffix(".retry")
        spool = Spool(retry, header)
        for kind, payload in failed:
            spool.write(kind, payload)
        spool.close()
        os.replace(retry, path)
    else:
        path.rename(path.with_name(path.name + ".replayed"))
    return {"items": len(items), "delivered": len(items) - len(failed), "failed": len(failed)}


def main(paths: list[str], out: TextIO = sys.stderr) -> int:
    files = spool_files([Path(p) for p in paths] or [spool_root()])
    if not files:
        out.write("nothing to replay\n")
        return 0
    total_failed = 0
    for path in files:
        result = replay_file(path, out)
        total_failed += result["failed"]
        out.write(f"{path}: {result['delivered']}/{result['items']} delivered\n")
    return 1 if total_failed else 0
