"""Where each step went (issue 33): the step's anatomy, measured from the driver's phases and the
work they handed out, logged at that step to every tracker and sent as OTLP gauges.

The arithmetic is checked against a brute-force model (hypothesis: each instant of a step
classified one nanosecond at a time); a real script shows the numbers in the file sink and in
TensorBoard (read back with its own reader), and over OTLP; a plain script that did not ask gets
no extra line (the file sink stays verl's, line for line)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_tracking.cli.timeline import read_spans
from otel_tracking.config.settings import ConfigError, build_settings
from otel_tracking.runtime.anatomy import DEFAULT_BUCKETS, Call, Phase, StepAnatomy, StepTrace, measure
from tests.otlp_receiver import HttpReceiver, wait_for
from tests.test_backend_wandb import wandb_dir  # noqa: F401 - a fixture

MS = 1_000_000


def _phase(name: str, start_ms: float, end_ms: float, failed: bool = False) -> Phase:
    return Phase(name, int(start_ms * MS), int(end_ms * MS), failed)


def test_an_enclosing_step_is_idle_where_no_phase_runs_inside_it() -> None:
    phases = [
        _phase("step", 0, 100),
        _phase("gen", 0, 30),
        _phase("old_log_prob", 30, 40),
        _phase("update_actor", 50, 80),
    ]
    got = measure(7, 0, 100 * MS, phases, [], DEFAULT_BUCKETS)
    assert got.step == 7 and got.wall_s == pytest.approx(0.1)
    assert got.shares == pytest.approx({"productive": 0.6, "overhead": 0.1, "wasted": 0.0, "idle": 0.3})


def test_an_instant_counts_once_for_the_best_phase_running_then() -> None:
    # reward overlaps old_log_prob: the overlap is productive, not counted twice
    phases = [_phase("old_log_prob", 0, 50), _phase("reward", 20, 60), _phase("my_own_phase", 60, 70)]
    got = measure(1, 0, 100 * MS, phases, [], DEFAULT_BUCKETS)
    assert got.shares == pytest.approx({"productive": 0.4, "overhead": 0.3, "wasted": 0.0, "idle": 0.3})


def test_a_phase_that_raised_is_wasted_and_the_users_buckets_win() -> None:
    phases = [_phase("gen", 0, 40, failed=True), _phase("gen", 40, 60), _phase("my_wait", 60, 90)]
    got = measure(1, 0, 100 * MS, phases, [], {**DEFAULT_BUCKETS, "my_wait": "idle", "gen": "productive"})
    assert got.shares == pytest.approx({"productive": 0.2, "overhead": 0.0, "wasted": 0.4, "idle": 0.4})


def test_busy_shares_count_the_ranks_no_call_reached_and_overlapping_calls_once() -> None:
    calls = [
        Call("update_actor", 0, 0, 20 * MS, "actor", ranks=4),
        Call("update_actor", 0, 10 * MS, 30 * MS, "actor", ranks=4),  # overlaps: rank 0 busy 30 ms
        Call("update_actor", 1, 0, 20 * MS, "actor", ranks=4),
        Call("update_actor", 2, 0, 60 * MS, "actor", ranks=4),  # rank 3: no call at all
    ]
    got = measure(1, 0, 100 * MS, [_phase("update_actor", 0, 60)], calls, DEFAULT_BUCKETS)
    assert got.busy == pytest.approx({"actor": (0.3 + 0.2 + 0.6 + 0.0) / 4})
    # the straggler: rank 2, 60 ms against the median of (30, 20, 60) = 30
    assert got.stragglers == {"update_actor": (2, pytest.approx(0.03))}
    metrics = got.metrics()
    assert metrics["anatomy/update_actor/straggler_rank"] == 2
    assert metrics["anatomy/update_actor/straggler_lag_s"] == pytest.approx(0.03)
    assert metrics["anatomy/actor/busy_frac"] == pytest.approx(0.275)


def test_a_step_never_logged_or_without_a_phase_has_no_anatomy() -> None:
    anatomy = StepAnatomy()
    anatomy.phase_ended(1, _phase("gen", 0, 10))
    assert anatomy.step_ended(None, [StepTrace(1, 0, 20 * MS)]) is None
    assert anatomy.step_ended(3, [StepTrace(2, 0, 20 * MS)]) is None
    anatomy.phase_ended(3, _phase("gen", 50, 60))
    # the run's set-up before it counts for no step
    first = anatomy.step_ended(1, [StepTrace(3, 0, 100 * MS, first=True)])
    assert first is not None and first.wall_s == pytest.approx(0.05)
    anatomy.phase_ended(3, _phase("gen", 100, 110))  # a phase of a step measured already: dropped
    assert anatomy.step_ended(1, [StepTrace(3, 0, 200 * MS)]) is None


def test_a_step_with_two_roots_is_measured_once_over_both() -> None:
    anatomy = StepAnatomy()
    anatomy.phase_ended(1, _phase("gen", 0, 40))
    anatomy.phase_ended(2, _phase("validate", 50, 70))
    got = anatomy.step_ended(4, [StepTrace(1, 0, 50 * MS), StepTrace(2, 50 * MS, 80 * MS)])
    assert got is not None and got.wall_s == pytest.approx(0.08)
    assert got.shares == pytest.approx({"productive": 0.5, "overhead": 0.25, "wasted": 0.0, "idle": 0.25})


def test_a_bad_bucket_is_a_clear_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"OTEL_TRACKING_ANATOMY_BUCKETS: 'gen=useful' is not phase=bucket"):
        build_settings("p", "e", ["console"], env={"OTEL_TRACKING_ANATOMY_BUCKETS": "gen=useful"})
    with pytest.raises(ConfigError, match="OTEL_TRACKING_ANATOMY="):
        build_settings("p", "e", ["console"], env={"OTEL_TRACKING_ANATOMY": "maybe"})
    got = build_settings("p", "e", ["console"], env={"OTEL_TRACKING_ANATOMY_BUCKETS": " my_phase = Wasted ,x=idle"})
    assert dict(got.anatomy_buckets) == {"my_phase": "wasted", "x": "idle"}


# --- the arithmetic against a brute-force model ---------------------------------------------------

NAMES = ["step", "gen", "reward", "old_log_prob", "adv", "mine", "wait_for_enough_samples"]
RANK_ORDER = {"productive": 3, "wasted": 2, "overhead": 1, "idle": 0}


@st.composite
def steps(draw: Any) -> tuple[int, list[Phase], list[Call]]:
    wall = draw(st.integers(10, 60))
    phase = st.tuples(st.sampled_from(NAMES), st.integers(-5, wall + 5), st.integers(0, 30), st.booleans())
    phases = [Phase(n, s, s + d, f) for n, s, d, f in draw(st.lists(phase, min_size=1, max_size=8))]
    call = st.tuples(
        st.sampled_from(["gen", "update_actor"]), st.integers(0, 3), st.integers(-5, wall), st.integers(1, 30)
    )
    calls = [Call(p, r, s, s + d, "actor", ranks=4) for p, r, s, d in draw(st.lists(call, max_size=10))]
    return wall, phases, calls


@given(steps())
@settings(max_examples=300, deadline=None)
def test_the_shares_match_a_nanosecond_by_nanosecond_model(step: tuple[int, list[Phase], list[Call]]) -> None:
    wall, phases, calls = step
    got = measure(1, 0, wall, phases, calls, DEFAULT_BUCKETS)
    model = dict.fromkeys(RANK_ORDER, 0)
    for t in range(wall):
        running = [
            "wasted" if p.failed else DEFAULT_BUCKETS.get(p.name, "overhead")
            for p in phases
            if p.start_ns <= t < p.end_ns
        ]
        running = [b for b in running if b != "enclosing"]
        model[max(running, key=RANK_ORDER.__getitem__, default="idle")] += 1
    assert got.shares == pytest.approx({b: n / wall for b, n in model.items()})
    busy = [sum(any(c.rank == r and c.start_ns <= t < c.end_ns for c in calls) for t in range(wall)) for r in range(4)]
    if calls and any(busy):
        assert got.busy["actor"] == pytest.approx(sum(busy) / 4 / wall)
    for phase, (rank, lag_s) in got.stragglers.items():
        took = {
            r: sum(
                any(c.rank == r and c.phase == phase and c.start_ns <= t < c.end_ns for c in calls) for t in range(wall)
            )
            for r in range(4)
        }
        took = {r: n for r, n in took.items() if n}
        assert took[rank] == max(took.values())
        assert lag_s == pytest.approx((max(took.values()) - statistics.median(took.values())) / 1e9)


# --- calls summed as they end, against measuring them all at once -------------------------------


def _all_at_once(start_ns: int, end_ns: int, calls: list[Call]) -> tuple[dict[Any, float], dict[str, Any]]:
    """The busy shares and stragglers as the step's anatomy computed them before calls were summed
    as they end: every call looked at when the step is measured."""
    wall_ns = end_ns - start_ns
    busy_ns: dict[Any, list[tuple[int, int]]] = {}
    size: dict[str, int] = {}
    by_phase: dict[str, dict[Any, list[tuple[int, int]]]] = {}
    for call in calls:
        lo, hi = max(call.start_ns, start_ns), min(call.end_ns, end_ns)
        if hi <= lo:
            continue
        key = (call.role, call.rank)
        busy_ns.setdefault(key, []).append((lo, hi))
        by_phase.setdefault(call.phase, {}).setdefault(key, []).append((lo, hi))
        if call.role is not None:
            size[call.role] = max(size.get(call.role, 0), call.ranks)

    def covered(spans: list[tuple[int, int]]) -> int:
        return len({t for lo, hi in spans for t in range(lo, hi)})

    busy = {}
    for role in size:
        ranks = {key: covered(spans) for key, spans in busy_ns.items() if key[0] == role}
        busy[role] = sum(ranks.values()) / max(size[role], len(ranks)) / wall_ns
    stragglers = {}
    for phase_name, per_rank in by_phase.items():
        if len(per_rank) < 2:
            continue
        took = {key: covered(spans) for key, spans in per_rank.items()}
        (_, rank), longest = max(took.items(), key=lambda item: (item[1], str(item[0][1])))
        stragglers[phase_name] = (rank, (longest - statistics.median(took.values())) / 1e9)
    return busy, stragglers


@st.composite
def calls_of_a_step(draw: Any) -> tuple[int, int, list[Call], int]:
    start = draw(st.integers(-3, 10))
    end = start + draw(st.integers(1, 60))
    call = st.tuples(
        st.sampled_from(["gen", "update_actor", "ref"]),
        st.sampled_from([("actor", 4), ("actor", 6), ("ref", 2), (None, 0)]),
        st.sampled_from([0, 1, 2, 3, "worker_3", "lane"]),
        st.integers(-10, end + 5),
        st.integers(0, 30),
    )
    calls = [Call(p, rank, s, s + d, role, ranks) for p, (role, ranks), rank, s, d in draw(st.lists(call, max_size=14))]
    split = draw(st.integers(0, len(calls)))  # the calls of a second root: those after it
    return start, end, calls, split


@given(calls_of_a_step())
@settings(max_examples=500, deadline=None)
def test_calls_summed_as_they_end_give_the_numbers_of_looking_at_every_call_at_the_end(
    step: tuple[int, int, list[Call], int],
) -> None:
    """Exactly: the busy shares, each phase's straggler rank (ties too) and its lag, with calls
    sticking out of the step, overlapping, of two roots, of lanes named as text."""
    start, end, calls, split = step
    anatomy = StepAnatomy()
    anatomy.phase_ended(1, Phase("gen", start, end))
    middle = (start + end) // 2
    for number, call in enumerate(calls):
        anatomy.call_ended(1 if number < split else 2, call)
    got = anatomy.step_ended(5, [StepTrace(1, start, middle), StepTrace(2, middle, end)])
    assert got is not None
    busy, stragglers = _all_at_once(start, end, calls)
    assert got.busy == busy
    assert got.stragglers == stragglers


def test_measuring_a_step_looks_at_no_rank_whose_calls_lie_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work on the training loop's path when a step is measured does not grow with the ranks:
    each call was summed when it ended; only a call sticking out of the step (here the last rank's
    result, seen after the step's end) is looked at again."""
    from otel_tracking.runtime import anatomy as module

    def looked_at(ranks: int) -> tuple[int, Any]:
        anatomy = StepAnatomy()
        anatomy.phase_ended(1, _phase("update_actor", 0, 100))
        for rank in range(ranks):
            anatomy.call_ended(1, Call("update_actor", rank, 1 * MS, (10 + rank % 7) * MS, "actor", ranks))
            anatomy.call_ended(1, Call("gen", rank, 20 * MS, 30 * MS, "rollout", ranks))
        anatomy.call_ended(1, Call("update_actor", ranks - 1, 40 * MS, 120 * MS, "actor", ranks))  # sticks out
        covered = module._covered
        counted = []
        monkeypatch.setattr(module, "_covered", lambda spans: counted.append(1) or covered(spans))
        try:
            got = anatomy.step_ended(3, [StepTrace(1, 0, 100 * MS)])
        finally:
            monkeypatch.setattr(module, "_covered", covered)
        return len(counted), got

    few, _ = looked_at(8)
    many, got_many = looked_at(1024)
    assert few == many <= 2, (few, many)
    assert got_many is not None and got_many.stragglers["update_actor"][0] == 1023
    actor_ms = sum(9 + rank % 7 for rank in range(1024)) + 60  # the last rank's second call: 40..100 ms
    assert got_many.busy == pytest.approx({"actor": actor_ms / 1024 / 100, "rollout": 0.1})


