"""The MLflow bridge against a real MLflow tracking store (sqlite, offline), read back with MlflowClient.

One sqlite database per module (a new one costs ~4 s of migrations); each test uses experiments of
its own, with their artifact location under the test's tmp dir.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import readers_mlflow as readers

from otel_tracking import Tracking, ValidationGenerationsLogger, trace_state

pytestmark = pytest.mark.backend

FLOAT_MAX = 1.7976931348623157e308  # what MLflow's SQL store keeps for +inf


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One migrated sqlite store for the module."""
    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{path}"
    readers.client(uri).search_experiments()  # runs the migrations once
    return uri


class Store:
    def __init__(self, uri: str, tmp: Path, prefix: str) -> None:
        self.uri = uri
        self.tmp = tmp
        self.prefix = prefix
        self.client = readers.client(uri)

    def experiment(self, suffix: str = "") -> tuple[str, str]:
        """(name, id) of a new experiment, artifacts under the test's tmp dir."""
        name = f"{self.prefix}{suffix}"
        return name, readers.make_experiment(self.client, name, self.tmp / "artifacts" / (suffix or "main"))

    def run(self, experiment_id: str) -> Any:
        return readers.only_run(self.client, experiment_id)

    def triples(self, run_id: str) -> list[tuple[str, int, Any]]:
        return readers.metric_triples(self.client, run_id)


@pytest.fixture
def store(mlflow_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db)
    return Store(mlflow_db, tmp_path, request.node.name.replace("[", "-").replace("]", ""))


@pytest.fixture
def bridge(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    from otel_tracking.exporters import mlflow as module

    monkeypatch.setattr(module, "INIT_RETRY_SLEEP_S", 0.01)
    return module


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = 2


@dataclasses.dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])


def rich_config() -> dict[str, Any]:
    return {
        "trainer": {"total_steps": 10, "project_name": "p", "logger": ["console", "mlflow"], "api_key": "sk-secret"},
        "data": {"path": Path("/data/train.parquet"), "mode": Mode.FAST, "empty": {}, "none": None},
        "optim": dataclasses.asdict(Optim()),
        "layers": [{"width": 64}, {"width": 32, "act": "gelu"}, 7],
        "top": 1.5,
        "flag": True,
        "tuple": (1, 2),
    }


# --- pure functions against the reference --------------------------------------------------------


def test_params_flatten_like_the_reference(seed: ModuleType, bridge: ModuleType) -> None:
    configs: list[Any] = [
        rich_config(),
        {"a": {}},
        {"a": {"b": {}}, "c": 1},
        {1: 2, "n": {3: 4}},
        {"a/b": 2, "a": {"b": 1}},
        {"a": {"b": 1}, "a/b": 2},
        {"l": [], "s": {1, 2}, "f": float("nan")},
        [1, {"x": [2, 3]}],
        Optim(),
        {"opt": Optim(), "modes": [Mode.SLOW, Mode.FAST]},
        {"": {"x": 1}, "/lead": {"y": 2}},
        {},
        None,
    ]
    for config in configs:
        expected = seed._compute_mlflow_params_from_objects(config)
        ours = bridge.flatten_params(config)
        # What log_params stores: str(key) -> str(value).
        assert {str(k): str(v) for k, v in ours.items()} == {str(k): str(v) for k, v in expected.items()}, config
        assert [str(k) for k in ours] == [str(k) for k in expected], config


def test_metric_keys_sanitized_like_the_reference(seed: ModuleType, bridge: ModuleType) -> None:
    adapter = seed._MlflowLoggingAdapter()
    keys = [
        "loss",
        "val/acc@1",
        "a//b///c",
        "weird key!",
        "x:y.z-w",
        "unicodé/ключ",
        "tab\tnew\nline",
        "@@//@",
        "percent%/brackets[0]",
        "/lead",
        "trail/",
        "",
    ]
    for key in keys:
        assert bridge.sanitize_key(key) == adapter._sanitize_key(key), key


# --- through the facade ----------------------------------------------------------------------------


