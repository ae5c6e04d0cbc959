"""``otel-tracking replay``: deliver what a sink could not take, from its spool, into that sink.

Each spool file (``<spool dir>/<project>/<experiment>-<run id>/<sink>.jsonl``) starts with a header
naming the sink and the run; replay rebuilds that sink from the header and the *current*
environment (so point ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``MLFLOW_TRACKING_URI`` where the data
should go now), reattaches to the backend's run where the tracker supports it (MLflow: the same run
id), and hands every record, in order, to the sink's queue: the same engine as in a run, with its
retries and its bulk path (MLflow packs many steps into one request).  What the queue cannot
deliver goes to its spool, a ``.retry`` file, for the next replay; a fully replayed file is
renamed ``*.replayed`` (so nothing is delivered twice; naming one is refused).  It says, per file,
what was delivered (in records, and in the items a run's summary counts), then sums up all files.

A replay that is interrupted goes on where it stopped (:class:`Position`): each record is delivered
at most once, however often replay is stopped and started again.  Ctrl-C or SIGTERM stop it once
the records on their way (at most ``_WINDOW``) are settled; a replay killed while records were on
their way sets those aside (``*.in-doubt``, said so) rather than deliver them a second time.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from otel_tracking.config.destinations import with_destination
from otel_tracking.config.paths import spool_root
from otel_tracking.config.settings import Settings, build_settings
from otel_tracking.delivery.engine import SinkQueue, item_count
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.spool import Damaged, Spool, read_spool_from, unframe
from otel_tracking.signals.steps import step_batch_of

REPLAYED = ".replayed"  # the suffix of a file delivered in full
IN_DOUBT = ".in-doubt"  # records a killed replay had on their way: delivered or not, nobody knows
_OTLP = {"otlp-metrics": "metrics", "otlp-traces": "traces", "otlp-logs": "logs"}


_ATTEMPT = re.compile(r"\.attempt(\d+)(?=\.)")
# Files of older releases: what the training process spooled when the bridge process was gone had a
# file of its own (it now appends to the sink's file).
_LINK = re.compile(r"\.link(?=\.jsonl$)")


def spool_files(paths: Iterable[Path]) -> list[Path]:
    """The spool files under ``paths``, in the order their items were logged: a sink's file of
    each attempt of a run after the attempt before it (``mlflow.jsonl``, ``mlflow.attempt2.jsonl``,
    ...), whatever their names sort as."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(p for p in path.rglob("*.jsonl") if p.is_file())
        elif path.is_file():
            found.append(path)
    return sorted(dict.fromkeys(found), key=_logged_order)


def _logged_order(path: Path) -> tuple[str, str, int, str]:
    """(directory, the sink's file name without attempt or link tag, attempt, name)."""
    match = _ATTEMPT.search(path.name)
    attempt = int(match.group(1)) if match else 1
    return str(path.parent), _LINK.sub("", _ATTEMPT.sub("", path.name)), attempt, path.name


def rebuild_sink(header: Mapping[str, Any], env: Mapping[str, str] | None = None) -> tuple[Sink, Settings]:
    """The sink a spool file's header names, built from the current environment, and the settings
    it was built with (its delivery policy)."""
    from otel_tracking.config.run_config import RunConfig
    from otel_tracking.delivery.otlp_sinks import build_otlp_sinks
    from otel_tracking.delivery.registry import build_sink

    e = with_destination(os.environ if env is None else env, header.get("destination") or {})
    name = str(header["sink"])
    resume = header.get("resume") or {}
    if name in _OTLP and resume.get("protocol"):
        e.setdefault("OTEL_EXPORTER_OTLP_PROTOCOL", str(resume["protocol"]))
    settings = build_settings(
        str(header["project"]),
        str(header["experiment"]),
        (),
        env=e,
        force_otlp=True,
        resume="never",
        run_id=str(header.get("run_id") or "") or None,
    )
    if name in _OTLP:
        signal = _OTLP[name]
        remembered = {signal: str(resume["endpoint"])} if resume.get("endpoint") else None
        return build_otlp_sinks(settings, remembered)[signal], settings
    return build_sink(name, settings, RunConfig(), resume=header.get("resume")), settings