# --- a real script ---------------------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import time
    from concurrent.futures import ThreadPoolExecutor
    import contextvars
    from otel_tracking import Tracking, trace_state

    def lane(n):
        with trace_state("generate", state_lane_id=n):
            time.sleep(0.15 if n == 2 else 0.05)

    t = Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    with ThreadPoolExecutor(3) as pool:
        for step in (1, 2, 3):
            with trace_state("step"):
                with trace_state("rollout"):
                    for f in [pool.submit(contextvars.copy_context().run, lane, n) for n in range(3)]:
                        f.result()
                with trace_state("old_log_prob"):
                    time.sleep(0.05)
                time.sleep(0.05)  # in no phase
            t.log({"loss": 1.0 / step}, step)
    t.finish()
    """
)


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "TENSORBOARD_"))}
    clean.update(TENSORBOARD_DIR=str(tmp_path / "tb"), OTEL_TRACKING_SPOOL_DIR=str(tmp_path / "spool"), **env)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def _file_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "proj" / "exp.jsonl").read_text().splitlines()]


def test_a_script_that_asks_gets_each_steps_anatomy_in_every_tracker(tmp_path: Path) -> None:
    from otel_tracking.exporters.file import read_anatomy

    _run(tmp_path, OTEL_TRACKING_ANATOMY="1")
    # the metrics file keeps verl's one line per log(); the anatomy is in the events file
    assert _file_lines(tmp_path) == [{"step": s, "data": {"loss": 1.0 / s}} for s in (1, 2, 3)]
    anatomy = read_anatomy(tmp_path / "proj" / "exp.jsonl")
    assert sorted(anatomy) == [1, 2, 3], anatomy
    for got in anatomy.values():
        # rollout ~0.15 s productive, old_log_prob 0.05 s overhead, 0.05 s idle in each ~0.25 s step
        assert 0.45 <= got["anatomy/goodput"] <= 0.75, got
        assert 0.1 <= got["anatomy/overhead_frac"] <= 0.3, got
        assert got["anatomy/rollout/straggler_rank"] == 2, got  # lane 2 took 3x longer
        assert 0.07 <= got["anatomy/rollout/straggler_lag_s"] <= 0.2, got
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    shown = {e.step: e.value for e in accumulator.Scalars("anatomy/goodput")}
    assert shown == pytest.approx({s: d["anatomy/goodput"] for s, d in anatomy.items()}, abs=1e-6)
    lanes = {e.step: e.value for e in accumulator.Scalars("anatomy/rollout/straggler_rank")}
    assert lanes == {1: 2, 2: 2, 3: 2}


def test_a_plain_script_gets_no_line_it_did_not_ask_for(tmp_path: Path) -> None:
    from otel_tracking.exporters.file import read_anatomy

    _run(tmp_path)
    assert _file_lines(tmp_path) == [{"step": s, "data": {"loss": 1.0 / s}} for s in (1, 2, 3)]
    assert read_anatomy(tmp_path / "proj" / "exp.jsonl") == {}


def test_the_anatomy_goes_out_as_otlp_gauges_with_the_bucket_role_and_phase_as_attributes(tmp_path: Path) -> None:
    with HttpReceiver() as receiver:
        _run(
            tmp_path,
            OTEL_TRACKING_ANATOMY="1",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_METRIC_EXPORT_INTERVAL="200",
        )

        def points() -> dict[tuple[str, str], float] | None:
            found = {
                (name, next(iter(attrs.values()), "")): value
                for _, name, _, value, attrs in receiver.received.gauge_points()
                if name.startswith(("ml.step.share", "ml.phase.straggler"))
            }
            return found if ("ml.phase.straggler_rank", "rollout") in found else None

        found = wait_for(points, what="the anatomy's gauges")
    assert set(found) >= {
        ("ml.step.share", "productive"),
        ("ml.step.share", "overhead"),
        ("ml.step.share", "idle"),
        ("ml.phase.straggler_rank", "rollout"),
        ("ml.phase.straggler_lag", "rollout"),
    }
    assert found[("ml.phase.straggler_rank", "rollout")] == 2
    # not one metric name per key: the per-step path does not turn anatomy/* into gauges of their own
    names = {name for _, name, _, _, _ in receiver.received.gauge_points()}
    assert not any(name.startswith("anatomy") for name in names), names


# --- each step's anatomy at its own step, verl's lines left alone ------------------------------------


def _log_steps(tracking: Any, trace: Any) -> None:
    """Four steps; step 3 opens no phase (its log() is what ends step 2)."""
    for step in (1, 2, 3, 4):
        if step != 3:
            with trace("rollout"):
                pass
        tracking.log({"loss": 1.0 / step, "n": step}, step)


@pytest.mark.backend
def test_each_steps_anatomy_reaches_wandb_at_its_step_and_the_file_sink_stays_verls(
    isolated: Path,
    wandb_dir: Any,  # noqa: F811 - the fixture imported above
    seed: Any,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """wandb (offline, read back from its own run file) has every step's anatomy at that step,
    nothing refused; the file sink's metrics file and the console are byte for byte the
    reference's, and the file sink has the anatomy in its events file, one record per step."""
    from otel_tracking import Tracking, trace_state
    from otel_tracking.exporters.file import read_anatomy
    from tests.readers_wandb import only_run

    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    root = wandb_dir("ours")
    tracking = Tracking("proj", "exp", default_backend=["file", "console", "wandb"])
    _log_steps(tracking, trace_state)
    tracking.finish()
    said = capfd.readouterr()
    ours_out = [line for line in said.out.splitlines() if line.startswith("step:")]
    assert "not stored" not in said.err and "below the step" not in said.err, said.err
    stored = only_run(root).triples()
    assert sorted({s for k, s, _ in stored if k == "anatomy/goodput"}) == [1, 2, 4], stored
    assert [s for k, s, _ in stored if k == "loss"] == [1, 2, 3, 4]
    assert sorted(read_anatomy(isolated / "proj" / "exp.jsonl")) == [1, 2, 4]
    ours = (isolated / "proj" / "exp.jsonl").read_bytes()

    monkeypatch.chdir(isolated / "ours")
    reference = seed.Tracking("proj", "exp", default_backend=["file", "console"])
    _log_steps(reference, lambda name: contextlib.nullcontext())
    reference.finish()
    assert ours == (isolated / "ours" / "proj" / "exp.jsonl").read_bytes()
    assert ours_out == [line for line in capfd.readouterr().out.splitlines() if line.startswith("step:")]


