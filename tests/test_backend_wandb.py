"""wandb and vemlp_wandb bridges against real wandb, offline, read back from the run's own files."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.readers_wandb import WandbRun, only_run

pytestmark = pytest.mark.backend

SECRETS = ("wandb-KEY-0123456789", "top-level-api-KEY-42", "VOLC-AK-abcdef", "VOLC-SK-fedcba")


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Points wandb at a fresh folder; wandb caches its settings per process, so tear its
    singleton down around each test, and undo the tensorboard patch sync_tensorboard leaves."""
    import wandb

    def point(name: str) -> Path:
        root = tmp_path / name
        for var, sub in (
            ("WANDB_DIR", ""),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_DATA_DIR", "data"),
            ("WANDB_CONFIG_DIR", "config"),
        ):
            (root / sub).mkdir(parents=True, exist_ok=True)
            monkeypatch.setenv(var, str(root / sub))
        if wandb.patched["tensorboard"]:
            wandb.tensorboard.unpatch()
        wandb.teardown()
        return root

    yield point
    if wandb.run is not None:
        wandb.run.finish()
    if wandb.patched["tensorboard"]:
        wandb.tensorboard.unpatch()
    wandb.teardown()


# --- one script of calls, fed to ours and to the reference -------------------------------------

CONFIG = {
    "trainer": {"project_name": "p", "wandb_api_key": SECRETS[0], "total_epochs": 2},
    "api_key": SECRETS[1],
    "actor": {"lr": 1e-6, "ppo_max_token_len_per_gpu": 16384},
}
REDACTED_CONFIG = {
    "trainer": {"project_name": "p", "wandb_api_key": "<redacted>", "total_epochs": 2},
    "api_key": "<redacted>",
    "actor": {"lr": 1e-6, "ppo_max_token_len_per_gpu": 16384},
}


def payload(step: int) -> dict[str, Any]:
    return {
        "train/loss": 1.0 / step,
        "train/acc@1": np.float32(0.1) * step,
        "critic/score/mean": np.float64(step * 0.25),
        "count": step * 7,
        "flag": step % 2 == 1,
        "nan_metric": math.nan if step == 2 else 0.5,
        "inf_metric": math.inf if step == 2 else -math.inf,
        "text": f"step {step}",
        "nothing": None,
        "a list": [1, 2.5, "x"],
        "nested": {"a": step, "b": "c"},
        "ключ with space": 0.125,
    }


def samples(step: int) -> list[tuple[Any, ...]]:
    return [(f"q{step}a", f"answer {step}a", 1.0), (f"q{step}b", f"answer {step}b", np.float32(0.5) * step)]


def script(
    tracking: Any,
    gen_logger: Any,
    dapo_logger: Any,
    backend: str,
    trace: Any = None,
    steps: tuple[int, ...] = (1, 2, 3),
) -> None:
    """The same calls for ours and for the reference (``trace`` only exists in ours)."""
    for step in steps:
        if trace is not None:
            # step= given: without it the core puts a span that starts before the run's first
            # log() at step 0 (not at the first logged step)
            with trace("rollout", step=step):
                time.sleep(0.02)
        tracking.log(payload(step), step=step)
        if step != steps[1]:
            gen_logger.log([backend], samples(step), step)
        dapo_logger.log([backend], {0: step, 1.0: 2 * step, 0.5: 1}, step)
    tracking.log({"train/loss": 99.0}, step=steps[1])  # backwards: wandb keeps steps monotonic


def expected_triples(steps: tuple[int, ...] = (1, 2, 3)) -> list[tuple[str, int, Any]]:
    """What wandb stores for ``payload``: numpy scalars as Python numbers, dicts as nested keys."""
    out = []
    for step in steps:
        for key, value in payload(step).items():
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            out.append((key, step, value))
    return out


def user_triples(run: WandbRun, drop: tuple[str, ...] = ()) -> dict[tuple[str, int], Any]:
    """(key, step) -> value for every stored value but tables and the given prefixes."""
    return {
        (key, step): value
        for key, step, value in run.triples()
        if not (isinstance(value, dict) and "_type" in value) and not key.startswith(drop)
    }


