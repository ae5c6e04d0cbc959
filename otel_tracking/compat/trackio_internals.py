"""Trackio's private names, named here and nowhere else: a local run's rows queued and timed as
``run.log`` would queue them.

Two paths use a local Trackio run's internals.  *Row times*: its sender writes each batch of
queued rows with the time it flushes them, so :func:`keep_row_times` replaces its sqlite writer
with one that honours each row's own ``timestamp`` (the remote path already does).  *Rows*:
``run.log`` checks every value of a step; :func:`queue_row` queues the row it would queue for a
step of plain numbers.  :data:`PRIVATE_NAMES` lists the names each path needs; :func:`probe` says
once per process, at debug, which paths run and why, and warns once when a release it was checked
against lacks a name (then ``run.log`` does the work, rows timed when written).
``tests/test_backend_trackio.py`` is the contract: the rows equal ``run.log``'s, a name taken away
falls back, and the pinned Trackio has every name.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from otel_tracking.compat._said import SaidOnce, tested_release

logger = logging.getLogger("otel_tracking.trackio")
_say = SaidOnce(logger, "otel-tracking: Trackio rows: %s", "otel-tracking: Trackio's %s; run.log does every step")

# The Trackio releases whose run.log and sqlite writer this was checked against.
TESTED_RELEASES = ((0, 43),)

# What each path needs of a local run (``_is_local`` says it is one) and of Trackio's modules.
ROW_TIMES = ("_is_local", "_queued_logs", "_queue_lock", "_write_logs_to_sqlite", "_storage_mode")
ROWS = (
    "_is_local", "_queued_logs", "_queue_lock", "_ensure_sender_alive", "_thread_is_alive", "_flush_queues_inline",
    "_next_step", "_config_logged", "config", "project", "name", "id",
)  # fmt: skip
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "trackio run": tuple(dict.fromkeys(ROW_TIMES + ROWS + ("_local_sender_thread",))),
    "trackio.sqlite_storage.SQLiteStorage": ("bulk_log",),
    "trackio.utils": ("RESERVED_KEYS", "to_json_safe"),
}


def tested_version(trackio: Any) -> bool:
    return tested_release(trackio, TESTED_RELEASES)


def missing(run: Any, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` this run lacks (a remote run lacks ``_is_local``'s truth: all of them)."""
    if not getattr(run, "_is_local", False):
        return list(names)
    return [name for name in names if not hasattr(run, name)]


def probe(run: Any, log: logging.Logger) -> tuple[bool, bool]:
    """(rows keep their own times, steps of numbers are queued directly) for ``run``; which, and
    why, said once."""
    import trackio

    release = getattr(trackio, "__version__", "?")
    if not getattr(run, "_is_local", False):
        _say("run.log for every step: a remote run (its sender already honours each row's time)")
        return False, False
    if not tested_version(trackio):
        _say(f"run.log for every step: Trackio {release} is not a release this was checked against {TESTED_RELEASES}")
        return False, False
    lacking = sorted(set(missing(run, ROW_TIMES) + missing(run, ROWS)))
    if lacking:
        _say(f"release {release} lacks {', '.join(lacking)}", moved=True)
        return False, False
    _say("rows of plain numbers queued as run.log would, each row written with its own time")
    keep_row_times(run, log)
    return True, True


# Trackio's local run (0.40-0.43) writes each batch of queued rows with the time its sender thread
# flushes them: a backlog (a run that opened late, a slow tracker) would share one timestamp.  Its
# remote path already honours a row's own "timestamp"; these two hooks give the local sqlite path
# the same.  Another Trackio (no such internals) writes rows as it always did.


