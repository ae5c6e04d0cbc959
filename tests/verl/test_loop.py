"""verl, unchanged: a verl-shaped training loop on a real Ray cluster, switched off and on each
of the three ways, its spans read back from a real OTLP endpoint.

Each run is a Ray job of its own (``run_loop.py`` in a fresh driver process, connected to this
module's cluster), so that a switched-off run has no trace of us, in its driver or its workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.otlp_receiver import HttpReceiver, wait_for

HERE = Path(__file__).resolve().parent
STEPS = 2
PHASES = ("step", "gen", "old_log_prob", "ref", "update_actor")
# DistProfiler's (and the async method's) spans, per step and rank, and the driver phase above them.
WORKER_SPANS = {
    "actor_generate": ("gen", "actor"),
    "actor_compute_log_prob": ("old_log_prob", "actor"),
    "ref_compute_ref_log_prob": ("ref", "ref"),
    "actor_update": ("update_actor", "actor"),
    "actor_shard": ("update_actor", "actor"),
}
BANNER = "otel-tracking: verl instrumented"


@pytest.fixture()
def receiver() -> Iterator[HttpReceiver]:
    with HttpReceiver() as r:
        yield r


def run_loop(
    cluster: str,
    tmp: Path,
    *,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
    args: tuple[str, ...] = (),
    pythonpath: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """One run of the loop as its own job; what it computed, its file sink and its stderr."""
    tmp.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VERL_", "RAY_ADDRESS"))}
    clean.update(
        # the code under test (this checkout's), also where the venv's install is another one
        PYTHONPATH=os.pathsep.join(str(p) for p in (*pythonpath, HERE, HERE.parent.parent)),
        VERL_FILE_LOGGER_PATH=str(tmp / "metrics.jsonl"),
        OTEL_TRACKING_SPOOL_DIR=str(tmp / "spool"),
        **(env or {}),
    )
    out = tmp / "result.json"
    command = [*prefix, sys.executable, str(HERE / "run_loop.py"), "--address", cluster, "--out", str(out)]
    done = subprocess.run(
        [*command, "--steps", str(STEPS), *args], env=clean, cwd=tmp, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    result["file"] = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    result["stderr"] = done.stderr
    return result


@pytest.fixture(scope="module")
def off(cluster: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Switched off: verl exactly as it is (the receiver is configured, and gets nothing)."""
    with HttpReceiver() as r:
        result = run_loop(cluster, tmp_path_factory.mktemp("off"), env={"OTEL_EXPORTER_OTLP_ENDPOINT": r.endpoint})
        result["spans"] = r.received.spans()
    return result