def test_facade_metrics_params_generations(store: Store, seed: ModuleType, tmp_path: Path) -> None:
    name, experiment_id = store.experiment()
    config = rich_config()
    tracking = Tracking(name, "exp-a", default_backend=["mlflow"], config=config)
    tracking.log({"train/loss": 1.5, "val/acc@1": 0.25, "n": 3, "flag": True}, step=1)
    tracking.log({"train/loss": 0.75}, step=2)
    tracking.log({"train/loss": 0.5, "sometimes": -1.0}, step=10)
    samples = [["what is 1+1?", "2", 1.0], ["capital of France?", "Lyon", 0.0], ["ünïcode ✓", "ok", 0.5]]
    ValidationGenerationsLogger().log(["mlflow"], samples, 10)
    ValidationGenerationsLogger().log(["wandb"], [["not", "for", 0.0]], 11)  # mlflow not named: nothing
    stats = tracking.finish()
    assert stats["mlflow"]["failed"] == 0, stats

    run = store.run(experiment_id)
    assert run.info.run_name == "exp-a"
    assert run.data.tags["mlflow.runName"] == "exp-a"
    assert run.info.status == "FINISHED" and run.info.end_time is not None
    assert store.triples(run.info.run_id) == [
        ("flag", 1, 1.0),
        ("n", 1, 3.0),
        ("sometimes", 10, -1.0),
        ("train/loss", 1, 1.5),
        ("train/loss", 2, 0.75),
        ("train/loss", 10, 0.5),
        ("val/acc_at_1", 1, 0.25),
    ]
    # Params: the reference's flattening, str()-ed; the secret redacted.
    expected = {str(k): str(v) for k, v in seed._compute_mlflow_params_from_objects(config).items()}
    expected["trainer/api_key"] = "<redacted>"
    assert run.data.params == expected
    assert "sk-secret" not in json.dumps(run.data.params)

    names = [a.path for a in store.client.list_artifacts(run.info.run_id)]
    assert names == ["val_step10.json"]
    stored = readers.artifact_bytes(store.client, run.info.run_id, "val_step10.json", tmp_path / "dl")
    rows = [{"input": i, "output": o, "score": s} for i, o, s in samples]
    assert json.loads(stored) == rows
    assert stored == json.dumps(rows).encode()  # byte-for-byte what the reference's json.dump writes


def test_differential_against_reference(store: Store, seed: ModuleType, tmp_path: Path) -> None:
    import mlflow

    ref_name, ref_experiment = store.experiment("-ref")
    our_name, our_experiment = store.experiment("-ours")
    config = rich_config()
    calls: list[tuple[dict[str, Any], int]] = [
        ({"loss": 0.5, "acc@1": 0.9, "a//b": 1, "weird key!": 2, "flag": True, "n": 3, "big": 10**12}, 1),
        ({"loss": float("nan"), "up": float("inf"), "down": float("-inf")}, 2),
        ({"loss": 0.25, "note": "a string"}, 3),  # the reference loses this whole step
        ({"loss": 0.125, "k" * 251: 1.0}, 4),  # and this one (a key longer than MLflow's 250)
        ({"loss": 0.0625, "-0": -0.0}, 5),
    ]
    samples = [["q1", "a1", 1.0], ["q2", "a2", 0]]

    reference = seed.Tracking(ref_name, "exp", default_backend="mlflow", config=config)
    try:
        assert "mlflow" in reference.logger, "the reference could not open its MLflow run"
        for data, step in calls:
            reference.log(data, step)
        seed.ValidationGenerationsLogger().log(["mlflow"], samples, 5)
        reference.finish()

        # Ours runs while the reference's fluent run is still active: no global state is shared.
        ours = Tracking(our_name, "exp", default_backend=["mlflow"], config=config)
        for data, step in calls:
            ours.log(data, step)
        ValidationGenerationsLogger().log(["mlflow"], samples, 5)
        ours.finish()

        ref_run, our_run = store.run(ref_experiment), store.run(our_experiment)
        ref_triples, our_triples = store.triples(ref_run.info.run_id), store.triples(our_run.info.run_id)
        fixed = [("loss", 3, 0.25), ("loss", 4, 0.125)]  # the steps the reference lost whole
        assert not [t for t in ref_triples if t[1] in (3, 4)]
        assert our_triples == sorted([*ref_triples, *fixed], key=lambda t: (t[0], t[1], str(t[2])))
        assert ("down", 2, -FLOAT_MAX) in our_triples and ("up", 2, FLOAT_MAX) in our_triples
        assert ("loss", 2, "nan") in our_triples

        # Params: identical except the secret the reference leaked.
        assert ref_run.data.params["trainer/api_key"] == "sk-secret"
        assert our_run.data.params == {**ref_run.data.params, "trainer/api_key": "<redacted>"}
        # Tags as MLflow's fluent start_run sets them (user, source, run name).
        assert our_run.data.tags == ref_run.data.tags
        assert our_run.info.run_name == ref_run.info.run_name == "exp"

        ref_art = readers.artifact_bytes(store.client, ref_run.info.run_id, "val_step5.json", tmp_path / "ref")
        our_art = readers.artifact_bytes(store.client, our_run.info.run_id, "val_step5.json", tmp_path / "ours")
        assert our_art == ref_art

        # Ours is ended at finish() (the seed left its run RUNNING; verl 0.9 from PyPI ends it too).
        assert our_run.info.status == "FINISHED"
    finally:
        mlflow.end_run()  # the reference's fluent run would otherwise stay active in this process