class Position:
    """How far the replay of one spool file got, kept beside it in ``<file>.position`` so that a
    replay stopped by Ctrl-C, SIGTERM or SIGKILL goes on from there instead of delivering again.

    One fixed-width line, rewritten in place (one ``pwrite``) as records are handed to the sink
    and as they are settled: the spool file's inode (a file replaced since, by a replay that ended,
    makes the position stale), the offset of the first record not settled yet, the length of the
    ``.retry`` file so far (records the backend refused: the next replay truncates it there, so none
    is written twice), whether records from that offset on are on their way, and where the last
    record on its way ends.  No fsync: it is there for a process that stops, and the page cache
    outlives the process (a machine that crashes may deliver its last records again)."""

    _FORMAT = "{:020d} {:020d} {:020d} {:d} {:020d}\n"

    def __init__(
        self, path: Path, inode: int, offset: int | None, retry_length: int, in_flight: bool, flight_end: int = 0
    ) -> None:
        self.path, self.inode = path, inode
        self.offset, self.retry_length, self.in_flight = offset, retry_length, in_flight
        self.flight_end = flight_end  # 0: the one record at ``offset`` (a position of an older release)
        self._fd: int | None = None

    @classmethod
    def of(cls, spool_path: Path, inode: int) -> Position:
        """The position left by an earlier replay of the file with this inode, or the start."""
        path = spool_path.with_name(spool_path.name + ".position")
        try:
            inode_s, offset_s, retry_s, flight_s, *end = path.read_text().split()
            if int(inode_s) == inode:
                return cls(path, inode, int(offset_s), int(retry_s), flight_s == "1", int(end[0]) if end else 0)
        except (OSError, ValueError):  # none, or a torn first write: nothing was delivered yet
            pass
        return cls(path, inode, None, 0, False)

    @property
    def resumed(self) -> bool:
        return self.offset is not None

    def mark(self, offset: int, retry_length: int, in_flight: bool, flight_end: int = 0) -> None:
        self.offset, self.retry_length, self.in_flight, self.flight_end = offset, retry_length, in_flight, flight_end
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        line = self._FORMAT.format(self.inode, offset, retry_length, in_flight, flight_end)
        os.pwrite(self._fd, line.encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _set_aside_in_doubt(path: Path, offset: int, end: int) -> tuple[int, int]:
    """Move the records from ``offset`` to ``end`` (those a killed replay had on their way; at
    least the one at ``offset``) to ``<file>.in-doubt``: (the offset after them, how many)."""
    moved: list[bytes] = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in iter(f.readline, b""):
            if line.strip():  # blank lines are skipped (as the reader skips them)
                if moved and offset >= end:
                    break
                moved.append(line)
            offset += len(line)
    doubt = path.with_name(path.name + IN_DOUBT)
    with open(doubt, "ab") as f:
        f.write(b"".join(moved))
    os.chmod(doubt, 0o600)
    return offset, len(moved)


class Interrupt:
    """Ctrl-C and SIGTERM, while replay runs: the first stops it after the record on its way
    (what is delivered and what is not stay told apart); a second one stops it at once."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


_NEVER = Interrupt()  # replay_file called on its own: nothing stops it


class Progress:
    """A one-line bar of a file's records, filled as far as they were *delivered*, redrawn in place
    on a terminal.  Anywhere else (a pipe, a log file) it draws nothing: the line that follows each
    file says how it went."""

    def __init__(self, total: int, label: str, out: TextIO) -> None:
        self.total, self.label, self.out, self.read, self.delivered = total, label, out, 0, 0
        isatty = getattr(out, "isatty", None)
        self.drawing = bool(callable(isatty) and isatty())
        self._open = False  # a bar is on the current line

    def step(self, delivered: bool) -> None:
        self.read += 1
        self.delivered += delivered
        if not self.drawing:
            return
        width = 30
        filled = width * self.delivered // max(self.total, 1)
        failed = self.read - self.delivered
        self.out.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.delivered}/{self.total} delivered"
            + (f", {failed} not" if failed else "")
        )
        self._open = self.read < self.total
        if not self._open:
            self.out.write("\n")
        self.out.flush()

    def say(self, line: str) -> None:
        """A line of its own, below the bar drawn so far."""
        if self._open:
            self.out.write("\n")
            self._open = False
        self.out.write(line + "\n")


def _records_in(path: Path, start: int | None = None) -> tuple[int, int]:
    """(records before ``start``, records from there on), less the header."""
    before = after = 0
    with open(path, "rb") as f:
        f.readline()  # the header
        offset = f.tell()
        for line in f:
            if line.strip() and b'{"header"' not in line[:20]:  # a second writer's header is no record
                if start is not None and offset < start:
                    before += 1
                else:
                    after += 1
            offset += len(line)
    return before, after


def _end_record(path: Path) -> int | None:
    """The exit code in the file's last record when it is an "end" record (see codec)."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        lines = [line for line in f.read().splitlines(keepends=True) if line.strip()]
    if not lines:
        return None
    record = unframe(lines[-1])
    if isinstance(record, dict) and record.get("kind") == "end":
        return int(record["data"]["exit_code"])
    return None


_COUNTS: tuple[str, ...] = ("records", "delivered", "failed", "damaged", "items", "items_delivered")
_COUNTS += ("busy", "skipped", "interrupted", "in_doubt")


def _counts(**nonzero: int) -> dict[str, int]:
    """One file's outcome: its records (less an end record), those delivered, failed (kept for the
    next replay) and damaged (skipped); the items in them (spans, log records, log() calls: what
    a run's summary counts) and those delivered; busy (another process writes the file),
    skipped (not replayed at all, already said why), interrupted (stopped before its end, goes on
    at the next replay) and in_doubt (set aside: a killed replay had them on their way)."""
    return {**dict.fromkeys(_COUNTS, 0), **nonzero}


# Records handed to the sink's queue before replay waits for them to settle: enough for the queue's
# groups (a bulk export of many steps); a first Ctrl-C waits for those on their way.
_WINDOW = 256


class _Record:
    """One record on its way: where it ends in the file, its items, and its outcome once settled."""

    __slots__ = ("end", "items", "outcome")

    def __init__(self, end: int, items: int, outcome: str | None = None) -> None:
        self.end, self.items, self.outcome = end, items, outcome


class _Window:
    """The records of one file on their way through the sink's queue, in file order, and the
    position beside the file: the first record not settled yet (where a stopped replay goes on)
    and where the last one on its way ends (a replay killed meanwhile sets them aside as in doubt).
    The queue's thread settles them (``settled``, its ``done``): counted, drawn, and the position moved."""

    def __init__(self, position: Position, retry_path: Path, counts: dict[str, int], progress: Progress, at: int):
        self._position, self._retry_path, self._counts, self._progress = position, retry_path, counts, progress
        self._lock = threading.Lock()
        self._records: deque[_Record] = deque()
        self._settled_to = at  # every record before this offset is settled
        self._handed_to = at
        self.broken = False  # the retry file could not be written: replay stops, the rest waits

    def on_its_way(self) -> int:
        with self._lock:
            return len(self._records)

    def hand(self, end: int, items: int) -> _Record:
        """A record (ending at ``end``) is handed to the queue: counted, and on its way from now on."""
        record = _Record(end, items)
        with self._lock:
            self._counts["records"] += 1
            self._counts["items"] += items
            self._records.append(record)
            self._handed_to = end
            self._mark()
        return record

    def skip(self, end: int, damaged: str | None = None) -> None:
        """A record with nothing to deliver: the run's end, or a damaged one (``damaged`` says so)."""
        with self._lock:
            if damaged is not None:
                self._progress.say(damaged)
                self._counts["records"] += 1
                self._counts["damaged"] += 1
                self._progress.step(False)
            self._records.append(_Record(end, 0, "skipped"))
            self._handed_to = end
            self._advance()

    def settled(self, record: _Record, outcome: str) -> None:
        with self._lock:
            if outcome == "dropped":  # not in the retry file either: it stays on its way (in doubt)
                self.broken = True
                return
            record.outcome = outcome
            delivered = outcome == "delivered"
            self._counts["delivered" if delivered else "failed"] += 1
            self._counts["items_delivered"] += record.items if delivered else 0
            self._progress.step(delivered)
            self._advance()

    def _advance(self) -> None:
        while self._records and self._records[0].outcome is not None:
            self._settled_to = self._records.popleft().end
        self._mark()

    def _mark(self) -> None:
        retry_length = self._retry_path.stat().st_size if self._counts["failed"] else self._position.retry_length
        self._position.mark(self._settled_to, retry_length, bool(self._records), self._handed_to)


def _settle_all(queue: SinkQueue) -> None:
    """Wait until every record handed to ``queue`` is delivered or in the retry file."""
    while not queue.flush(60.0):
        pass


def replay_file(
    path: Path, out: TextIO = sys.stderr, env: Mapping[str, str] | None = None, interrupt: Interrupt = _NEVER
) -> dict[str, int]:
    """Deliver one spool file into its sink through the sink's queue, in order (streamed, never
    loading the file whole), from where an earlier replay of it stopped.  A damaged record is
    skipped and named (file and byte offset); what the sink refuses is kept for the next replay; a
    file another process still writes is left alone; ``interrupt`` stops it once the records on
    their way are settled."""
    with open(path, "rb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.write(f"{path}: still being written by a running process; skipped\n")
            return _counts(busy=1, skipped=1)
        # Empty: its process was killed between creating it and writing the header, or a writer is
        # between the two right now (it takes its lock after creating the file): left as it is, so
        # that such a writer's records stay where replay will find them.
        if os.fstat(lock.fileno()).st_size == 0:
            out.write(f"{path}: empty (its process stopped before writing to it); nothing to replay\n")
            return _counts()
        position = Position.of(path, os.fstat(lock.fileno()).st_ino)
        in_doubt = 0
        if position.in_flight and position.offset is not None:
            after, in_doubt = _set_aside_in_doubt(path, position.offset, position.flight_end)
            position.mark(after, position.retry_length, False)
            out.write(
                f"{path}: a replay was killed while {in_doubt} record(s) were on their way; they may or may not have "
                f"arrived, so they are not delivered again: set aside in {path.name}{IN_DOUBT}\n"
            )
        header, records = read_spool_from(path, position.offset)
        if not header.get("sink"):
            out.write(f"{path}: its header is damaged; nothing to rebuild the sink from; skipped\n")
            return _counts(damaged=1, skipped=1)
        ended = _end_record(path)
        if ended is not None:  # the run ended without its tracker: replay ends the backend's run
            header = {**header, "resume": {**(header.get("resume") or {}), "end_run": True}}
        sink, settings = rebuild_sink(header, env)
        out.write(f"{header['sink']}: {path} -> {sink.where or 'its backend'}\n")
        if sink.metrics is None and sink.spans is None and sink.logs is None:  # it could not open
            out.write(f"{path}: not replayed (the backend did not open); kept for the next replay\n")
            return _counts(failed=1, skipped=1, in_doubt=in_doubt)
        done_before, total = _records_in(path, position.offset)
        if position.resumed:
            out.write(f"{path}: going on after record {done_before} (an earlier replay was stopped there)\n")
        progress = Progress(total - (ended is not None), f"{header['sink']} <- {path.name}", out)
        retry_path = path.with_name(path.name + ".retry")
        if retry_path.exists():  # what an earlier replay of this file refused, up to where it stopped
            os.truncate(retry_path, position.retry_length)
        retry = Spool(retry_path, header)
        counts = _counts(in_doubt=in_doubt)
        start = _after_header(path) if position.offset is None else position.offset
        window = _Window(position, retry_path, counts, progress, start)
        # The sink's queue, the engine every sink has: its retries, its groups (MLflow: a request of
        # up to 1,000 metrics), and what it cannot deliver goes to the retry file, its spool.
        # The run's retries; its queue size is the window's (replay never has more on their way,
        # and a full queue would set records aside before their first attempt).
        policy = dataclasses.replace(settings.delivery, export_interval_s=0.0, queue_size=_WINDOW)
        queue = SinkQueue(
            f"replay-{sink.name}", sink.deliver, sink.count, retry, policy, done=window.settled,
            deliver_many=sink.deliver_many,
        )  # fmt: skip
        # A second Ctrl-C (KeyboardInterrupt) leaves from the middle of this: what is on its way is
        # in doubt at the next replay.
        for end, record in records:
            if interrupt.requested.is_set() or window.broken:
                counts["interrupted"] = 1
                break
            if isinstance(record, Damaged):
                window.skip(end, f"{record.path}: damaged record at byte {record.offset} skipped ({record.reason})")
            elif record[0] == "end":  # not data: it tells replay how the run ended
                window.skip(end)
            else:
                kind, payload = record
                if kind == "metrics" and sink.exporters.step_records is not None:  # a log() call again, for
                    payload = step_batch_of(payload) or payload  # a step exporter's bulk path
                queue.submit(kind, payload, window.hand(end, item_count(kind, payload)))
                if window.on_its_way() >= _WINDOW:
                    _settle_all(queue)
        _settle_all(queue)
        queue.stop(settings.finish_timeout_s)
        counts["interrupted"] |= window.broken
        sink.finish(0 if ended is None else ended)
        retry.close()
        if counts["interrupted"]:
            position.close()
            progress.say(f"{path}: interrupted; the next replay goes on after record {done_before + counts['records']}")
        elif retry_path.exists() and retry_path.stat().st_size:
            if ended is not None:  # the next replay ends the run again (no harm: the same status)
                retry.end(ended)
            os.replace(retry_path, path)  # a new inode: the position beside it is stale from here
            position.remove()
        else:
            retry_path.unlink(missing_ok=True)
            path.rename(path.with_name(path.name + REPLAYED))
            position.remove()
    return counts


def _after_header(path: Path) -> int:
    with open(path, "rb") as f:
        return len(f.readline())


def main(paths: list[str], out: TextIO = sys.stderr) -> int:
    """Replay ``paths`` (default: the whole spool); one line per file, then a summary.  Exit code 0
    when everything was delivered; 1 when something was not (kept for the next replay), a record
    was damaged or set aside in doubt, a path does not exist or names a file replayed already;
    130 when Ctrl-C or SIGTERM stopped it (the next replay goes on from there)."""
    # MLflow's client retries a refused connection 7 times with doubling pauses (~4 min a request,
    # three init attempts): at a command line, say "not reachable" in seconds instead.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        out.write(f"otel-tracking replay: no such file or directory: {', '.join(missing)}\n")
        return 1
    done_already = [p for p in paths if Path(p).is_file() and p.endswith(REPLAYED)]
    if done_already:  # its items are in the backend: sending them again would log every one twice
        out.write(
            f"otel-tracking replay: {', '.join(done_already)}: replayed already (everything in it was delivered); "
            f"to deliver it again, rename it without {REPLAYED}\n"
        )
        return 1
    files = spool_files([Path(p) for p in paths] or [spool_root()])
    if not files:
        out.write("nothing to replay\n")
        return 0
    total = _counts()
    not_replayed = 0
    with Interrupt() as interrupt:
        try:
            for path in files:
                if interrupt.requested.is_set():
                    break
                try:
                    result = replay_file(path, out, interrupt=interrupt)
                except Exception as error:  # one file's sink that cannot be rebuilt does not stop the others
                    out.write(f"{path}: not replayed: {type(error).__name__}: {error}\n")
                    not_replayed += 1
                    continue
                if result["skipped"]:  # it said why already
                    total["busy"] += result["busy"]
                    total["in_doubt"] += result["in_doubt"]
                    not_replayed += not result["busy"]
                    continue
                for name in _COUNTS:
                    total[name] += result[name]
                out.write(f"{path}: {_outcome(result)}\n")
        except KeyboardInterrupt:  # a second Ctrl-C: the record on its way is in doubt at the next replay
            out.write("otel-tracking replay: stopped at once; the next replay goes on from where it stopped\n")
            return 130
    out.write(_summary(len(files), total, not_replayed) + "\n")
    if interrupt.requested.is_set():
        out.write("otel-tracking replay: interrupted; run it again to go on (nothing is delivered twice)\n")
        return 130
    return 1 if total["failed"] or total["damaged"] or total["in_doubt"] or not_replayed else 0


def _outcome(c: Mapping[str, int]) -> str:
    """What became of one file's records (or all files'), in a few words."""
    said = f"{c['delivered']}/{c['records']} records delivered ({c['items_delivered']}/{c['items']} items)"
    if c["damaged"]:
        said += f", {c['damaged']} damaged record(s) skipped"
    if c["failed"]:
        said += f", {c['failed']} not delivered: kept for the next replay"
    if c["in_doubt"]:
        said += f", {c['in_doubt']} set aside in doubt (*{IN_DOUBT})"
    return said


def _summary(files: int, total: Mapping[str, int], not_replayed: int) -> str:
    said = f"otel-tracking replay: {files} file(s), {_outcome(total)}"
    if total["busy"]:
        said += f"; {total['busy']} file(s) still being written, skipped"
    if not_replayed:
        said += f"; {not_replayed} file(s) not replayed (said above why), kept"
    return said