@pytest.mark.backend
def test_a_step_logged_again_after_a_phase_has_one_anatomy_over_all_of_it(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Train values, an unlabelled ``validate``, the validation values at the same step: one
    trace for the step, ``validate`` under its one root, and one anatomy over all of it, not a
    second one for ``validate`` alone that replaces the first; TensorBoard (its own reader) and
    the timeline have validate at that step too."""
    from otel_tracking import Tracking, trace_state
    from tests.test_backend_tensorboard import read_events

    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    tracking = Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    for step in (1, 2):
        with trace_state("rollout"):
            pass
        tracking.log({"loss": 1.0 / step}, step)
        with trace_state("validate"):
            pass
        tracking.log({"val/score": 0.5}, step)
    tracking.finish()
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")
    assert [s for s, _ in scalars["anatomy/goodput"]] == [1, 2]
    # the validate phase's timing at the step it validated, as the anatomy and the timeline have it
    assert [s for s, _ in scalars["timing_s/state/validate"]] == [1, 2]
    events = [json.loads(line) for line in (isolated / "proj" / "exp.events.jsonl").read_text().splitlines()]
    measured = [e for e in events if e.get("event_name") == "ml.step.anatomy"]
    assert [e["attributes"]["ml.step"] for e in measured] == [1, 2], measured
    spans = [e for e in events if e["type"] == "span"]
    roots = [s for s in spans if s["name"] == "ml.step"]
    assert [r["attributes"]["ml.step"] for r in roots] == [1, 2]
    for root in roots:
        under = {s["name"]: s for s in spans if s["trace_id"] == root["trace_id"] and s is not root}
        assert sorted(under) == ["rollout", "validate"]
        assert {s["parent_span_id"] for s in under.values()} == {root["span_id"]}
        assert under["validate"]["attributes"]["ml.step"] == root["attributes"]["ml.step"]
        assert root["end_time_unix_nano"] >= under["validate"]["end_time_unix_nano"]
    # the timeline draws validate in the step it validated
    drawn = [(s.name, s.step) for s in read_spans([isolated / "proj" / "exp.events.jsonl"]) if s.name != "ml.step"]
    assert sorted(drawn) == [("rollout", 1), ("rollout", 2), ("validate", 1), ("validate", 2)]
    for record in measured:
        step = record["attributes"]["ml.step"]
        its_roots = [r for r in roots if r["attributes"]["ml.step"] == step]
        traces = {r["trace_id"] for r in its_roots}
        names = sorted(s["name"] for s in spans if s["trace_id"] in traces and s["name"] != "ml.step")
        assert names == ["rollout", "validate"]
        # covers all of it: from the root's start (the first step: its first phase) to its end, after validate
        first_start = min(
            s["start_time_unix_nano"] for s in spans if s["trace_id"] in traces and (step > 1 or s["name"] != "ml.step")
        )
        wall_s = (max(r["end_time_unix_nano"] for r in its_roots) - first_start) / 1e9
        assert record["body"]["anatomy/step_s"] == pytest.approx(wall_s, abs=1e-6)
        assert record["body"]["anatomy/goodput"] > 0 and record["body"]["anatomy/overhead_frac"] > 0


def _busy(at_least_ns: int) -> None:
    """Work (not a sleep) for at least ``at_least_ns``: the lane that does more is the straggler."""
    start = time.perf_counter_ns()
    while time.perf_counter_ns() - start < at_least_ns:
        pass


@pytest.mark.backend
def test_no_secret_in_a_phase_name_reaches_a_key_and_lanes_named_as_text_get_their_rank(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A phase named with a URL and its password: the anatomy's keys (TensorBoard, read back with
    its own reader; the file sink's files) carry it scrubbed, as the span's name is; lanes named
    ``worker_<n>`` get ``straggler_rank`` n."""
    from otel_tracking import Tracking, trace_state
    from otel_tracking.exporters.file import read_anatomy
    from tests.test_backend_tensorboard import read_events

    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    secret = "s3cr3t-pw-0042"
    phase = f"download https://alice:{secret}@db.example.com/shard"
    tracking = Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    for step in (1, 2):
        with trace_state(phase):
            for lane in range(3):
                with trace_state("fetch", state_lane_id=f"worker_{lane}"):
                    _busy(50_000_000 if lane == 1 else 1_000_000)  # far apart: a loaded machine cannot swap them
        tracking.log({"loss": 1.0 / step}, step)
    tracking.finish()
    scalars, _, _ = read_events(isolated / "tensorboard_log" / "proj" / "exp")
    assert not [key for key in scalars if secret in key], list(scalars)
    scrubbed = "anatomy/download https://<redacted>@db.example.com/shard"
    assert scalars[f"{scrubbed}/straggler_rank"] == [(1, 1.0), (2, 1.0)], list(scalars)
    assert f"{scrubbed}/straggler_lag_s" in scalars
    for path in (isolated / "proj").iterdir():
        assert secret not in path.read_text(), path
    assert read_anatomy(isolated / "proj" / "exp.jsonl")[2][f"{scrubbed}/straggler_rank"] == 1


@pytest.mark.backend
def test_a_step_whose_phase_outlives_the_next_log_is_measured_before_the_next_steps_values(
    isolated: Path,
    wandb_dir: Any,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread's phase of step 1 still runs when step 2 is logged: step 1's anatomy goes out then
    (what still runs counts for no step), before step 2's values, and not again when it ends."""
    import contextvars

    from otel_tracking import Tracking, trace_state
    from otel_tracking.exporters.file import read_anatomy
    from tests.readers_wandb import only_run

    monkeypatch.setenv("OTEL_TRACKING_ANATOMY", "1")
    root = wandb_dir("late")
    tracking = Tracking("proj", "exp", default_backend=["file", "wandb"])
    started, release = threading.Event(), threading.Event()

    def late() -> None:
        with trace_state("late_upload"):
            started.set()
            release.wait(timeout=60)

    with trace_state("rollout"):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(late,))
        thread.start()
        assert started.wait(timeout=60)
    tracking.log({"loss": 1.0}, 1)
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.5}, 2)
    release.set()
    thread.join(timeout=60)
    with trace_state("rollout"):
        pass
    tracking.log({"loss": 0.25}, 3)
    tracking.finish()
    stored = only_run(root).triples()
    assert sorted(s for k, s, _ in stored if k == "anatomy/goodput") == [1, 2, 3], stored
    assert sorted(read_anatomy(isolated / "proj" / "exp.jsonl")) == [1, 2, 3]
    events = (isolated / "proj" / "exp.events.jsonl").read_text()
    assert events.count('"event_name":"ml.step.anatomy"') == 3


def test_no_secret_in_a_phase_name_reaches_the_open_phase_gauges(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gauges of open phases (``ml.phase.open{ml.phase}``, for alerting on stuck phases) carry
    the phase's name scrubbed, as its span does."""
    from otel_tracking import Tracking, trace_state

    secret = "s3cr3t-pw-0043"
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
        tracking = Tracking("proj", "exp", default_backend=["file"])
        with trace_state(f"download https://alice:{secret}@db.example.com/shard"):

            def phases() -> list[str]:
                return [
                    str(attrs.get("ml.phase"))
                    for _, name, _, _, attrs in receiver.received.gauge_points()
                    if name == "ml.phase.open"
                ]

            shown = wait_for(phases, what="an ml.phase.open point")
        tracking.finish()
    assert shown and all(secret not in phase for phase in shown), shown
    assert "download https://<redacted>@db.example.com/shard" in shown
