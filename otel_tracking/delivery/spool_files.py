"""Where a run's spools live: the directory, checked once, and one file per sink and rank."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

from otel_tracking.config.paths import path_part
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.engine import Spool
from otel_tracking.delivery.pipeline import Sink

logger = logging.getLogger("otel_tracking")


def check_spool_dir(settings: Settings) -> Settings:
    """The settings with ``spool_writable`` said: the spool directory is made and a file written
    and removed there.  When that fails, one warning says what it costs (nothing can be spooled:
    what a backend cannot take is dropped, and counted; no reattach record).  ``Tracking()`` does
    this; a worker run (whose directory would be one per process) finds out when it first spools."""
    if settings.spool_writable is not None:
        return settings
    directory = settings.spool_dir
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        logger.warning(
            "otel-tracking: the spool directory %s cannot be written (%s; OTEL_TRACKING_SPOOL_DIR chooses it): "
            "what a backend cannot take in time is dropped instead of kept for `otel-tracking replay` (the "
            "summary at finish() counts it), and a restarted job cannot resume this run",
            directory,
            error.strerror or type(error).__name__,
        )
        return dataclasses.replace(settings, spool_writable=False)
    return dataclasses.replace(settings, spool_writable=True)


def sink_spool(sink: Sink, settings: Settings, pid: int) -> Spool | None:
    """Where a queued sink keeps what it cannot deliver; the header tells replay how to rebuild it."""
    if sink.inline or settings.spool_writable is False:
        return None
    from otel_tracking.delivery.registry import destination

    header = {
        "sink": sink.name,
        "project": settings.project,
        "experiment": settings.experiment,
        "run_id": settings.run_id,
        "resume": sink.resume,
        "pid": pid,
        "attempt": settings.attempt,
        # Where the tracker was configured to write, known before it opens (or if it never does).
        "destination": destination(sink.name, settings),
    }
    # Ranks of one job share a run id, and each has its own tracker runs: a file (and a header) each.
    name = path_part(sink.name if settings.rank is None else f"{sink.name}.rank{settings.rank}")
    # A resumed run has the run id, so the spool directory, of the attempt before it, whose spool
    # may wait there for replay: each attempt writes files of its own.
    if settings.attempt > 1:
        name = f"{name}.attempt{settings.attempt}"
    return Spool(settings.spool_dir / f"{name}.jsonl", header)