def test_spans_become_timing_metrics_and_traces(store: Store) -> None:
    name, experiment_id = store.experiment()
    tracking = Tracking(name, "traced", default_backend=["mlflow"])
    tracking.log({"loss": 1.0}, step=1)
    with trace_state("step", state_lane_id=0):
        with trace_state("gen@rollout", model="actor"):
            time.sleep(0.002)
        with trace_state("update"):
            time.sleep(0.001)
    tracking.log({"loss": 0.5}, step=2)
    with trace_state("eval", step=7):
        pass
    tracking.finish()

    run = store.run(experiment_id)
    found = readers.traces(store.client, experiment_id)
    assert len(found) == 2
    # One trace per step: the driver's step span is the root, the phases hang under it.

    def under_root(trace: Any) -> str:
        root_id = next(s.span_id for s in trace.data.spans if s.parent_id is None)
        return next(s.name for s in trace.data.spans if s.parent_id == root_id)

    by_first = {under_root(t): t for t in found}
    assert set(by_first) == {"step", "eval"}
    spans = {s.name: s for s in by_first["step"].data.spans}
    # the driver's ml.step root is named after its step in MLflow's copy (its trace's top row)
    assert set(spans) == {"step 2", "step", "gen@rollout", "update"}
    assert spans["step"].parent_id == spans["step 2"].span_id and spans["step 2"].parent_id is None
    root = spans["step"]
    assert spans["gen@rollout"].parent_id == root.span_id and spans["update"].parent_id == root.span_id
    assert root.attributes["ml.lane"] == 0 and root.attributes["ml.step"] == 2
    assert spans["gen@rollout"].attributes["ml.label.model"] == "actor"
    assert by_first["step"].info.state.value == "OK"
    # Both traces are linked to the run.
    assert {t.info.trace_id for t in readers.traces(store.client, experiment_id, run.info.run_id)} == {
        t.info.trace_id for t in found
    }

    all_spans = {s.name: s for t in found for s in t.data.spans}

    def seconds(span_name: str) -> float:
        span = all_spans[span_name]
        return (span.end_time_ns - span.start_time_ns) / 1e9

    assert store.triples(run.info.run_id) == [
        ("loss", 1, 1.0),
        ("loss", 2, 0.5),
        ("timing_s/state/eval", 7, seconds("eval")),
        ("timing_s/state/gen_at_rollout", 2, seconds("gen@rollout")),
        ("timing_s/state/step", 2, seconds("step")),
        ("timing_s/state/update", 2, seconds("update")),
    ]
    assert seconds("gen@rollout") >= 0.002


