"""wandb: the steps the bridge hands to wandb's service itself (``compat/wandb_internals.py``, skipping run.log's
per-value work) are the records run.log writes for the same calls, read back from the run's own
``.wandb`` file with ``tests/readers_wandb.py``."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import STEP_VALUES
from tests.readers_wandb import _key, only_run

pytestmark = pytest.mark.backend

_KEYS = st.one_of(
    st.sampled_from(["loss", "a/b", "a.b", " pad ", "_step", "_timestamp", "_runtime", "_x", "ünï", "bad\ud800"]),
    st.text(max_size=6),
)
_STEPS = st.lists(st.tuples(st.dictionaries(_KEYS, STEP_VALUES, max_size=6), st.integers(0, 30)), max_size=8)
_RUNS = iter(range(10**6))
_TIMES = ("_timestamp", "_runtime", "_wandb/runtime")  # wandb's own times: present in both, never equal


@pytest.fixture
def fresh_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb caches its settings per process: its folders under this test's, its singleton torn down."""
    import wandb

    for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        (tmp_path / "wandb" / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / "wandb" / sub))
    wandb.teardown()
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def _record(step: int, data: dict[str, Any]) -> Any:
    from otel_tracking.signals.steps import StepRecord

    scalars = {k: v for k, v in data.items() if type(v) in (float, int, bool)}
    return StepRecord(step=step, scalars=scalars, others={k: v for k, v in data.items() if k not in scalars})


def _session(where: Path, name: str, direct: bool) -> Any:
    """A session as the bridge opens one; ``direct=False``: every step through run.log, as before."""
    import wandb

    from otel_tracking.exporters.wandb import WandbSession

    session = WandbSession.start(wandb, project="p", name=name, dir=str(where), mode="offline")
    if not direct:
        session._history_looked = True  # never looks for the direct path: run.log for everything
    return session


def _shown(item: Any) -> tuple[str, str]:
    """An item as stored; wandb's own times and a table's artifact ids (random) only as present."""
    key = _key(item)
    if key in _TIMES:
        return key, "<time>"
    return key, "<artifact>" if key.endswith("artifact_path") else item.value_json


def _stored(root: Path) -> dict[str, Any]:
    """What a run stored: each history record (its step, its items as stored), the summary, the
    run's telemetry features at its end."""
    run = only_run(root)
    rows, summary, features = [], {}, ""
    for record in run.records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append((record.history.step.num, sorted(_shown(item) for item in record.history.item)))
        elif kind == "summary":
            summary.update(dict(_shown(item) for item in record.summary.update))
        elif kind == "telemetry":
            features = str(record.telemetry.feature)
    return {"rows": rows, "summary": summary, "features": features}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_STEPS)
@example(  # the first step goes through run.log (see FastSteps.usable): the edge cases come after it
    steps=[
        ({"a": 0.0}, 0),
        ({"loss": math.nan, "up": math.inf, "down": -math.inf, "n": 3, "ok": True}, 1),
        ({"big": 2**70}, 1),
    ]
)
@example(steps=[({"a": 1.0}, 0), ({"a": 2.0, "b": -0.0, "c": 1e-7, "d": 1e300}, 1), ({"_step": 9, "_runtime": 5.0}, 2)])
@example(steps=[({"a": 1.0}, 3), ({"a": 2.0}, 5), ({"a": 2.5}, 4), ({"b": 0.5}, 5), ({"t": "x", "a": 7}, 6)])
def test_steps_sent_directly_are_the_records_run_log_writes(
    fresh_wandb: Path, steps: list[tuple[dict[str, Any], int]]
) -> None:
    """Every history record, the summary and the telemetry must be what the session wrote when
    each step went through run.log; and the run's step the same afterwards."""
    name = next(_RUNS)
    stored = []
    for direct in (False, True):
        where = fresh_wandb / f"{direct}-{name}"
        where.mkdir()
        session = _session(where, f"{direct}-{name}", direct)
        assert session.write_steps([_record(step, dict(data)) for data, step in steps]) == [None] * len(steps)
        # A table after them, through run.log: its file is named after the run's step (run.log's
        # bookkeeping, which the direct path keeps too).
        after = (session.high_step or 0) + 1
        assert session.log_reward_row(["step", "reward_counts"], [after, "1.0:2"], after)
        if direct:
            assert session._history is not None  # this wandb has the internals: the direct path is what ran
        state = (session.skipped, session.high_step, session.run.step)
        session.finish()
        stored.append((_stored(where), *state))
    assert stored[1] == stored[0]


def test_plain_steps_go_directly_the_others_through_run_log(fresh_wandb: Path) -> None:
    """Which path each step takes, and that a batch goes in hand-offs of bounded size, each one
    reported as progress."""
    from otel_tracking.compat import wandb_internals
    from otel_tracking.exporters import wandb as bridge

    session = _session(fresh_wandb, "paths", direct=True)
    calls: list[int] = []
    wide = {f"m/{i}": float(i) for i in range(1_000)}
    records = [
        _record(0, {"a": 1.0}),  # the first step: run.log (it records the run's set_step_log telemetry)
        _record(1, {"a": 2.0, "n": 3, "ok": False}),  # direct
        _record(2, {"a": 3.0, "note": "text"}),  # a string: run.log
        _record(3, {"a": 4.0, "_x": 1.0}),  # a key starting with "_": run.log
        _record(2, {"a": 9.0}),  # below the step already logged: not stored, counted
        *[_record(step, wide) for step in range(4, 4 + 10)],  # 10,000 values: direct, in 3 hand-offs
    ]
    assert session.write_steps(records, progress=lambda: calls.append(1)) == [None] * len(records)
    history = session._history
    assert isinstance(history, wandb_internals.FastSteps)
    assert history.sent == 11
    assert session.skipped == 1
    assert len(calls) >= 4 + math.ceil(10 * len(wide) / bridge._VALUES_A_HANDOFF)
    assert session.run.step == 13
    session.finish()

    rows = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")} for row in only_run(fresh_wandb).rows}
    assert rows[1] == {"a": 2.0, "n": 3, "ok": False}
    assert rows[2] == {"a": 3.0, "note": "text"}
    assert rows[3] == {"a": 4.0}  # wandb keeps "_x" among its own keys
    assert rows[13] == wide
    assert sorted(rows) == list(range(14))