def same(a: Any, b: Any) -> bool:
    """Equal as stored: NaN equals NaN, a bool only equals a bool (wandb writes 1.0 as 1)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def assert_same(got: dict[Any, Any], want: dict[Any, Any]) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    bad = {k: (got[k], want[k]) for k in got if not same(got[k], want[k])}
    assert not bad, bad


def generation_tables(run: WandbRun) -> list[tuple[int, list[str], list[list[Any]]]]:
    return [(log["step"], log["columns"], log["table"]) for log in run.table_logs("val/generations")]


def expected_generation_tables(steps: tuple[int, ...] = (1, 2, 3)) -> list[tuple[int, list[str], list[list[Any]]]]:
    columns = ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    rows: list[list[Any]] = []
    out = []
    for step in steps:
        if step == steps[1]:
            continue
        rows = [*rows, [step] + [v.item() if isinstance(v, np.generic) else v for s in samples(step) for v in s]]
        out.append((step, columns, rows))
    return out


def reward_tables(run: WandbRun) -> list[tuple[int, list[str], list[list[Any]]]]:
    return [
        (log["step"], log["columns"], log["table"])
        for log in run.table_logs("training/filter_groups/filtered_reward_counts")
    ]


def metrics_data(step: int, scalars: dict[str, Any], others: dict[str, Any]) -> Any:
    """One log() call as the facade hands it to a sink."""
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.signals.steps import step_batch

    return step_batch(Resource({}), step, scalars, others, time.time_ns())


def ours() -> Any:
    from otel_tracking import Tracking, trace_state
    from otel_tracking.api.generations import DapoFilteredRewardTableLogger, ValidationGenerationsLogger

    return Tracking, trace_state, ValidationGenerationsLogger, DapoFilteredRewardTableLogger


# --- wandb through the facade ---------------------------------------------------------------------


def test_facade_metrics_spans_tables_config_secrets(
    wandb_dir: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    Tracking, trace_state, Gen, Dapo = ours()
    root = wandb_dir("ours")
    monkeypatch.setenv("WANDB_ENTITY", "my-team")
    tracking = Tracking("proj", "exp-1", default_backend=["wandb"], config=CONFIG)
    assert "wandb run at" in tracking.where()["wandb"]
    script(tracking, Gen(), Dapo(), "wandb", trace=trace_state)
    stats = tracking.finish(exit_code=3)
    # the backwards step is not sent (wandb would drop it): counted, not silent, and not retried
    assert "otel-tracking: wandb: 1 value(s) were not stored" in capfd.readouterr().err
    assert (stats["wandb"]["failed"], stats["wandb"]["dropped"], stats["wandb"]["spooled"]) == (0, 0, 0)

    run = only_run(root)
    assert (run.run.project, run.run.display_name, run.run.entity) == ("proj", "exp-1", "my-team")
    assert run.exit_code == 3
    assert run.config() == REDACTED_CONFIG

    stored = user_triples(run, drop=("timing_s/",))
    assert_same(stored, {(k, s): v for k, s, v in expected_triples()})

    timings = [(key, step, value) for key, step, value in run.triples() if key.startswith("timing_s/")]
    assert [(k, s) for k, s, _ in timings] == [("timing_s/state/rollout", s) for s in (1, 2, 3)]
    assert all(0.02 <= v < 5 for _, _, v in timings)

    # generations: the reference's layout; one INCREMENTAL log per validation step, each with only
    # its own row, whose union is the reference's whole table
    logs = run.table_logs("val/generations")
    assert [log["incremental"] for log in logs] == [True, True]
    assert [len(log["rows"]) for log in logs] == [1, 1]
    assert generation_tables(run) == expected_generation_tables()
    assert reward_tables(run) == [
        (s, ["step", "reward_counts"], [[t, f"0:{t}, 0.5:1, 1:{2 * t}"] for t in (1, 2, 3) if t <= s])
        for s in (1, 2, 3)
    ]

    everything = "\n".join(p.read_text("utf-8", "replace") for p in root.rglob("*") if p.is_file())
    for secret in SECRETS[:2]:
        assert secret not in everything


def test_differential_against_reference(wandb_dir: Any, seed: Any) -> None:
    """Same calls to the reference and to ours: wandb holds the same names, steps, values and rows.
    Documented differences: ours adds timing_s/state/* (spans), redacts secrets in the config, and
    logs the generations table incrementally (same rows)."""
    Tracking, trace_state, Gen, Dapo = ours()
    root = wandb_dir("ours")
    tracking = Tracking("proj", "exp", default_backend="wandb", config=CONFIG)
    script(tracking, Gen(), Dapo(), "wandb", trace=trace_state)
    tracking.finish()
    mine = only_run(root)

    root = wandb_dir("reference")
    reference = seed.Tracking("proj", "exp", default_backend="wandb", config=CONFIG)
    script(reference, seed.ValidationGenerationsLogger(), seed.DapoFilteredRewardTableLogger(), "wandb")
    reference.finish()
    theirs = only_run(root)

    assert_same(user_triples(mine, drop=("timing_s/",)), user_triples(theirs))
    assert {k for k, _, _ in mine.triples()} - {k for k, _, _ in theirs.triples()} == {"timing_s/state/rollout"}
    assert generation_tables(mine) == generation_tables(theirs)
    assert [log["incremental"] for log in theirs.table_logs("val/generations")] == [False, False]
    assert reward_tables(mine) == reward_tables(theirs)
    assert [r["_step"] for r in mine.rows] == [r["_step"] for r in theirs.rows]
    assert theirs.config() == CONFIG  # the reference sent the secrets to wandb
    assert mine.config() == REDACTED_CONFIG
    assert (mine.run.project, mine.run.display_name, mine.exit_code) == (
        theirs.run.project,
        theirs.run.display_name,
        theirs.exit_code,
    )


def test_config_none_no_trainer_proxy_and_odd_values(
    wandb_dir: Any, seed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    Tracking, _, Gen, _ = ours()
    from otel_tracking.exporters import wandb as bridge
    from otel_tracking.exporters._base import StepRecord, TrackerContext

    # config=None
    root = wandb_dir("none")
    tracking = Tracking("proj", "none", default_backend=["wandb"], config=None)
    tracking.log({"x": 1.5}, step=0)
    gen = Gen()
    gen.log(["wandb"], [("a", "b", 1)], 1)
    gen.log(["wandb"], [("a", "b", 1), ("c", "d", 2)], 2)  # sample count changes: a new table
    gen.log(["wandb"], [("short", "row"), ("e", "f", 3, "extra")], 3)  # padded / cut to 3
    tracking.finish(exit_code=2)
    run = only_run(root)
    assert run.config() == {}
    assert run.exit_code == 2
    assert_same(user_triples(run), {("x", 0): 1.5})
    assert generation_tables(run) == [
        (1, ["step", "input_1", "output_1", "score_1"], [[1, "a", "b", 1]]),
        (
            2,
            ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"],
            [[2, "a", "b", 1, "c", "d", 2]],
        ),
        (
            3,
            ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"],
            [[2, "a", "b", 1, "c", "d", 2], [3, "short", "row", None, "e", "f", 3]],
        ),
    ]

    # a config without a "trainer" section (the reference raised KeyError), and wandb_proxy
    root = wandb_dir("no-trainer")
    with pytest.raises(KeyError):
        seed.Tracking("proj", "no-trainer", default_backend="wandb", config={"lr": 0.1})
    tracking = Tracking("proj", "no-trainer", default_backend=["wandb"], config={"lr": 0.1})
    tracking.log({"x": 1}, step=1)
    tracking.finish()
    run = only_run(root)
    assert run.config() == {"lr": 0.1}
    assert_same(user_triples(run), {("x", 1): 1})

    # wandb uses the proxy as given, credentials and all; what it records has them redacted
    root = wandb_dir("proxy")
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")  # to look at the run's settings here
    proxy = "http://proxyuser:pr0xy-pw@127.0.0.1:9"
    tracking = Tracking("proj", "proxy", default_backend=["wandb"], config={"trainer": {"wandb_proxy": proxy}})
    assert tracking.logger["wandb"].metrics.session.run.settings.https_proxy == proxy
    tracking.finish()
    assert only_run(root).config() == {"trainer": {"wandb_proxy": "http://<redacted>@127.0.0.1:9"}}

    # the bridge alone: one value wandb refuses does not lose the others of its step, and is not a
    # failure (a retry could not help); a spool header's resume reattaches to the same run id
    root = wandb_dir("direct")
    parts = bridge.open_tracker(TrackerContext(project="proj", experiment="direct", env=dict(os.environ)))
    result = parts.metrics.export(metrics_data(step=4, scalars={"ok": 2.0}, others={"bad": "x"}))
    assert result.name == "SUCCESS"
    parts.metrics.write(StepRecord(step=5, scalars={"ok": 3.0}, others={"bad": object()}))
    assert parts.metrics.session.skipped == 1
    parts.finish(0)
    first = only_run(root)
    assert_same(user_triples(first), {("ok", 4): 2.0, ("bad", 4): "x", ("ok", 5): 3.0})
    assert parts.resume == {"id": first.run.run_id, "project": "proj", "entity": None}

    root = wandb_dir("resumed")
    context = TrackerContext(project="ignored", experiment="direct", env=dict(os.environ), resume=parts.resume)
    again = bridge.open_tracker(context)
    again.metrics.write(StepRecord(step=6, scalars={"ok": 4.0}))
    again.finish(0)
    resumed = only_run(root)
    assert (resumed.run.run_id, resumed.run.project) == (first.run.run_id, "proj")
    assert_same(user_triples(resumed), {("ok", 6): 4.0})


def test_plain_otel_sdk_setup_shares_one_run(wandb_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exporters built with no arguments, as an OTel SDK builds them from entry points."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_tracking.exporters.wandb import WandbLogExporter, WandbMetricExporter, WandbSpanExporter

    root = wandb_dir("sdk")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "ml.project=sdk-proj,ml.experiment=sdk-exp")
    metrics, spans, logs = WandbMetricExporter(), WandbSpanExporter(), WandbLogExporter()
    assert metrics.session is spans.session is logs.session
    reader = PeriodicExportingMetricReader(metrics, export_interval_millis=3_600_000)
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(SimpleLogRecordProcessor(logs))

    meter = meter_provider.get_meter("app")
    step_gauge, loss = meter.create_gauge("train.step"), meter.create_gauge("train/loss")
    tracer = tracer_provider.get_tracer("app")
    for step in (1, 2, 3):
        with tracer.start_as_current_span("update", attributes={"ml.step": step}):
            time.sleep(0.01)
        step_gauge.set(step)
        loss.set(step / 10)
        assert meter_provider.force_flush()
    logger_provider.get_logger("app").emit(
        event_name="ml.validation.generations",
        body={"samples": [["in", "out", 0.5]]},
        attributes={"ml.step": 3, "ml.key": "val/generations"},
    )
    for provider in (meter_provider, tracer_provider, logger_provider):
        provider.shutdown()

    run = only_run(root)
    assert (run.run.project, run.run.display_name, run.exit_code) == ("sdk-proj", "sdk-exp", 0)
    stored = user_triples(run)
    assert {k: v for k, v in stored.items() if k[0] == "train/loss"} == {
        ("train/loss", 1): 0.1,
        ("train/loss", 2): 0.2,
        ("train/loss", 3): pytest.approx(0.3),
    }
    assert sorted(k for k in stored if k[0].startswith("timing_s/")) == [
        ("timing_s/state/update", s) for s in (1, 2, 3)
    ]
    assert generation_tables(run) == [(3, ["step", "input_1", "output_1", "score_1"], [[3, "in", "out", 0.5]])]


def test_bridges_import_no_tracker() -> None:
    code = (
        "import sys, otel_tracking, otel_tracking.exporters.wandb, otel_tracking.exporters.vemlp_wandb; "
        "bad = [m for m in ('wandb', 'volcengine_ml_platform') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- vemlp_wandb: the platform module is a stand-in whose .wandb is the real wandb ---------------


class PlatformStandIn(types.ModuleType):
    """``volcengine_ml_platform`` as the bridge sees it: ``init(ak, sk, region)`` is recorded,
    ``.wandb`` is the real wandb module, so the data lands in a real offline wandb run."""

    def __init__(self) -> None:
        import wandb

        super().__init__("volcengine_ml_platform")
        self.calls: list[dict[str, Any]] = []
        self.wandb = wandb

    def init(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> PlatformStandIn:
    stand_in = PlatformStandIn()
    monkeypatch.setitem(sys.modules, "volcengine_ml_platform", stand_in)
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")  # the stand-in lives in this process
    monkeypatch.setenv("VOLC_ACCESS_KEY_ID", SECRETS[2])
    monkeypatch.setenv("VOLC_SECRET_ACCESS_KEY", SECRETS[3])
    monkeypatch.setenv("MLP_TRACKING_REGION", "cn-beijing")
    return stand_in


def test_vemlp_wandb_facade_and_differential(wandb_dir: Any, platform: PlatformStandIn, seed: Any) -> None:
    Tracking, trace_state, Gen, Dapo = ours()
    config = {**CONFIG, "volc": {"VOLC_SECRET_ACCESS_KEY": SECRETS[3]}}
    root = wandb_dir("ours")
    tracking = Tracking("proj", "vemlp", default_backend=["vemlp_wandb"], config=config)
    assert platform.calls == [{"ak": SECRETS[2], "sk": SECRETS[3], "region": "cn-beijing"}]
    script(tracking, Gen(), Dapo(), "vemlp_wandb", trace=trace_state, steps=(10, 20, 30))
    tracking.finish(exit_code=1)
    mine = only_run(root)
    import wandb

    wandb.tensorboard.unpatch()  # wandb.init(sync_tensorboard=True) patched tensorboard's writer

    assert (mine.run.project, mine.run.display_name, mine.exit_code) == ("proj", "vemlp", 1)
    assert mine.config() == {**REDACTED_CONFIG, "volc": {"VOLC_SECRET_ACCESS_KEY": "<redacted>"}}
    assert any(
        r.telemetry.feature.tensorboard_sync
        for r in mine.records
        if r.WhichOneof("record_type") == "run" or r.WhichOneof("record_type") == "telemetry"
    )
    everything = "\n".join(p.read_text("utf-8", "replace") for p in root.rglob("*") if p.is_file())
    for secret in SECRETS:
        assert secret not in everything
    # the DAPO table is wandb-only in the reference, and here
    assert reward_tables(mine) == []

    # with sync_tensorboard=True real wandb ignores explicit steps: each log() call becomes a row of
    # its own, numbered 0, 1, 2, ...  (the reference gets the same; see the comparison below)
    def plain(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not k.startswith("_")}

    contents = [plain(row) for row in mine.rows]
    timing_rows = [row for row in contents if set(row) == {"timing_s/state/rollout"}]
    assert len(timing_rows) == 3 and all(0.02 <= row["timing_s/state/rollout"] < 5 for row in timing_rows)
    contents = [row for row in contents if row not in timing_rows]
    assert len(contents) == 6
    for row, step in zip((contents[0], contents[2], contents[3]), (10, 20, 30), strict=True):
        assert_same(row, {k: v for k, s, v in expected_triples((10, 20, 30)) if s == step})
    assert [set(contents[i]) for i in (1, 4)] == [{"val/generations"}, {"val/generations"}]
    assert contents[5] == {"train/loss": 99}  # the "backwards" step is not dropped: steps are ignored
    assert [rows for _, _, rows in generation_tables(mine)] == [
        rows for _, _, rows in expected_generation_tables((10, 20, 30))
    ]

    root = wandb_dir("reference")
    platform.calls.clear()
    reference = seed.Tracking("proj", "vemlp", default_backend="vemlp_wandb", config=config)
    assert platform.calls == [{"ak": SECRETS[2], "sk": SECRETS[3], "region": "cn-beijing"}]
    script(
        reference,
        seed.ValidationGenerationsLogger(),
        seed.DapoFilteredRewardTableLogger(),
        "vemlp_wandb",
        steps=(10, 20, 30),
    )
    reference.finish(exit_code=1)
    theirs = only_run(root)
    theirs_contents = [plain(row) for row in theirs.rows]
    assert len(theirs_contents) == len(contents)
    for got, want in zip(contents, theirs_contents, strict=True):
        if "val/generations" in want:
            assert set(got) == set(want) == {"val/generations"}
        else:
            assert_same(got, want)
    assert [rows for _, _, rows in generation_tables(mine)] == [rows for _, _, rows in generation_tables(theirs)]
    assert reward_tables(theirs) == []
    assert theirs.config()["volc"] == {"VOLC_SECRET_ACCESS_KEY": SECRETS[3]}  # the reference leaked it


def test_vemlp_wandb_open_bridge_injection_and_errors(
    wandb_dir: Any, platform: PlatformStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from otel_tracking import Tracking
    from otel_tracking.config.settings import ConfigError
    from otel_tracking.exporters import vemlp_wandb
    from otel_tracking.exporters._base import StepRecord, TrackerContext

    root = wandb_dir("injected")
    injected = PlatformStandIn()
    context = TrackerContext(project="proj", experiment="inj", config=None, env=dict(os.environ))
    parts = vemlp_wandb.open_tracker(context, platform_module=injected)
    assert injected.calls == [{"ak": SECRETS[2], "sk": SECRETS[3], "region": "cn-beijing"}]
    assert platform.calls == []  # the injected module, not the imported one
    parts.metrics.write(StepRecord(step=0, scalars={"loss": 0.5}))
    assert parts.finish is not None
    parts.finish(0)
    run = only_run(root)
    assert (run.run.project, run.run.display_name) == ("proj", "inj")
    assert_same(user_triples(run), {("loss", 0): 0.5})
    import wandb

    wandb.tensorboard.unpatch()

    # exporters built with no arguments (OTel entry points) share one run opened from the environment
    root = wandb_dir("no-args")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "svc")
    metrics, logs = vemlp_wandb.VemlpWandbMetricExporter(), vemlp_wandb.VemlpWandbLogExporter()
    assert metrics.session is logs.session and len(platform.calls) == 1
    metrics.write(StepRecord(step=0, scalars={"loss": 0.25}))
    metrics.shutdown()
    assert not logs.session.finished  # the log exporter still uses the run
    logs.shutdown()
    run = only_run(root)
    assert (run.run.project, run.run.display_name) == ("svc", "run")
    assert_same(user_triples(run), {("loss", 0): 0.25})
    wandb.tensorboard.unpatch()
    platform.calls.clear()

    # a missing variable: a clear error, and the platform is not initialised
    monkeypatch.delenv("VOLC_SECRET_ACCESS_KEY")
    with pytest.raises(ConfigError, match="VOLC_SECRET_ACCESS_KEY"):
        Tracking("proj", "x", default_backend=["vemlp_wandb"])
    assert platform.calls == []

    # no volcengine_ml_platform installed: the error names the package
    monkeypatch.delitem(sys.modules, "volcengine_ml_platform")
    with pytest.raises(ConfigError, match="volcengine_ml_platform"):
        Tracking("proj", "x", default_backend=["vemlp_wandb"])


def _console(run: WandbRun) -> str:
    """What wandb captured of the console: its output records (the run's Logs tab)."""
    lines = [r for r in run.records if r.WhichOneof("record_type") in ("output", "output_raw")]
    return "".join(getattr(r, r.WhichOneof("record_type")).line for r in lines)


@pytest.mark.parametrize("console", [None, "wrap"])
def test_wandb_in_the_bridge_process_does_not_capture_the_other_trackers(
    console: str | None, wandb_dir: Any, trackio_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trackers share the bridge process, so wandb's console capture recorded Trackio's
    "* Trackio project initialized ..." lines as the run's Logs, and never a line of the training
    script.  There it is off, unless WANDB_CONSOLE asks for it."""
    Tracking, *_ = ours()
    root = wandb_dir("console")
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if console is not None:
        monkeypatch.setenv("WANDB_CONSOLE", console)
    # Trackio opens beside wandb (either may print first) and finishes before it: its "Run finished"
    # line comes while wandb's capture, when on, is sure to be on.
    tracking = Tracking(f"proj-{tmp_path.name}", "exp", default_backend=["trackio", "wandb"])
    tracking.log({"loss": 0.5}, step=1)
    tracking.finish()
    captured = _console(only_run(root))
    if console is None:
        assert captured == ""
    else:  # asked for: wandb captures the bridge process's console, the other trackers included
        assert "Run finished. Uploading logs to Trackio" in captured