def test_nonzero_exit_code_marks_the_run_failed(store: Store) -> None:
    name, experiment_id = store.experiment("-explicit")
    tracking = Tracking(name, "crashed", default_backend=["mlflow"])
    tracking.log({"loss": 1.0}, step=1)
    tracking.finish(exit_code=1)
    tracking.finish(exit_code=0)  # idempotent: stays FAILED
    run = store.run(experiment_id)
    assert run.info.status == "FAILED" and run.info.end_time is not None

    name, experiment_id = store.experiment("-with")
    with pytest.raises(RuntimeError), Tracking(name, "raised", default_backend=["mlflow"]) as tracking:
        tracking.log({"loss": 2.0}, step=1)
        raise RuntimeError("boom")
    run = store.run(experiment_id)
    assert run.info.status == "FAILED"
    assert store.triples(run.info.run_id) == [("loss", 1, 2.0)]


def test_unreachable_tracking_uri_proceeds_without_mlflow(
    bridge: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MLflow's three init attempts (5 s apart in the bridge process) all fail: within the start
    window the run goes on without MLflow, as the reference; after it, MLflow counts as a tracker
    that failed to open in the background: its data is spooled, with a warning."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{readers.closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", "60")
    started = time.monotonic()
    tracking = Tracking("unreachable", "run", default_backend=["mlflow", "file"])
    tracking.log({"loss": 1.0}, step=1)
    assert "not reachable" in tracking.where()["mlflow"]
    stats = tracking.finish()
    assert time.monotonic() - started < 30
    # the bridge process's warnings, on the same stderr
    messages = capfd.readouterr().err.splitlines()
    attempts = [m for m in messages if m.startswith("MLflow initialization attempt")]
    assert [m.split(" failed")[0] for m in attempts] == [f"MLflow initialization attempt {i}/3" for i in (1, 2, 3)]
    assert "All MLflow initialization attempts failed. Proceeding without MLflow tracking." in messages
    assert stats["mlflow"]["failed"] == 0
    # The rest of the run went on.
    lines = Path("unreachable/run.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "data": {"loss": 1.0}}

    # The default window (5 s) ends before the attempts do: MLflow opens in the background, then
    # fails; what was logged for it is spooled and counted.
    monkeypatch.delenv("OTEL_TRACKING_START_TIMEOUT")
    tracking = Tracking("unreachable", "late", default_backend=["mlflow", "file"])
    assert tracking.where()["mlflow"] == "opening in the otel-tracking bridge process"
    tracking.log({"loss": 1.0}, step=1)
    stats = tracking.finish()
    assert stats["mlflow"] == {"delivered": 0, "failed": 0, "retried": 0, "spooled": 1, "dropped": 0}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(w.startswith("otel-tracking: mlflow still opening after 5 s") for w in warnings), warnings
    assert any(w.startswith("otel-tracking: mlflow did not open") and "not reachable" in w for w in warnings)


def test_retry_sleep_between_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three attempts, the configured sleep between them (5 s by default, as the reference)."""
    from otel_tracking.exporters import mlflow as bridge
    from otel_tracking.exporters._base import TrackerContext

    assert bridge.INIT_ATTEMPTS == 3 and bridge.INIT_RETRY_SLEEP_S == 5.0
    sleeps: list[float] = []
    monkeypatch.setattr(bridge.time, "sleep", sleeps.append)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    context = TrackerContext("p", "e", env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{readers.closed_port()}"})
    assert bridge.MlflowSession.open(context) is None
    assert sleeps == [5.0, 5.0]
    sleeps.clear()
    monkeypatch.setattr(bridge, "INIT_RETRY_SLEEP_S", 0.01)
    assert bridge.MlflowSession.open(context) is None
    assert sleeps == [0.01, 0.01]
    sleeps.clear()
    assert bridge.MlflowSession.open(context, attempts=2, retry_sleep_s=0.5) is None
    assert sleeps == [0.5]


def test_bad_values_cost_only_themselves(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    name, experiment_id = store.experiment()
    config = {"ok": 1, "lr@warmup": 0.1, "trail/": {"x": 1}, "k" * 300: 2}
    tracking = Tracking(name, "bad", default_backend=["mlflow"], config=config)
    tracking.log(
        {
            "good": 1.0,
            "s": "text",
            "none": None,
            "k" * 260: 2.0,
            "ends/": 3.0,
            "a/./b": 4.0,
            "nan": float("nan"),
            "inf": float("inf"),
            "ninf": float("-inf"),
            "i": 7,
            "b": False,
        },
        step=3,
    )
    tracking.log({"good": 2.0, "k" * 260: 5.0}, step=4)  # a key refused once is skipped without asking again
    stats = tracking.finish()
    assert stats["mlflow"]["failed"] == 0
    run = store.run(experiment_id)
    assert store.triples(run.info.run_id) == [
        ("b", 3, 0.0),
        ("good", 3, 1.0),
        ("good", 4, 2.0),
        ("i", 3, 7.0),
        ("inf", 3, FLOAT_MAX),
        ("nan", 3, "nan"),
        ("ninf", 3, -FLOAT_MAX),
    ]
    # Params: an invalid name sanitized like a metric key, the unfixable ones skipped, the rest kept.
    assert run.data.params == {"ok": "1", "lr_at_warmup": "0.1", "trail/x": "1"}
    assert run.info.status == "FINISHED"


def test_attach_to_existing_run(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _, experiment_id = store.experiment()
    existing = store.client.create_run(experiment_id, run_name="platform-made")
    store.client.set_terminated(existing.info.run_id, "KILLED")
    monkeypatch.setenv("MLFLOW_RUN_ID", existing.info.run_id)
    tracking = Tracking("ignored-project", "ignored-name", default_backend=["mlflow"], config={"x": 1})
    tracking.log({"loss": 1.0}, step=1)
    # Delivered means opened: on a loaded machine MLflow may open after Tracking()'s start window.
    assert tracking.flush(timeout_s=120)
    assert store.client.get_run(existing.info.run_id).info.status == "RUNNING"
    tracking.finish()
    run = store.run(experiment_id)
    assert run.info.run_id == existing.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params == {"x": "1"}
    assert store.triples(run.info.run_id) == [("loss", 1, 1.0)]
    assert store.client.get_experiment_by_name("ignored-project") is None


@pytest.mark.parametrize("bridge_process", ["false", "true"])  # two sessions in one process, and through the child
def test_two_runs_in_threads_do_not_collide(store: Store, bridge_process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference's fluent API allows one active run per process; the bridge keeps explicit ids."""
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", bridge_process)
    runs = []
    for suffix in ("-a", "-b"):
        name, experiment_id = store.experiment(suffix)
        runs.append((Tracking(name, "run" + suffix, default_backend=["mlflow"]), experiment_id))

    def feed(tracking: Tracking, offset: float) -> None:
        for step in range(20):
            tracking.log({"v": step + offset}, step=step)

    threads = [threading.Thread(target=feed, args=(t, i * 0.5)) for i, (t, _) in enumerate(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for index, (tracking, experiment_id) in enumerate(runs):
        tracking.finish()
        run = store.run(experiment_id)
        assert store.triples(run.info.run_id) == [("v", step, step + index * 0.5) for step in range(20)]
        assert run.info.status == "FINISHED"


# --- through a plain OpenTelemetry SDK setup ---------------------------------------------------------


@pytest.fixture
def sdk_env(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Store, str]]:
    name, experiment_id = store.experiment()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"ml.project={name},ml.experiment=sdk-run")
    yield store, experiment_id


def test_plain_otel_sdk(sdk_env: tuple[Store, str], tmp_path: Path) -> None:
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_tracking.exporters.mlflow import MlflowLogExporter, MlflowMetricExporter, MlflowSpanExporter

    store, experiment_id = sdk_env
    metric_exporter, span_exporter, log_exporter = MlflowMetricExporter(), MlflowSpanExporter(), MlflowLogExporter()
    assert metric_exporter.session is span_exporter.session is log_exporter.session is not None

    meter_provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(metric_exporter, export_interval_millis=3_600_000)],
        shutdown_on_exit=False,
    )
    meter = meter_provider.get_meter("app")
    step_gauge, loss, rare = meter.create_gauge("train.step"), meter.create_gauge("loss"), meter.create_gauge("rare")
    step_gauge.set(7)
    loss.set(0.5)
    rare.set(9.0)
    meter_provider.force_flush()
    step_gauge.set(8)
    loss.set(0.25)  # the SDK itself drops NaN gauge values (DESIGN.md); the facade path keeps them
    meter_provider.force_flush()

    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    tracer = tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("rollout", attributes={"ml.step": 8}):
        with tracer.start_as_current_span("generate", attributes={"ml.step": 8}):
            pass

    logger_provider = LoggerProvider(shutdown_on_exit=False)
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(log_exporter))
    logger_provider.get_logger("app").emit(
        event_name="ml.validation.generations", body={"samples": [["in", "out", 1]]}, attributes={"ml.step": 8}
    )

    run = store.run(experiment_id)
    assert run.info.run_name == "sdk-run" and run.info.status == "RUNNING"
    meter_provider.shutdown()
    tracer_provider.shutdown()
    assert store.run(experiment_id).info.status == "RUNNING"  # the log exporter still holds the run
    logger_provider.shutdown()
    run = store.run(experiment_id)
    assert run.info.status == "FINISHED"

    triples = store.triples(run.info.run_id)
    spans = {s.name: s for t in readers.traces(store.client, experiment_id) for s in t.data.spans}
    assert spans["generate"].parent_id == spans["rollout"].span_id
    duration = {n: (s.end_time_ns - s.start_time_ns) / 1e9 for n, s in spans.items()}
    assert triples == [
        ("loss", 7, 0.5),
        ("loss", 8, 0.25),
        ("rare", 7, 9.0),  # DELTA: not repeated at step 8
        ("timing_s/state/generate", 8, duration["generate"]),
        ("timing_s/state/rollout", 8, duration["rollout"]),
    ]
    assert readers.artifact_json(store.client, run.info.run_id, "val_step8.json", tmp_path / "dl") == [
        {"input": "in", "output": "out", "score": 1}
    ]
    assert not math.isnan(duration["rollout"])


