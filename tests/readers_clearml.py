"""Reading an offline ClearML session back from its own files.

``Task.set_offline(True)`` sessions live in ``$HOME/.clearml/cache/offline/offline-<id>/``:
``metrics.jsonl`` (each line a JSON list of events: ``training_stats_scalar`` events carry
``metric``/``variant``/``iter``/``value``, tables are ``plot`` events with a plotly ``plot_str``),
``task.json`` (name, project, ``configuration`` objects whose ``value`` is HOCON text).  Closing
the task writes ``offline-<id>.zip`` beside the folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MONITOR_PREFIX = ":monitor:"  # ClearML's own resource-monitor series


@dataclass
class ClearMLSession:
    path: Path
    name: str = ""
    project: str = ""
    scalars: list[tuple[str, str, int, float]] = field(default_factory=list)  # (title, series, iter, value)
    plots: list[tuple[str, str, int, dict[str, Any]]] = field(default_factory=list)  # (title, series, iter, plot)
    configuration: dict[str, Any] = field(default_factory=dict)  # name -> parsed value
    has_configuration: dict[str, bool] = field(default_factory=dict)
    logs: list[tuple[str, str]] = field(default_factory=list)  # (level, msg) of the Console tab

    def user_scalars(self) -> list[tuple[str, str, int, float]]:
        return [s for s in self.scalars if not s[0].startswith(MONITOR_PREFIX)]

    def table(self, title: str, series: str) -> list[tuple[int, list[str], list[list[Any]]]]:
        """(iteration, header, rows) of each table reported under (title, series)."""
        found = []
        for t, s, iteration, plot in self.plots:
            if (t, s) != (title, series):
                continue
            (data,) = plot["data"]
            header = [h[0] for h in data["header"]["values"]]
            columns = data["cells"]["values"]
            rows = [list(row) for row in zip(*columns, strict=True)]
            found.append((iteration, header, rows))
        return found


def session_dirs(home: Path | str) -> list[Path]:
    root = Path(home) / ".clearml" / "cache" / "offline"
    return sorted(p for p in root.glob("offline-*") if p.is_dir())


def read_session(folder: Path | str) -> ClearMLSession:
    from clearml.utilities.pyhocon import ConfigFactory

    folder = Path(folder)
    session = ClearMLSession(path=folder)
    metrics = folder / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if not line.strip():
                continue
            for event in json.loads(line):
                if event["type"] == "training_stats_scalar":
                    session.scalars.append((event["metric"], event["variant"], event["iter"], event["value"]))
                elif event["type"] == "plot":
                    session.plots.append(
                        (event["metric"], event["variant"], event["iter"], json.loads(event["plot_str"]))
                    )
    console = folder / "log.jsonl"
    if console.exists():
        for line in console.read_text().splitlines():
            if line.strip():
                session.logs.extend((event.get("level", ""), event.get("msg", "")) for event in json.loads(line))
    task = json.loads((folder / "task.json").read_text())
    session.name = task.get("name") or ""
    session.project = task.get("project_name") or ""
    for name, item in (task.get("configuration") or {}).items():
        session.has_configuration[name] = True
        text = item.get("value") or ""
        session.configuration[name] = ConfigFactory.parse_string(text).as_plain_ordered_dict() if text else {}
    return session


def wait_for_sessions(home: Path | str, count: int = 1, timeout: float = 20.0) -> list[ClearMLSession]:
    """The ``count`` closed sessions under ``home`` (closed = its ``.zip`` is written)."""
    deadline = time.monotonic() + timeout
    while True:
        folders = session_dirs(home)
        closed = [f for f in folders if f.with_name(f.name + ".zip").exists()]
        if len(closed) >= count:
            return [read_session(f) for f in closed]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"expected {count} closed clearml session(s) under {home}, got "
                f"{[f.name for f in folders]} ({len(closed)} closed)"
            )
        time.sleep(0.05)