_SERVICE_GONE = r"""
import json, os, signal, sys, time
from pathlib import Path

from tests.test_wandb_fast_steps import _record, _session

def services():  # the wandb-core processes this process started
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if name.endswith("(wandb-core") and int(rest.split()[1]) == os.getpid():
            yield int(stat.parent.name)

session = _session(Path(sys.argv[1]), "gone", direct=True)
first = session.write_steps([_record(0, {"a": 0.0}), _record(1, {"a": 1.0})])
killed = [os.kill(pid, signal.SIGKILL) or pid for pid in services()]
step, deadline = 2, time.monotonic() + 30
while True:  # until the client sees its service gone (a write may still reach the dead socket)
    records = [_record(step, {"a": float(step)}), _record(step + 1, {"a": float(step + 1)})]
    rests = session.write_steps(records)
    if rests != [None, None] or time.monotonic() > deadline:
        break
    step += 2
    time.sleep(0.05)  # polling the client's state, not waiting for time to pass
print(json.dumps({
    "first": first, "killed": len(killed), "step": step, "handed_back": rests == records,
    "high_step": session.high_step, "sent": session._history.sent,
}))
sys.stdout.flush()
os._exit(0)  # its run cannot finish: its service is gone
"""


def test_steps_wandb_did_not_take_are_handed_back(fresh_wandb: Path) -> None:
    """When wandb's service is gone, the steps sent directly that it did not take are returned (the
    delivery layer retries or spools them), and the session's step stays at the last one taken.
    In a process of its own: a wandb whose service was killed cannot be torn down cleanly."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", _SERVICE_GONE, str(fresh_wandb)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first"] == [None, None] and result["killed"] >= 1
    assert result["handed_back"], result
    assert result["high_step"] == result["step"] - 1  # the last step wandb took
    assert result["sent"] == result["step"] - 1  # step 0 went through run.log


# --- the contract with wandb's private names -----------------------------------------------------


def test_the_pinned_wandb_has_every_private_name_and_the_direct_path_says_so(
    fresh_wandb: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every name compat/wandb_internals.py lists is in the wandb installed for tests (a release it
    was checked against), and which path runs is said once, at debug."""
    import wandb

    from otel_tracking.compat import wandb_internals

    monkeypatch.setattr(wandb_internals._say, "said", set())
    caplog.set_level(logging.DEBUG, logger="otel_tracking.wandb")
    assert wandb_internals.tested_version(wandb), wandb.__version__
    session = _session(fresh_wandb, "probe", direct=True)
    assert session.write_steps([_record(0, {"a": 1.0}), _record(1, {"a": 2.0})]) == [None, None]
    assert wandb_internals.missing(session.run, session.run._interface) == [], wandb.__version__
    assert isinstance(session._history, wandb_internals.FastSteps) and session._history.sent == 1
    said = [r.getMessage() for r in caplog.records if r.name == "otel_tracking.wandb"]
    assert said == [f"otel-tracking: wandb steps: steps of plain numbers go to wandb {wandb.__version__}'s "
                    "service directly, as run.log's requests"]  # fmt: skip
    session.finish()


def test_a_private_name_that_moved_is_said_once_and_run_log_writes_every_step(
    fresh_wandb: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release where a name the direct path needs is gone (here: one more name listed, which no
    wandb has): one warning naming it, for every run of the process, and every step through run.log,
    stored as logged."""
    from otel_tracking.compat import wandb_internals

    sock = "wandb.sdk.interface.interface_sock.InterfaceSock"
    names = {**wandb_internals.PRIVATE_NAMES, sock: (*wandb_internals.PRIVATE_NAMES[sock], "_renamed_later")}
    monkeypatch.setattr(wandb_internals, "PRIVATE_NAMES", names)
    monkeypatch.setattr(wandb_internals._say, "said", set())
    caplog.set_level(logging.DEBUG, logger="otel_tracking.wandb")
    for run in ("moved-1", "moved-2"):
        (fresh_wandb / run).mkdir()
        session = _session(fresh_wandb / run, run, direct=True)
        steps = [_record(step, {"a": float(step), "n": step}) for step in range(3)]
        assert session.write_steps(steps) == [None, None, None]
        assert session._history is None
        session.finish()
        rows = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")}
                for row in only_run(fresh_wandb / run).rows}  # fmt: skip
        assert rows == {step: {"a": float(step), "n": step} for step in range(3)}
    warned = [
        r.getMessage() for r in caplog.records if r.name == "otel_tracking.wandb" and r.levelno == logging.WARNING
    ]
    assert warned == [
        f"otel-tracking: wandb's private names moved: {sock}._renamed_later; every step goes through run.log"
    ]
