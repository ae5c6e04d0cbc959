"""JSONL file sink.

The metrics file keeps the reference's exact line format and path rules, so existing readers keep
working: one line ``{"step": s, "data": {...}}`` per log() call, at ``VERL_FILE_LOGGER_PATH`` or
``<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl``.  Each line is one unbuffered write,
so every step whose log() returned is on disk even if the process is killed.  Numbers are written
as the caller gave them, numpy scalars included (``np.float32(1.1)`` as ``1.1``, a ``uint64`` beyond
int64 exactly, ``step=11.0`` as ``11.0``), as the reference's ``orjson`` dump did.

Spans and log records (validation generations, tables, each step's anatomy as an
``ml.step.anatomy`` record: :func:`read_anatomy`) go to the sibling file
``<experiment>.events.jsonl``, one JSON object per line with a ``"type"`` of ``"span"`` or ``"log"``,
never into the metrics file.

One run, one pair of files; a new run never loses an earlier one's lines.  When a run opens its
files (at ``Tracking()``):

* files left at those paths by an earlier run that has ended are moved aside, both of them, to
  ``<experiment>.<UTC time of the newer one's last write>.jsonl`` and
  ``<experiment>.<same time>.events.jsonl``; the new run starts fresh files at the plain paths, as
  the reference's truncation did;
* when a run that is still going holds them (another ``Tracking`` of the same project and
  experiment, in this process or another: each run holds an ``flock`` on its files), the new run
  writes ``<experiment>.<its run id>.jsonl`` and ``<experiment>.<its run id>.events.jsonl``
  instead, and its ``Creating file logger at`` line says so;
* a resumed run (``OTEL_TRACKING_RESUME``) appends to the pair instead, and before its first step
  line writes one marker line ``{"resumed_from_step": c, "attempt": n}``: ``c`` is the checkpoint
  step it restarts from (``config/resume.py``: verl's, or ``OTEL_TRACKING_RESUME_STEP``), else the
  step before its first one.  Lines above the marker at steps above ``c`` are superseded; at ``c``
  and below they stand, but for the (key, step) pairs logged again (verl validates the reloaded
  checkpoint at ``c``): a reader that keeps the last value of each (key, step) in file order, after
  dropping the superseded lines, reads the run as the resumed job left it
  (``otel_tracking.exporters.file.read_metrics`` does that).

A sink built only for spans or logs (``OTEL_TRACES_EXPORTER=file``) never creates a metrics file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_tracking.compat.otel_sdk import LogRecordExporter, LogRecordExportResult, ReadableLogRecord
from otel_tracking.config import paths, settings
from otel_tracking.exporters._base import StepMetricExporter, StepRecord, hex_id
from otel_tracking.exporters.timings import span_duration_s
from otel_tracking.signals.semconv import ANATOMY_EVENT, STEP

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def events_path(metrics_path: Path) -> Path:
    name = metrics_path.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return metrics_path.with_name(f"{stem}.events.jsonl")


class FileSink:
    """The two files of one run, claimed (see the module's docstring) when first opened; the events
    file is appended to, so separately built span and log exporters can share it."""

    def __init__(
        self,
        path: Path | str | None = None,
        attempt: int | None = None,
        run_id: str | None = None,
        checkpoint_step: int | None = None,
    ) -> None:
        """``attempt``: this run resumes an earlier one (append, and mark where this attempt starts:
        after ``checkpoint_step``, else before its first step); ``run_id``: names this run's own
        files when another live run holds the plain ones."""
        if path is None:
            path = paths.file_sink_path(*settings.identity_from_env())
        self.path = Path(path)
        self.attempt = attempt
        self.checkpoint_step = checkpoint_step
        self.run_id = run_id or str(os.getpid())
        self._marked = attempt is None
        self.events_path = events_path(self.path)
        self._claimed = False
        self._started = False  # the metrics file was opened once: later opens append
        self._metrics: IO[bytes] | None = None
        self._events: BinaryIO | None = None
        self._lock = threading.Lock()
        _sinks.add(self)

    def _after_fork_in_child(self) -> None:
        """A forked child does not keep this run's files open: its copies of the descriptors would
        hold their ``flock`` after the parent ended (an orphaned Pool worker), and the next run of
        the experiment would write to other files.  Each descriptor is pointed at /dev/null (the
        file object closes that later, not a number reused meanwhile); the child's own writes, if
        any, open the files again, appending, without the lock."""
        self._lock = threading.Lock()  # it may have been held by a parent's thread at the fork
        for handle in (self._metrics, self._events):
            if handle is not None:
                with contextlib.suppress(OSError, ValueError):
                    null = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(null, handle.fileno())
                    os.close(null)
        self._metrics = self._events = None

    def open(self, metrics: bool = True) -> None:
        """Claim this run's files now (not at the first write) and open the metrics file, or, for a
        sink without metrics, the events file."""
        with self._lock:
            self._claim()
            if metrics:
                self._open_metrics()
            else:
                self._open_events()

    def _claim(self) -> None:
        if self._claimed:
            return
        self._claimed = True
        existing = [p for p in (self.path, self.events_path) if p.exists()]
        if any(_held(p) for p in existing):
            self.path, self.events_path = _tagged(self.path, self.run_id)
        elif existing and self.attempt is None:
            _move_aside(self.path, self.events_path, existing)

    def _open_metrics(self) -> IO[bytes]:
        if self._metrics is None:
            self._claim()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A new run starts the file (an earlier run's was moved aside), a resumed run continues
            # it, and so does this run when it opens the file again after close().
            mode = "ab" if self.attempt is not None or self._started else "wb"
            self._metrics = _locked(open(self.path, mode, buffering=0))  # noqa: SIM115 - closed in close()
            self._started = True
        return self._metrics

    def _open_events(self) -> BinaryIO:
        if self._events is None:
            self._claim()
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
            # created with the process's umask, as the metrics file is: it holds prompts and outputs
            self._events = _locked(open(self.events_path, "ab", buffering=0))  # noqa: SIM115 - closed in close()
        return self._events

    def write_step(self, record: StepRecord) -> None:
        data: dict[str, Any] = dict(record.scalars)
        if record.as_logged:  # numpy scalars as the caller gave them: orjson writes them as numpy does
            data.update(record.as_logged)
        if record.others:
            data.update(record.others)
        if record.order:  # numbers and other values mixed: the line keeps the caller's key order
            data = {key: data[key] for key in record.order if key in data}
        step = record.step if record.step_as_logged is None else record.step_as_logged
        line = orjson.dumps({"step": step, "data": data}, option=_OPTIONS) + b"\n"
        with self._lock:
            if not self._marked:  # the first step of a resumed attempt: where it takes over
                self._marked = True
                restart = record.step - 1 if self.checkpoint_step is None else self.checkpoint_step
                line = orjson.dumps({"resumed_from_step": restart, "attempt": self.attempt}) + b"\n" + line
            self._open_metrics().write(line)

    def write_events(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        blob = b"".join(orjson.dumps(event, option=_OPTIONS, default=str) + b"\n" for event in events)
        with self._lock:
            self._open_events().write(blob)

    def close(self) -> None:
        with self._lock:
            for handle in (self._metrics, self._events):
                if handle is not None:
                    handle.close()  # and its flock with it
            self._metrics = self._events = None


_Handle = TypeVar("_Handle", bound=IO[bytes])


def _locked(handle: _Handle) -> _Handle:
    """The handle, holding an exclusive ``flock`` that tells a later run the file is in use."""
    with contextlib.suppress(OSError):
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


def _held(path: Path) -> bool:
    """Whether a live run holds ``path`` (its ``flock``); a file we cannot open counts as held."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # (and the shared lock, if it was taken)


def _tagged(metrics_path: Path, tag: str) -> tuple[Path, Path]:
    """``<experiment>.<tag>.jsonl`` and its events file."""
    name = metrics_path.name
    tagged = f"{name[: -len('.jsonl')]}.{tag}.jsonl" if name.endswith(".jsonl") else f"{name}.{tag}"
    path = metrics_path.with_name(tagged)
    return path, events_path(path)


def _move_aside(metrics_path: Path, events: Path, existing: list[Path]) -> None:
    """Rename an ended run's files to names tagged with the time of their last write."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(max(p.stat().st_mtime for p in existing)))
    tag, n = stamp, 1
    while any(p.exists() for p in _tagged(metrics_path, tag)):
        n += 1
        tag = f"{stamp}-{n}"
    for old, new in zip((metrics_path, events), _tagged(metrics_path, tag), strict=True):
        if old.exists():
            os.replace(old, new)


_sinks: weakref.WeakSet[FileSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    for sink in list(_sinks):
        sink._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

_shared: dict[Path, FileSink] = {}
_shared_lock = threading.Lock()


def shared_sink() -> FileSink:
    """The process's one FileSink for exporters built with no arguments (a plain OTel SDK setup
    builds the span and the log exporter separately; they write one events file)."""
    path = paths.file_sink_path(*settings.identity_from_env()).resolve()
    with _shared_lock:
        sink = _shared.get(path)
        if sink is None:
            sink = _shared[path] = FileSink(path)
        return sink


def read_metrics(path: Path | str) -> dict[str, dict[int, Any]]:
    """``{key: {step: value}}`` of a metrics file, the last value of each (key, step) winning, and
    each resume marker dropping what earlier attempts logged above its ``resumed_from_step``."""
    values: dict[str, dict[int, Any]] = {}
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            if "resumed_from_step" in line:
                restart = int(line["resumed_from_step"])
                for steps in values.values():
                    for step in [s for s in steps if s > restart]:
                        del steps[step]
                continue
            for key, value in (line.get("data") or {}).items():
                values.setdefault(key, {})[int(line["step"])] = value
    return values


def read_anatomy(metrics_path: Path | str) -> dict[int, dict[str, Any]]:
    """``{step: {"anatomy/...": value}}``: each step's anatomy (``runtime/anatomy.py``), from the
    events file beside the metrics file at ``metrics_path`` (the metrics file keeps verl's lines)."""
    found: dict[int, dict[str, Any]] = {}
    path = events_path(Path(metrics_path))
    if not path.exists():
        return found
    with open(path, "rb") as handle:
        for raw in handle:
            if ANATOMY_EVENT.encode() not in raw:
                continue
            try:
                event = orjson.loads(raw)
                step = int(event["attributes"][STEP])
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                continue
            if event.get("event_name") == ANATOMY_EVENT and isinstance(event.get("body"), dict):
                found[step] = event["body"]
    return found


def span_event(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    return {
        "type": "span",
        "name": span.name,
        "trace_id": hex_id(context.trace_id if context else None, 32),
        "span_id": hex_id(context.span_id if context else None, 16),
        "parent_span_id": hex_id(parent.span_id if parent else None, 16),
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "duration_s": span_duration_s(span),
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        "resource": dict(span.resource.attributes),
    }


def log_event(item: ReadableLogRecord) -> dict[str, Any]:
    record = item.log_record
    return {
        "type": "log",
        "event_name": record.event_name or "",
        "time_unix_nano": record.timestamp or record.observed_timestamp,
        "severity": record.severity_text,
        "body": record.body,
        "attributes": dict(record.attributes or {}),
        "trace_id": hex_id(record.trace_id, 32) if record.trace_id else None,
        "span_id": hex_id(record.span_id, 16) if record.span_id else None,
        "resource": dict(item.resource.attributes),
    }


class FileMetricExporter(StepMetricExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        super().__init__()
        self.sink = sink or shared_sink()

    def write(self, record: StepRecord) -> None:
        self.sink.write_step(record)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.sink.close()


class FileSpanExporter(SpanExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        self.sink = sink or shared_sink()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sink.write_events([span_event(span) for span in spans])
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.sink.close()


class FileLogExporter(LogRecordExporter):
    def __init__(self, sink: FileSink | None = None) -> None:
        self.sink = sink or shared_sink()

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self.sink.write_events([log_event(item) for item in batch])
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every write is unbuffered

    def shutdown(self) -> None:
        self.sink.close()