def keep_row_times(run: Any, log: logging.Logger) -> None:
    """Make ``run`` write each queued row with its own ``timestamp`` (:func:`probe` found the names)."""
    from trackio.sqlite_storage import SQLiteStorage

    original = run._write_logs_to_sqlite

    def write_with_row_times(logs: list[dict[str, Any]]) -> None:
        if run._storage_mode == "jsonl":
            original(logs)  # its fragments carry each row's timestamp already
            return
        now = datetime.now(timezone.utc).isoformat()
        by_run: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
        for entry in logs:
            by_run.setdefault((entry["project"], entry["run"], entry.get("run_id")), []).append(entry)
        for (project, name, run_id), entries in by_run.items():
            # Trackio's own writer passes these as its rows hold them (a step or log id may be None).
            steps: list[Any] = [entry.get("step") for entry in entries]
            log_ids: list[Any] = [entry.get("log_id") for entry in entries]
            try:
                SQLiteStorage.bulk_log(
                    project=project,
                    run=name,
                    run_id=run_id,
                    metrics_list=[entry["metrics"] for entry in entries],
                    steps=steps,
                    timestamps=[entry.get("timestamp") or now for entry in entries],
                    config=next((entry["config"] for entry in entries if entry.get("config")), None),
                    log_ids=log_ids,
                )
            except Exception as error:  # as Trackio's own writer: warn, and the run goes on
                log.warning("trackio failed to write %d rows of run %r: %s", len(entries), name, error)

    run._write_logs_to_sqlite = write_with_row_times


def stamp_last_row(run: Any, stamp: str) -> None:
    """The time of the row ``run.log`` just queued, unless Trackio's sender took it already (then
    it is written within Trackio's send interval of now, its time the flush's)."""
    with run._queue_lock:
        if run._queued_logs and not run._queued_logs[-1].get("timestamp"):
            run._queued_logs[-1]["timestamp"] = stamp


# Trackio's run.log costs ~0.75 ms for a step of 200 numbers (a figure check, a media check and a
# JSON round trip per value), more than the rest of the tracker; the step records of a training run
# are nothing but numbers.  For those, queue_row queues the row Trackio's run.log would queue, in
# the same form, and its sender writes it as its own.  Anything else (a string, a table, a reserved
# key that Trackio renames with a warning), and a Trackio without these internals, goes through
# run.log.  tests/test_backend_trackio.py checks the rows against run.log's.


def queue_row(run: Any, data: Mapping[str, Any], step: int, stamp: str | None) -> bool:
    """Queue ``data`` at ``step`` as Trackio's ``run.log`` would; False (nothing queued) unless
    every value is a plain number that fits JSON and no key is one Trackio renames."""
    from trackio import utils

    metrics: dict[str, Any] = {}
    for key, value in data.items():
        kind = type(value)
        if kind not in (float, int, bool) or key in utils.RESERVED_KEYS or key.startswith("__"):
            return False
        if not key.isascii() and not _is_utf8(key):
            return False  # a lone surrogate: run.log drops the key with a warning
        if kind is float and not math.isfinite(value):
            value = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        elif kind is int and not -(2**63) <= value < 2**64:
            return False  # beyond JSON's 64 bits: run.log drops it with a warning
        metrics[key] = value
    run._next_step = max(run._next_step, step + 1)
    config = None
    if not run._config_logged and run.config:
        config = utils.to_json_safe(run.config)
        run._config_logged = True
    entry: dict[str, Any] = {
        "project": run.project,
        "run": run.name,
        "run_id": run.id,
        "metrics": metrics,
        "step": step,
        "config": config,
        "log_id": uuid.uuid4().hex,
    }
    if stamp:
        entry["timestamp"] = stamp
    with run._queue_lock:
        run._queued_logs.append(entry)
        run._ensure_sender_alive()
    if not run._thread_is_alive("_local_sender_thread"):
        run._flush_queues_inline()
    return True


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def drain(run: Any, timeout_s: float) -> None:
    """Trackio's finish() waits 30 s for its sender thread and then gives up, leaving queued rows
    unwritten; wait longer, then write what is left from this thread."""
    thread = getattr(run, "_local_sender_thread", None)
    if isinstance(thread, threading.Thread) and thread.is_alive():
        thread.join(timeout_s)
    pending = getattr(run, "_queued_logs", None)
    flush_inline = getattr(run, "_flush_queues_inline", None)
    if pending and callable(flush_inline) and not (isinstance(thread, threading.Thread) and thread.is_alive()):
        flush_inline()
