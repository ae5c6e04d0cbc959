"""The documented conversion rules, the instrument naming rule, and configuration errors."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from otel_tracking import ConfigError, Tracking
from otel_tracking.config.settings import build_settings
from otel_tracking.signals.redact import REDACTED, is_secret_key, redact_config
from otel_tracking.signals.values import InstrumentNames, to_number, to_step

SDK_NAME = re.compile(r"[a-zA-Z][-_./a-zA-Z0-9]{0,254}")  # opentelemetry-api 1.45's instrument name rule


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (True, True),
        (0.5, 0.5),
        (np.float64(0.5), 0.5),
        (np.int32(-4), -4),
        (np.bool_(True), True),
        (np.array(2.5), 2.5),
        (Fraction(1, 4), 0.25),
        (2**64, float(2**64)),
        ("1.0", None),
        (None, None),
        ([1.0], None),
        (np.array([1.0]), None),
        (1j, None),
        ({"a": 1}, None),
    ],
)
def test_to_number(value, expected) -> None:
    got = to_number(value)
    assert got == expected and type(got) is type(expected)


def test_non_finite_numbers_are_kept() -> None:
    assert math.isnan(to_number(np.float32("nan")))
    assert to_number(float("-inf")) == float("-inf")


@pytest.mark.parametrize(
    ("step", "expected"),
    [(3, 3), (np.int64(3), 3), (3.0, 3), (np.float64(4.0), 4), (-1, -1), (True, 1), (False, 0), (2**63 - 1, 2**63 - 1)],
)
def test_steps(step, expected) -> None:
    got = to_step(step)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("step", [None, "1", 1.5, float("nan"), float("inf"), [1]])
def test_bad_steps(step) -> None:
    with pytest.raises(TypeError, match="step must be an integer"):
        to_step(step)


@pytest.mark.parametrize("step", [2**70, 2**63, -(2**63) - 1, np.uint64(2**63 + 5), float(2**70)])
def test_steps_beyond_64_bits_are_refused(step) -> None:
    with pytest.raises(TypeError, match="step must fit in a signed 64-bit integer"):
        to_step(step)


def test_instrument_name_rule() -> None:
    names = InstrumentNames()
    cases = {
        "train/loss": "train/loss",
        "val-core/openai/gsm8k/reward/mean@4": "val-core/openai/gsm8k/reward/mean_at_4",
        "timing s/gen (ms)": "timing_s/gen__ms_",
        "0_first": "m_0_first",
        "": "m_",
        "schätzung": "sch_tzung",
        "_private": "m__private",
        "x" * 300: "x" * 255,
    }
    for key, expected in cases.items():
        assert names(key) == expected
        assert SDK_NAME.fullmatch(names(key))
    # Collisions: a different key that maps to a taken name gets a suffix; the same key keeps its name.
    assert names("a b") == "a_b"
    assert names("a_b") == "a_b_2"
    assert names("a?b") == "a_b_3"
    assert names("a b") == "a_b"
    assert names("y" * 300) == "y" * 255
    assert names("y" * 301) == "y" * 253 + "_2"


def test_secret_keys() -> None:
    for key in [
        "api_key",
        "WANDB_API_KEY",
        "hf_token",
        "token",
        "password",
        "db.password",
        "secret",
        "VOLC_SECRET_ACCESS_KEY",
        "VOLC_ACCESS_KEY_ID",
        "client_secret",
        "Authorization",
    ]:
        assert is_secret_key(key), key
    for key in ["ppo_max_token_len_per_gpu", "max_new_tokens", "tokenizer", "secretary_count", "task", "lr"]:
        assert not is_secret_key(key), key
    config = {"trainer": {"wandb_api_key": "abc", "logger": ["wandb"]}, "list": [{"token": "t"}], "lr": 1e-6}
    assert redact_config(config) == {
        "trainer": {"wandb_api_key": REDACTED, "logger": ["wandb"]},
        "list": [{"token": REDACTED}],
        "lr": 1e-6,
    }
    assert config["trainer"]["wandb_api_key"] == "abc", "the caller's config is not modified"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "soon", "OTEL_METRIC_EXPORT_INTERVAL='soon' is not a number"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "-5", "must be positive"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "inf", "OTEL_METRIC_EXPORT_INTERVAL='inf' must be positive and finite"),
        ("OTEL_METRIC_EXPORT_INTERVAL", "nan", "OTEL_METRIC_EXPORT_INTERVAL='nan' must be positive and finite"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317", "must be an http:// or https:// URL"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:99999", "malformed port"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "ftp://x", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "authorization", "OTEL_EXPORTER_OTLP_HEADERS has an entry without"),
        ("OTEL_RESOURCE_ATTRIBUTES", "=x", "OTEL_RESOURCE_ATTRIBUTES has an entry without"),
        ("OTEL_METRICS_EXPORTER", "none,otlp", "'none' cannot be combined"),
        ("OTEL_TRACES_EXPORTER", "zipkin_json_nope", "neither one of our backends"),
        ("OTEL_TRACKING_START_TIMEOUT", "soon", "OTEL_TRACKING_START_TIMEOUT='soon' is not a number"),
        ("OTEL_TRACKING_START_TIMEOUT", "-1", "OTEL_TRACKING_START_TIMEOUT='-1' must be at least 0"),
        # issue 19, item 15: values that were accepted in silence
        ("OTEL_TRACKING_RESUME", "atuo", "OTEL_TRACKING_RESUME='atuo' is neither 'auto' nor 'never'"),
        ("OTEL_TRACKING_RESUME", "Nevr", "OTEL_TRACKING_RESUME='Nevr' is neither"),
        ("OTEL_TRACKING_RESUME", "autoo", "OTEL_TRACKING_RESUME='autoo' is neither"),
        ("RANK", "zero", "RANK='zero' is not an integer"),
        ("OTEL_TRACKING_RUN_ID", "", "OTEL_TRACKING_RUN_ID is set but empty"),
        ("OTEL_TRACKING_RUN_ID", "  ", "OTEL_TRACKING_RUN_ID is set but empty"),
        ("OTEL_TRACKING_RUN_ID", "../../etc", "OTEL_TRACKING_RUN_ID='../../etc' is not a run id"),
        ("OTEL_TRACKING_RUN_ID", "..", "OTEL_TRACKING_RUN_ID='..' is not a run id"),
    ],
)
def test_bad_configuration_is_one_clear_error_at_construction(monkeypatch, variable, value, message) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Tracking("p", "e", default_backend="console")


def test_header_values_never_appear_in_errors(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "api-key=supersecret,broken")
    with pytest.raises(ConfigError) as caught:
        Tracking("p", "e", default_backend="console")
    assert "supersecret" not in str(caught.value)


def test_otlp_selection_rules() -> None:
    s = build_settings("p", "e", (), env={})
    assert not s.otlp.any, "no endpoint and no OTEL_*_EXPORTER: no OTLP (nothing to send to)"
    s = build_settings("p", "e", (), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert s.otlp.traces and s.otlp.metrics and s.otlp.logs
    s = build_settings("p", "e", (), env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", "OTEL_LOGS_EXPORTER": "none"})
    assert s.otlp.traces and not s.otlp.logs
    s = build_settings("p", "e", (), env={"OTEL_TRACES_EXPORTER": "otlp,file"})
    assert s.otlp.traces and not s.otlp.metrics and s.extra_span_exporters == ("file",)
    s = build_settings(
        "p",
        "e",
        (),
        env={
            "OTEL_SDK_DISABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1",
            "OTEL_METRICS_EXPORTER": "otlp,file",
        },
    )
    assert not s.otlp.any and s.extra_metric_exporters == ()
    s = build_settings("p", "e", (), env={"OTEL_SERVICE_NAME": "svc", "OTEL_METRIC_EXPORT_INTERVAL": "250"})
    assert s.service_name == "svc" and s.otlp.metric_interval_s == 0.25
    assert build_settings("proj", "e", (), env={}).service_name == "proj"


def test_sdk_disabled_keeps_the_named_backends(isolated, monkeypatch) -> None:
    """OTEL_SDK_DISABLED=true turns off OTLP only: the named backends still get metrics, spans
    and events (the SDK's own providers would hand out no-op tracers)."""
    from otel_tracking import ValidationGenerationsLogger, trace_state

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracking = Tracking("proj", "exp", default_backend="file")
    with trace_state("rollout"):
        pass
    ValidationGenerationsLogger().log(["file"], [["q", "a", 1.0]], 1)
    tracking.log({"x": 1}, 1)
    stats = tracking.finish()
    assert set(stats) == {"file"}
    assert (isolated / "proj" / "exp.jsonl").read_text() == '{"step":1,"data":{"x":1}}\n'
    events = [json.loads(line) for line in (isolated / "proj" / "exp.events.jsonl").read_text().splitlines()]
    names = sorted(e.get("name") or e.get("event_name") for e in events)
    assert names == ["ml.step", "ml.validation.generations", "rollout"]


def test_sdk_disabled_follows_the_sdk_rule_only_true_disables() -> None:
    for raw, disabled in (("true", True), (" TRUE ", True), ("1", False), ("yes", False), ("maybe", False)):
        assert build_settings("p", "e", (), env={"OTEL_SDK_DISABLED": raw}).sdk_disabled is disabled, raw


def test_a_step_record_is_what_an_exporter_decodes_from_the_metrics_data() -> None:
    """The facade hands its step exporters StepBatch.record() instead of MetricsData: the two paths
    must give the same record."""
    from opentelemetry.sdk.resources import Resource

    from otel_tracking.exporters.console import ConsoleMetricExporter
    from otel_tracking.signals.steps import StepBatch

    cases = [
        ({"a/b": 1.0, "c@4": float("inf"), "flag": True, "n": 3}, {}),
        ({}, {"text": "x", "none": None, "arr": np.array([1.5, 2.5]), "t": (1, 2), "obj": object}),
        ({"only": -0.0}, {"nested": {"k": [np.float32(0.5)]}}),
    ]
    for scalars, others in cases:
        batch = StepBatch(Resource({"service.name": "s"}), 7, scalars, others, 123)
        (decoded,) = ConsoleMetricExporter().records(batch.metrics_data())
        assert batch.record() == decoded


def test_the_resource_is_what_any_otel_app_has_plus_the_run_identity(isolated, monkeypatch) -> None:
    """Resource.create: telemetry.sdk.* and the standard detectors; our identity wins; keys that
    look secret are dropped (issue 12)."""
    from importlib.metadata import version

    from otel_tracking.config.resource import build_resource

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=rl,ml.project=not-this,api_key=s3cret")
    settings = build_settings("proj", "exp", ())
    attributes = dict(build_resource(settings).attributes)
    assert attributes["telemetry.sdk.name"] == "opentelemetry"
    assert attributes["telemetry.sdk.language"] == "python"
    assert attributes["telemetry.sdk.version"] == version("opentelemetry-sdk")
    assert "telemetry.auto.version" not in attributes
    assert attributes["team"] == "rl" and attributes["ml.project"] == "proj"
    assert "api_key" not in attributes and "s3cret" not in repr(attributes)


def test_a_runs_resource_is_hashed_once_however_many_spans_are_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OTLP encoders group every span by ``hash(resource)``, which the SDK works out by dumping
    the attributes to JSON: a run's resource does it once, and still hashes and compares as the
    SDK's resource with the same attributes does (one resource in the request)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from otel_tracking.config.resource import build_resource

    resource = build_resource(build_settings("proj", "exp", ()))
    same = Resource(dict(resource.attributes), resource.schema_url)
    assert hash(resource) == hash(same) and resource == same
    tracer = TracerProvider(resource=resource).get_tracer("test")
    spans = []
    for i in range(100):
        span = tracer.start_span(f"phase{i % 3}")
        span.end()
        spans.append(span)
    dumps = []
    sdk_hash = Resource.__hash__
    monkeypatch.setattr(Resource, "__hash__", lambda self: dumps.append(1) or sdk_hash(self))
    encoded = encode_spans(spans)
    assert len(encoded.resource_spans) == 1 and len(encoded.resource_spans[0].scope_spans[0].spans) == 100
    assert len(dumps) <= 1, len(dumps)


# Every numeric variable the runtime reads (settings.py), and those of the SDK's OTLP exporters
# that the configuration reference lists.
NUMERIC_VARIABLES = [
    "OTEL_TRACKING_FINISH_TIMEOUT",
    "OTEL_TRACKING_START_TIMEOUT",
    "OTEL_TRACKING_QUEUE_SIZE",
    "OTEL_TRACKING_MAX_ATTEMPTS",
    "OTEL_TRACKING_PROBE_INTERVAL",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT",
    "OTEL_TRACKING_RESUME_STEP",
    "OTEL_TRACKING_STALL_AFTER",
    "OTEL_TRACKING_STALL_FLOOR",
    "OTEL_TRACKING_SPOOL_MAX_MB",
]


@pytest.mark.parametrize("variable", NUMERIC_VARIABLES)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity", "1e999"])
def test_a_numeric_variable_that_is_not_finite_is_a_config_error_at_construction(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """``OTEL_TRACKING_FINISH_TIMEOUT=inf`` passed, then ``finish()`` raised ``OverflowError`` into
    user code and the bridge process crashed; ``QUEUE_SIZE=inf`` raised it at ``Tracking()``."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        Tracking("proj", "exp", default_backend=["file"])
    assert not (Path("proj") / "exp.jsonl").exists()  # nothing recorded


@pytest.mark.parametrize(
    ("variable", "value"), [("OTEL_TRACKING_QUEUE_SIZE", "2.5"), ("OTEL_TRACKING_MAX_ATTEMPTS", "1.5")]
)
def test_a_count_must_be_a_whole_number(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}='{value}' must be a whole number"):
        Tracking("proj", "exp", default_backend=["file"])


def test_every_numeric_variable_read_in_settings_is_in_the_table() -> None:
    import inspect

    from otel_tracking.config import settings as settings_module

    read = set(re.findall(r'_number\(\w+, "(\w+)"', inspect.getsource(settings_module)))
    assert read and read <= set(NUMERIC_VARIABLES), read - set(NUMERIC_VARIABLES)