def without_timings(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file sink's lines with the timing values blanked (wall time differs between runs); the
    step anatomy (switched on only) is no line of its own: verl's one line per step either way."""
    return [
        {"step": line["step"], "data": {k: (None if k.startswith("timing_s/") else v) for k, v in line["data"].items()}}
        for line in lines
    ]


def expected_counts() -> Counter[str]:
    counts: Counter[str] = Counter({"ml.step": STEPS})
    counts.update({name: STEPS for name in PHASES})
    counts.update({name: 2 * STEPS for name in WORKER_SPANS})  # two ranks
    return counts


def arrived_spans(receiver: HttpReceiver) -> list[dict[str, Any]]:
    want = expected_counts()

    def complete() -> list[dict[str, Any]] | None:
        spans = receiver.received.spans()
        got = Counter(s["name"] for s in spans)
        return spans if all(got[name] >= count for name, count in want.items()) else None

    return wait_for(complete, timeout_s=120, what=f"spans {dict(want)}")


def assert_span_tree(spans: list[dict[str, Any]], run_id: str) -> None:
    by_id = {s["span_id"]: s for s in spans}
    roots = {s["trace_id"]: s for s in spans if s["name"] == "ml.step" and s["parent_span_id"] is None}
    traced = [s for s in spans if s["name"] in (*PHASES, *WORKER_SPANS)]
    # One trace per step: every phase and worker span belongs to the trace of one step's root.
    steps_seen = Counter(roots[s["trace_id"]]["attributes"]["ml.step"] for s in traced)
    assert sorted(steps_seen) == list(range(1, STEPS + 1)), steps_seen
    assert set(steps_seen.values()) == {len(PHASES) + 2 * len(WORKER_SPANS)}
    assert not any(s["name"] == "per_sample" for s in spans), "simple_timer opens spans only when asked"
    for span in traced:
        root = roots[span["trace_id"]]
        parent = by_id[span["parent_span_id"]]
        assert span["resource"]["ml.run.id"] == run_id, span  # the run identity on every span
        if span["name"] == "step":
            assert parent is root
        elif span["name"] in PHASES:
            assert parent["name"] == "step" and parent["trace_id"] == root["trace_id"]
        else:
            phase, role = WORKER_SPANS[span["name"]]
            assert parent["name"] == phase, (span["name"], parent["name"])
            rank = span["resource"]["ml.rank"]
            assert span["attributes"]["ml.lane"] == f"rank_{rank}"
            assert span["resource"]["ml.role"] == role
            assert span["resource"]["process.pid"] != parent["resource"]["process.pid"]
    ranks = Counter((s["name"], s["resource"]["ml.rank"]) for s in traced if s["name"] in WORKER_SPANS)
    assert ranks == {(name, rank): STEPS for name in WORKER_SPANS for rank in (0, 1)}


def assert_same_training(on: dict[str, Any], off: dict[str, Any]) -> None:
    assert on["results"] == off["results"]
    assert without_timings(on["file"]) == without_timings(off["file"])
    timing_keys = {k for line in on["file"] for k in line["data"] if k.startswith("timing_s/")}
    assert timing_keys == {f"timing_s/{name}" for name in (*PHASES, "per_sample")}


def test_switched_off_is_verl_as_it_is(off: dict[str, Any]) -> None:
    assert off["tracking"] == "verl.utils.tracking" and off["run_id"] is None and off["installed_by"] is None
    assert off["spans"] == []
    assert BANNER not in off["stderr"]
    assert [line["step"] for line in off["file"]] == list(range(1, STEPS + 1))


def test_plugin_switch(cluster: str, tmp_path: Path, receiver: HttpReceiver, off: dict[str, Any]) -> None:
    on = run_loop(cluster, tmp_path, env={"OTEL_TRACKING_VERL": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
    assert on["tracking"] == "otel_tracking.api.facade" and on["installed_by"] == "OTEL_TRACKING_VERL=1"
    assert on["stderr"].count(BANNER) == 1 and "(OTEL_TRACKING_VERL=1)" in on["stderr"]
    assert "could not instrument" not in on["stderr"]
    assert_same_training(on, off)
    assert_span_tree(arrived_spans(receiver), on["run_id"])


def test_opentelemetry_instrument(cluster: str, tmp_path: Path, receiver: HttpReceiver, off: dict[str, Any]) -> None:
    instrument = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert instrument is not None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
    on = run_loop(cluster, tmp_path, env=env, prefix=(instrument,))
    assert on["tracking"] == "otel_tracking.api.facade" and on["installed_by"] == "opentelemetry-instrument"
    assert_same_training(on, off)
    assert_span_tree(arrived_spans(receiver), on["run_id"])


def test_opentelemetry_instrument_disabled(cluster: str, tmp_path: Path, off: dict[str, Any]) -> None:
    instrument = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert instrument is not None
    env = {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "verl", "OTEL_TRACES_EXPORTER": "none"}
    result = run_loop(cluster, tmp_path, env=env, prefix=(instrument,))
    assert result["tracking"] == "verl.utils.tracking" and result["installed_by"] is None
    assert BANNER not in result["stderr"]


def test_ray_worker_setup_hook(cluster: str, tmp_path: Path, receiver: HttpReceiver, off: dict[str, Any]) -> None:
    """``ray job submit`` style: the driver is untouched, the trainer runs in a TaskRunner actor."""
    on = run_loop(
        cluster,
        tmp_path,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint},
        args=("--in-actor", "--setup-hook"),
    )
    assert on["tracking"] == "otel_tracking.api.facade" and on["installed_by"] == "worker_process_setup_hook"
    assert_same_training(on, off)
    assert_span_tree(arrived_spans(receiver), on["run_id"])


def test_ray_started_before_the_switch_still_trains(cluster: str, tmp_path: Path, off: dict[str, Any]) -> None:
    """``ray.init`` before ``import verl``: the job's workers are not instrumented (the runtime_env
    merge came too late), so the driver sends them no keyword they do not know: training runs as
    verl's, and one warning says why the calls carry no context."""
    on = run_loop(cluster, tmp_path, env={"OTEL_TRACKING_VERL": "1"}, args=("--ray-first",))
    assert on["tracking"] == "otel_tracking.api.facade"
    assert on["results"] == off["results"]
    assert on["stderr"].count("this Ray job's workers are not instrumented") == 1


def test_future_verl_lacking_a_patched_name(
    cluster: str, tmp_path: Path, receiver: HttpReceiver, off: dict[str, Any]
) -> None:
    """A stand-in for a later verl that renamed ``_timer``: one warning names it, training runs,
    and the rest (the facade, the worker spans) still works."""
    import verl

    future = tmp_path / "future"
    shutil.copytree(Path(verl.__file__).parent, future / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    profiler = future / "verl" / "utils" / "profiler"
    for name in ("performance.py", "nvtx_profile.py", "mstx_profile.py"):
        path = profiler / name
        path.write_text(re.sub(r"\b_timer\b", "_timed_block", path.read_text()))
    on = run_loop(
        cluster,
        tmp_path / "run",
        env={"OTEL_TRACKING_VERL": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint},
        pythonpath=(future,),
    )
    warnings = [line for line in on["stderr"].splitlines() if "could not instrument" in line]
    # One warning per process: the driver's own line, and one from each worker (Ray prefixes
    # those with "(ActorWorker pid=...)", in colour).
    own = [line for line in warnings if not re.sub(r"\x1b\[[0-9;]*m", "", line).startswith("(")]
    assert len(own) == 1, warnings
    assert all("could not instrument verl.utils.profiler.performance._timer (" in line for line in warnings)
    assert on["results"] == off["results"]
    assert without_timings(on["file"]) == without_timings(off["file"])

    def workers_arrived() -> Counter[str] | None:
        got = Counter(s["name"] for s in receiver.received.spans())
        return got if all(got[name] == 2 * STEPS for name in WORKER_SPANS) else None

    names = wait_for(workers_arrived, timeout_s=120, what="the worker spans")
    assert not any(names[phase] for phase in PHASES), "no marked_timer spans: that part is left as verl has it"