def test_replay_into_an_unreachable_mlflow_keeps_the_file_and_says_so(isolated: Path) -> None:
    import os
    import subprocess
    import sys

    from opentelemetry.sdk.resources import Resource

    from otel_tracking.delivery.spool import Spool
    from otel_tracking.signals.steps import step_batch
    from tests.conftest import free_port

    path = isolated / "spool" / "proj" / "exp-r1" / "mlflow.jsonl"
    header = {"sink": "mlflow", "project": "proj", "experiment": "exp", "run_id": "r1", "resume": {"run_id": "abc"}}
    spool = Spool(path, header)
    spool.write("metrics", step_batch(Resource({}), 1, {"loss": 0.5}, {}, 0))
    spool.close()
    before = path.read_bytes()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 75, "left for a later replay"
    assert f"{path}: not replayed (the backend did not open); kept for the next replay" in done.stderr
    assert "AttributeError" not in done.stderr
    assert path.read_bytes() == before


def test_each_step_is_one_value_per_timing_key_and_a_trace_named_after_its_step(store: Store) -> None:
    """Four lanes of ``generate`` in a step: one ``timing_s/state/generate`` per step (MLflow keeps
    every point, so four would draw a sawtooth), plus ``.../slowest``.  Each step's trace is named
    ``step N``, tagged ``ml.step``, and its previews say the step and its metrics (loss first)."""
    import contextvars

    name, experiment_id = store.experiment()
    tracking = Tracking(name, "lanes", default_backend=["mlflow"])
    for step in (1, 2):
        with trace_state("rollout", step=step):
            workers = [
                threading.Thread(target=contextvars.copy_context().run, args=(_lane, lane, step)) for lane in range(4)
            ]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        metrics = {"timing_s/reward": 0.25, "perf/throughput": 100.0 * step, "actor/pg_loss": -0.5 * step}
        tracking.log(metrics, step=step)
    tracking.finish()
    # the link the end-of-run summary prints opens the training view, not the GenAI one
    assert (
        f"in MLflow's UI: (mlflow ui) #/experiments/{experiment_id}?workflowType=machine_learning"
        in (tracking.where()["mlflow"])
    )

    run = store.run(experiment_id)
    found = readers.traces(store.client, experiment_id)
    assert sorted(t.info.tags["mlflow.traceName"] for t in found) == ["step 1", "step 2"]
    for trace in found:
        step = int(trace.info.tags["ml.step"])
        assert trace.info.tags["mlflow.traceName"] == f"step {step}"
        assert [s.name for s in trace.data.spans if s.parent_id is None] == [f"step {step}"]
        assert json.loads(trace.info.request_preview) == {"step": step}
        assert list(json.loads(trace.info.response_preview).items()) == [
            ("actor/pg_loss", -0.5 * step),  # the headline metric first (a phase time is not one)
            ("timing_s/reward", 0.25),
            ("perf/throughput", 100.0 * step),
        ]
        lanes = [s for s in trace.data.spans if s.name == "generate"]
        assert len(lanes) == 4  # each lane's span is still in the trace
        wall = (max(s.end_time_ns for s in lanes) - min(s.start_time_ns for s in lanes)) / 1e9
        slowest = max(s.end_time_ns - s.start_time_ns for s in lanes) / 1e9
        history = {
            key: [(m.step, m.value) for m in store.client.get_metric_history(run.info.run_id, key) if m.step == step]
            for key in ("timing_s/state/generate", "timing_s/state/generate/slowest", "timing_s/state/rollout")
        }
        assert history["timing_s/state/generate"] == [(step, pytest.approx(wall))]
        assert history["timing_s/state/generate/slowest"] == [(step, pytest.approx(slowest))]
        assert len(history["timing_s/state/rollout"]) == 1


