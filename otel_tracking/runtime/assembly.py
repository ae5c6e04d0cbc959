"""A driver's run put together: backend names and settings in, a :class:`Run` with its sinks out.

``Tracking()`` (``api/facade.py``) takes the user's arguments and calls the two steps here, in order:

1. :func:`check_backends`: everything that can be found wrong without opening anything (a missing
   package, a bad tracker setting, an ``OTEL_*_EXPORTER`` name that is nothing), so that a failed
   ``Tracking()`` leaves nothing open and nothing written;
2. :func:`open_run`: the trackers in the bridge process (``bridges/process.py``) when it is
   on, else here (their logs read on threads of this process, ``delivery/tracker_logs.py``);
   the sinks named by ``OTEL_*_EXPORTER``; the OTLP sinks; the file and console sinks last, as
   nothing after them can fail.  If anything fails, what was built is finished.

A Ray worker or subprocess without ``Tracking`` builds its run in ``distributed/worker.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_tracking.bridges.process import start_bridges
from otel_tracking.config.resource import build_resource
from otel_tracking.config.run_config import RunConfig
from otel_tracking.config.settings import Settings
from otel_tracking.delivery.env_sinks import build_env_sinks, check_env_sinks
from otel_tracking.delivery.otlp_sinks import build_otlp_sinks
from otel_tracking.delivery.pipeline import Sink
from otel_tracking.delivery.registry import WRITTEN_AT_ONCE, build_checked_sink, check_tracker, is_tracker
from otel_tracking.delivery.tracker_logs import LocalTrackers
from otel_tracking.runtime.run import Run


def check_backends(settings: Settings, names: Sequence[str]) -> None:
    """Raise (``ConfigError``, ``ImportError`` with the extra to install) for what is wrong with
    these backends or the ``OTEL_*_EXPORTER`` variables, before anything is opened."""
    for name in names:
        if is_tracker(name):
            check_tracker(name, settings)
    check_env_sinks(settings, taken=names)


def open_run(settings: Settings, names: Sequence[str], config: RunConfig) -> Run:
    """The run with a sink for each name (``rl_insight`` is the OTLP path, not a sink), in the
    order named, then those ``OTEL_*_EXPORTER`` asks for; nothing half-built stays behind."""
    trackers = [name for name in names if is_tracker(name)]
    built: dict[str, Sink] = {}
    extra: list[Sink] = []
    periodic: list[Sink] = []
    try:
        if trackers and settings.bridge_process:
            built.update(zip(trackers, start_bridges(trackers, settings, config), strict=True))
        local = [name for name in names if name not in built and name != "rl_insight"]
        for name in sorted(local, key=lambda n: n in WRITTEN_AT_ONCE):
            built[name] = build_checked_sink(name, settings, config)
        in_process = [built[name] for name in local if is_tracker(name)]
        if in_process:  # their logs, read here (the bridge process reads them when it is on)
            LocalTrackers(in_process, settings, build_resource(settings))
        extra, periodic = build_env_sinks(settings, config, taken=names)
        otlp = build_otlp_sinks(settings)
        sinks = [built[name] for name in names if name in built] + extra
        return Run(settings, sinks, otlp_sinks=otlp, periodic_sinks=periodic)
    except BaseException:  # no sink open, no bridge process
        for sink in [*built.values(), *extra, *periodic]:
            sink.finish(1)
        raise
