"""Where each tracker writes, as the run was configured: kept in a spool's header, used by replay.

A tracker that never opened (down at the start, killed before it came) still has a place it was
meant to write to: its variables (``MLFLOW_TRACKING_URI``, ``TENSORBOARD_DIR``, ...) as the run saw
them.  ``delivery/spool.py`` writes them into each spool file's header when the run starts, and
``delivery/replay.py`` sets them again before it rebuilds the tracker, so that replay goes where
the run was configured to go.  Credentials are never kept: a value holding one is stored as None,
and replay then asks for the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from otel_tracking.config.settings import ConfigError, Settings
from otel_tracking.config.trackers import TRACKERS
from otel_tracking.signals.redact import scrub_text


def destination(name: str, settings: Settings) -> dict[str, str | None]:
    """Where the tracker ``name`` writes, as the values of its variables this run was configured
    with (relative directories made absolute; TensorBoard's and SwanLab's default directories
    too, as they depend on the working directory).  A value with credentials in it is kept as
    None: replay then needs the variable set."""
    env = settings.env
    tracker = TRACKERS.get(name)
    found: dict[str, str | None] = {}
    for variable in tracker.destination if tracker else ():
        value = env.get(variable)
        if value is None:
            continue
        if tracker and variable in tracker.directories:
            value = os.path.abspath(os.path.expanduser(value))
        found[variable] = value if scrub_text(value) == value else None
    if name == "tensorboard" and settings.tensorboard_dir is not None:
        found["TENSORBOARD_DIR"] = os.path.abspath(settings.tensorboard_dir)
    if name == "swanlab" and "SWANLAB_LOG_DIR" not in found:
        found["SWANLAB_LOG_DIR"] = os.path.abspath("swanlog")
    return found


def with_destination(env: Mapping[str, str], header_destination: Mapping[str, str | None]) -> dict[str, str]:
    """``env`` plus the run's destination variables it does not set itself (what is set now wins:
    point a variable elsewhere to replay elsewhere).  ``ConfigError`` for a variable the run had
    set with credentials in it, which the spool does not keep."""
    out = dict(env)
    for variable, value in header_destination.items():
        if variable in out:
            continue
        if value is None:
            raise ConfigError(
                f"the run wrote to {variable} with credentials in it, which the spool does not keep; "
                f"set {variable} to replay it"
            )
        out[variable] = value
    return out
