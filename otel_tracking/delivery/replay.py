"""``otel-tracking replay``: deliver what a sink could not take, from its spool log, into that sink.

Each spool log (``<spool dir>/<project>/<experiment>-<run id>/<sink>.jsonl``) starts with a header
naming the sink and the run; replay rebuilds that sink from the header and the *current*
environment (so point ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``MLFLOW_TRACKING_URI`` where the data
should go now), reattaches to the backend's run where the tracker supports it (MLflow: the same run
id), and hands every record, in order, to the sink's queue: the same engine as in a run, with its
retries and its bulk path (MLflow packs many steps into one request).

Replay is a reader of an append-only log with a position (``delivery/position.py``): it never
renames, swaps or truncates a log, so a process that still appends to it (a job still running)
loses nothing: what it appends lands after the position, where the next replay reads.  The
position moves past a record once the tracker has it; the first record the sink cannot deliver
stops the replay of that log, and the position stays before it (the next replay retries from
there).  A log whose every record is delivered and which no writer holds (``flock``, see
``spool.Spool``) is removed; one a writer still holds is delivered up to its end and left for the
next replay.  Replays of one run's directory take turns (an ``flock`` on the directory).

Ctrl-C or SIGTERM stop a replay once the records on their way are settled; a replay killed while
records were on their way leaves them to the next one, which sets them aside in ``<log>.in-doubt``
rather than deliver them a second time: each record is delivered at most once.

Exit code 0 only when everything was delivered and nothing is left in the spool to deliver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from otel_tracking.config.destinations import with_destination
from otel_tracking.config.paths import spool_root
from otel_tracking.config.resource import build_resource
from otel_tracking.config.settings import Settings, build_settings
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.position import (
    IN_DOUBT,
    LEGACY_RETRY,
    DamagedPosition,
    LogPosition,
    migrate_legacy,
)
from otel_tracking.delivery.reader import LogReader, pending_items, remove_if_delivered
from otel_tracking.delivery.spool import part_of, read_header, unframe

REPLAYED = ".replayed"  # the suffix an older release gave a log delivered in full
_OTLP = {"otlp-metrics": "metrics", "otlp-traces": "traces", "otlp-logs": "logs"}

# Exit codes: 1 an error (a path that does not exist, damaged records skipped); LEFT something is
# still in the spool to deliver (a log a running process writes, records the backend did not take,
# records in doubt, a log not replayed): run replay again later, and do not delete the spool.
LEFT = 75  # EX_TEMPFAIL in sysexits.h: "try again later"
INTERRUPTED = 130

_ATTEMPT = re.compile(r"\.attempt(\d+)(?=\.)")
# Files of older releases: what the training process spooled when the bridge process was gone had a
# file of its own (it now appends to the sink's file); an interrupted replay kept what the backend
# refused in ``<log>.retry``.
_LINK = re.compile(r"\.link(?=\.jsonl$)")
_PART = re.compile(r"\.part\d+(?=\.jsonl$)")


def spool_files(paths: Iterable[Path]) -> list[Path]:
    """The spool logs under ``paths``, in the order their items were logged: a sink's log of
    each attempt of a run after the attempt before it (``mlflow.jsonl``, ``mlflow.attempt2.jsonl``,
    ...), each part of a log after the part before it (``mlflow.part2.jsonl``), whatever their
    names sort as; an older release's ``<log>.retry`` just before its log."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(p for p in path.rglob("*.jsonl") if p.is_file())
            found.extend(p for p in path.rglob(f"*.jsonl{LEGACY_RETRY}") if p.is_file())
        elif path.is_file():
            found.append(path)
    return sorted(dict.fromkeys(found), key=_logged_order)


def _logged_order(path: Path) -> tuple[str, str, int, int, str, int]:
    """(directory, the sink's file name without attempt, part or link tag, attempt, part, name,
    retry first)."""
    name = path.name.removesuffix(LEGACY_RETRY)
    match = _ATTEMPT.search(name)
    attempt = int(match.group(1)) if match else 1
    sink_file = _PART.sub("", _LINK.sub("", _ATTEMPT.sub("", name)))
    return str(path.parent), sink_file, attempt, part_of(Path(name)), name, int(name == path.name)


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


def _records_in(path: Path, start: int) -> tuple[int, int]:
    """(records before ``start``, records from there on), less the header."""
    before = after = 0
    with open(path, "rb") as f:
        f.readline()  # the header
        offset = f.tell()
        for line in f:
            if line.strip() and b'{"header"' not in line[:20]:  # a second writer's header is no record
                if offset < start:
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
_COUNTS += ("writing", "left", "skipped", "interrupted", "in_doubt")