def _lane(lane: int, step: int) -> None:
    with trace_state("generate", state_lane_id=lane, step=step):
        time.sleep(0.001 * (lane + 1))


def test_an_unknown_scheme_names_the_schemes_mlflow_knows(bridge: ModuleType) -> None:
    assert bridge.tracking_uri_problem("notascheme:/x") == (
        "has the scheme 'notascheme', for which MLflow has no tracking store (it knows http, https, "
        "databricks, postgresql, mysql, sqlite, mssql, and those of plugins)"
    )


@pytest.mark.parametrize("bridge_process", ["true", "false"])
@pytest.mark.parametrize("window_s", ["60", "0.5"])
def test_every_step_logged_for_an_unreachable_mlflow_is_spooled_counted_and_replayed(
    isolated: Path,
    bridge: ModuleType,
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    bridge_process: str,
    window_s: str,
) -> None:
    """MLflow does not answer at open, within the start window (60 s) or after it (0.5 s): the run
    goes on without it, as the reference's did, and every step logged for it, before and after it
    gave up, is spooled and counted (it took none of them and was summed as 0 spooled before).
    Replayed once MLflow is there, every (key, step, value) lands."""
    import os
    import subprocess
    import sys

    from otlp_receiver import wait_for

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{readers.closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("OTEL_TRACKING_START_TIMEOUT", window_s)
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", bridge_process)
    name, experiment_id = store.experiment()
    tracking = Tracking(name, "unreachable", default_backend=["mlflow"])
    logged = [("loss", step, step / 10) for step in range(10)]
    for key, step, value in logged[:5]:
        tracking.log({key: value}, step=step)
    wait_for(lambda: "not reachable" in tracking.where()["mlflow"], timeout_s=60, what="MLflow to give up")
    for key, step, value in logged[5:]:  # after it gave up
        tracking.log({key: value}, step=step)
    stats = tracking.finish()
    assert stats["mlflow"]["spooled"] == 10 and stats["mlflow"]["dropped"] == 0, stats["mlflow"]

    done = subprocess.run(
        [sys.executable, "-m", "otel_tracking", "replay", str(isolated / "spool")],
        env={**os.environ, "MLFLOW_TRACKING_URI": store.uri},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert store.triples(store.run(experiment_id).info.run_id) == logged
