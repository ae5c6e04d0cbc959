"""SwanLab: the steps the bridge emits itself (``compat/swanlab_internals.py``, skipping run.log's per-value checks)
are the records run.log writes for the same calls, read back with SwanLab's own reader."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import STEP_VALUES
from tests.readers_swanlab import wait_for_run

pytestmark = pytest.mark.backend

_KEYS = st.one_of(
    st.sampled_from(["loss", "a/b", "/lead", "trail/", " pad ", "a.", "ctl\x01", "ünï/cødé", "x" * 300]),
    st.text(max_size=6),
)
_STEPS = st.lists(st.tuples(st.dictionaries(_KEYS, STEP_VALUES, max_size=5), st.integers(0, 30)), max_size=6)
_RUNS = iter(range(10**6))


def _records(log_dir: Path) -> list[tuple[str, int, Any]]:
    (run,) = wait_for_run(log_dir)
    return [(key, step, "<NaN>" if value != value else value) for key, step, value in run.scalars]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
@example(steps=[({"loss": math.nan, "up": math.inf, "down": -math.inf, "n": 3, "ok": True}, 0), ({"a/b": 0.5}, 2)])
@example(steps=[({"loss": 1.0}, 0), ({"loss": 2.0, "/lead": 1.0}, 1), ({"loss": 3.0, "note": "text"}, 1)])
def test_steps_emitted_directly_are_the_records_run_log_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: list[tuple[dict[str, Any], int]]
) -> None:
    import swanlab

    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.swanlab import SwanLabSession

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    name = next(_RUNS)
    own_dir, ours_dir = tmp_path / f"own-{name}", tmp_path / f"ours-{name}"
    run = swanlab.init(mode="offline", project="p", name=f"own-{name}", log_dir=str(own_dir), reinit=True)
    for data, step in steps:
        run.log(dict(data), step=step)
    run.finish()

    env = {"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(ours_dir)}
    session = SwanLabSession(TrackerContext(project="p", experiment=f"ours-{name}", env=env))
    assert session._steps is not None  # this SwanLab has the internals: the direct path is what runs
    for data, step in steps:
        session.log(dict(data), step)
    session.finish()

    assert _records(ours_dir) == _records(own_dir)


def test_a_step_of_numbers_under_checked_keys_skips_run_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.swanlab import SwanLabSession

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    env = {"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")}
    session = SwanLabSession(TrackerContext(project="p", experiment="direct", env=env))
    logged: list[int] = []
    run_log = session.run.log
    monkeypatch.setattr(session.run, "log", lambda data, step=None: (logged.append(step), run_log(data, step=step)))
    session.log({"a/b": 1.0, "n": 2, "ok": False}, 0)  # plain numbers, keys SwanLab keeps: emitted directly
    session.log({"a/b": 1.5, "/lead": 2.0}, 1)  # a key SwanLab trims: run.log
    session.log({"a/b": 2.0, "text": "not a number"}, 2)  # a string: run.log (which rejects it)
    session.finish()
    assert logged == [1, 2]
    (run,) = wait_for_run(tmp_path / "swanlog")
    assert [(k, s, v) for k, s, v in run.scalars] == [
        ("a/b", 0, 1.0),
        ("n", 0, 2.0),
        ("ok", 0, 0.0),
        ("a/b", 1, 1.5),
        ("lead", 1, 2.0),
        ("a/b", 2, 2.0),
    ]


def test_the_pinned_swanlab_has_every_private_name_and_is_a_tested_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contract with the pinned SwanLab: fails when a private name moves."""
    import swanlab

    from otel_tracking.compat import swanlab_internals

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert swanlab_internals.tested_version(swanlab), (
        f"SwanLab {swanlab.__version__} is not in TESTED_RELEASES {swanlab_internals.TESTED_RELEASES}: "
        "run these tests against it, then add it"
    )
    run = swanlab.init(mode="offline", project="p", name="contract", log_dir=str(tmp_path / "own"), reinit=True)
    try:
        assert swanlab_internals.missing(run) == []
    finally:
        run.finish()


def test_without_a_private_name_every_step_goes_through_run_log_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from swanlab.sdk.internal import bus

    from otel_tracking.compat import swanlab_internals
    from otel_tracking.exporters._base import TrackerContext
    from otel_tracking.exporters.swanlab import SwanLabSession

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(swanlab_internals._say, "said", set())
    monkeypatch.delattr(bus, "MetricLogEvent")  # a release that moved it
    env = {"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")}
    session = SwanLabSession(TrackerContext(project="p", experiment="moved", env=env))
    assert session._steps is None
    session.log({"loss": 1.0}, 0)
    session.log({"loss": 0.5}, 1)
    session.finish()
    warned = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "MetricLogEvent" in r.getMessage()
    ]
    assert len(warned) == 1, warned
    (run,) = wait_for_run(tmp_path / "swanlog")
    assert [(k, s, v) for k, s, v in run.scalars] == [("loss", 0, 1.0), ("loss", 1, 0.5)]