def _counts(**nonzero: int) -> dict[str, int]:
    """One file's outcome: its records (less an end record), those delivered, failed (kept for the
    next replay) and damaged (skipped); the items in them (spans, log records, log() calls: what
    a run's summary counts) and those delivered; writing (a running process still writes the log:
    what it adds waits for the next replay), left (not replayed, said why, kept for a later
    replay), skipped (nothing more to say of it), interrupted (stopped before its end, goes on at
    the next replay) and in_doubt (set aside: a killed replay had them on their way)."""
    return {**dict.fromkeys(_COUNTS, 0), **nonzero}


@contextlib.contextmanager
def _turn(directory: Path) -> Iterator[bool]:
    """This replay's turn at one run's logs: True while no other replay holds the directory."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def replay_file(
    path: Path, out: TextIO = sys.stderr, env: Mapping[str, str] | None = None, interrupt: Interrupt | None = None
) -> dict[str, int]:
    """Deliver one spool log into its sink through the sink's queue, in order (streamed, never
    loading the file whole), from its position.  A damaged record is skipped and named (file and
    byte offset); what the sink does not take stays for the next replay; a log a running process
    still writes is delivered up to its end and left; ``interrupt`` stops it once the records on
    their way are settled."""
    with _turn(path.parent) as mine:
        if not mine:
            out.write(f"{path}: a running job or another replay is delivering this run's logs right now; left to it\n")
            return _counts(left=1, skipped=1)
        try:
            return _replay_log(path, out, env, interrupt or _NEVER)
        except DamagedPosition as error:
            out.write(
                f"{path}: not replayed: its position, {error}; replaying it from the start could deliver records "
                "twice (remove that file to do so)\n"
            )
            return _counts(left=1, skipped=1)


def _replay_log(path: Path, out: TextIO, env: Mapping[str, str] | None, interrupt: Interrupt) -> dict[str, int]:
    try:
        empty = path.stat().st_size == 0
    except FileNotFoundError:  # delivered and removed by a replay that had its turn first
        return _counts(skipped=1)
    if empty:
        # Its process was killed between creating it and writing the header, or a writer is
        # between the two right now: left as it is, so that such a writer's records stay where
        # replay will find them.
        out.write(f"{path}: empty (its process stopped before writing to it); nothing to replay\n")
        return _counts(skipped=1)
    header, header_line = read_header(path)
    if not header.get("sink"):
        why = "its header is damaged" if header_line or path.read_bytes()[:1] != b"{" else "it has no header"
        out.write(f"{path}: {why}; nothing to rebuild the sink from; skipped\n")
        return _counts(damaged=1, left=1, skipped=1)
    position = LogPosition.load(path, header_line)
    in_doubt = position.set_aside_in_doubt(path, header_line)
    if in_doubt:
        out.write(
            f"{path}: a replay was killed while {in_doubt} record(s) were on their way; they may or may not have "
            f"arrived, so they are not delivered again: set aside in {path.name}{IN_DOUBT} (replay that file by "
            "name to deliver them anyway)\n"
        )
    if position.offset >= path.stat().st_size and not position.after:  # nothing new since the last replay
        state = remove_if_delivered(path, position)
        if state == "writing":
            out.write(f"{path}: nothing new; a running process still writes it: the next replay delivers the rest\n")
            return _counts(writing=1, skipped=1, in_doubt=in_doubt)
        if state == "removed":
            out.write(f"{path}: every record was delivered already; removed\n")
            return _counts(skipped=1, in_doubt=in_doubt)
    ended = _end_record(path)
    names_no_run = not header.get("resume")  # its tracker never opened in the run
    if position.resume and names_no_run:  # the run an earlier replay of this log made
        header = {**header, "resume": position.resume}
    if ended is not None:  # the run ended without its tracker: replay ends the backend's run
        header = {**header, "resume": {**(header.get("resume") or {}), "end_run": True}}
    sink, settings = rebuild_sink(header, env)
    out.write(f"{header['sink']}: {path} -> {sink.where or 'its backend'}\n")
    if sink.metrics is None and sink.spans is None and sink.logs is None:  # it could not open
        out.write(f"{path}: not replayed (the backend did not open); kept for the next replay\n")
        return _counts(left=1, skipped=1, in_doubt=in_doubt)
    if names_no_run and not position.resume and sink.resume:  # the next replay of this log goes on into this run
        position.resume = sink.resume
        position.save()
    done_before, total = _records_in(path, position.offset)
    if position.resumed:
        out.write(f"{path}: going on after record {done_before} (where an earlier replay left it)\n")
    records = total - (ended is not None)
    progress = Progress(records, f"{header['sink']} <- {path.name}", out)
    counts = _counts(in_doubt=in_doubt)

    def landed(n: int, items: int) -> None:
        counts["delivered"] += n
        counts["items_delivered"] += items
        for _ in range(n):
            progress.step(True)

    # The reader every tracker's log has (delivery/reader.py): its retries, its groups (MLflow: a
    # request of up to 1,000 metrics); it stops at the first group the tracker does not take, which
    # stays in the log.  At most once: what is on its way is marked handed first.
    reader = LogReader(
        path, sink, dataclasses.replace(settings.delivery, export_interval_s=0.0), build_resource(settings),
        follow=False, at_most_once=True, landed=landed, say=progress.say, stop=interrupt.requested,
    )  # fmt: skip
    state = "grown"
    while state == "grown":  # records came while it delivered, from a writer gone since: once more
        before = reader.at()
        state = reader.run()
        if state == "delivered":
            state = remove_if_delivered(path, reader.position)
            if state == "grown" and reader.at() == before:
                state = "writing"  # nothing came of another pass: leave the rest to the next replay
    sink.finish(0 if ended is None else ended)
    counts["damaged"] = reader.damaged
    pending = pending_items(path)
    counts["items"] = counts["items_delivered"] + pending
    if state == "interrupted":
        counts["records"] = counts["delivered"] + counts["damaged"]
        counts["interrupted"] = 1
        done_now, _ = _records_in(path, reader.at())
        progress.say(f"{path}: interrupted; the next replay goes on after record {done_now}")
    else:
        counts["records"] = max(records, counts["delivered"] + counts["damaged"])
        counts["failed"] = counts["records"] - counts["delivered"] - counts["damaged"]
        for _ in range(counts["failed"]):
            progress.step(False)
    counts["writing"] = int(state == "writing")
    return counts


def main(paths: list[str], out: TextIO = sys.stderr) -> int:
    """Replay ``paths`` (default: the whole spool); one line per file, then a summary.  Exit code 0
    when everything was delivered and nothing is left to deliver; LEFT (75) when something is left
    for a later replay (a log a running process still writes, records the backend did not take,
    records set aside in doubt, a log not replayed); 1 for a path that does not exist, a file an
    older release marked replayed, or damaged records skipped; 130 when Ctrl-C or SIGTERM stopped
    it (the next replay goes on from there)."""
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
    migrate_legacy(f for f in files if not f.name.endswith(LEGACY_RETRY))
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
                for name in _COUNTS:
                    total[name] += result[name]
                if result["skipped"]:  # it said why already
                    not_replayed += result["left"]
                    continue
                out.write(f"{path}: {_outcome(result)}\n")
        except KeyboardInterrupt:  # a second Ctrl-C: the record on its way is in doubt at the next replay
            out.write("otel-tracking replay: stopped at once; the next replay goes on from where it stopped\n")
            return INTERRUPTED
    out.write(_summary(len(files), total, not_replayed) + "\n")
    if interrupt.requested.is_set():
        out.write("otel-tracking replay: interrupted; run it again to go on (nothing is delivered twice)\n")
        return INTERRUPTED
    if total["failed"] or total["writing"] or total["in_doubt"] or not_replayed:
        return LEFT
    return 1 if total["damaged"] else 0


def _outcome(c: Mapping[str, int]) -> str:
    """What became of one file's records (or all files'), in a few words."""
    said = f"{c['delivered']}/{c['records']} records delivered ({c['items_delivered']}/{c['items']} items)"
    if c["damaged"]:
        said += f", {c['damaged']} damaged record(s) skipped"
    if c["failed"]:
        said += f", {c['failed']} not delivered: kept for the next replay"
    if c["in_doubt"]:
        said += f", {c['in_doubt']} set aside in doubt (*{IN_DOUBT})"
    if c["writing"] and c["records"]:  # the per-file line; the summary says it below
        said += "; a running process still writes it: the next replay delivers what it adds"
    return said


def _summary(files: int, total: Mapping[str, int], not_replayed: int) -> str:
    said = f"otel-tracking replay: {files} file(s), {_outcome({**total, 'writing': 0})}"
    if total["writing"]:
        said += f"; {total['writing']} file(s) still being written by a running process, left for the next replay"
    if not_replayed:
        said += f"; {not_replayed} file(s) not replayed (said above why), kept"
    return said
