"""A planted secret reaches no sink's output, no span, no resource and no log line.

Every local backend runs for real; afterwards every file any of them wrote, everything an OTLP
endpoint received (but the request header the secret was meant for), and every captured log line
and print is scanned for the secret."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from otel_tracking import Tracking, ValidationGenerationsLogger, trace_state
from tests.otlp_receiver import HttpReceiver

pytestmark = pytest.mark.backend
SECRET = "pl4nted-s3cret-0xDEADBEEF"
BACKENDS = ["file", "console", "tensorboard", "mlflow", "wandb", "swanlab", "clearml", "trackio"]


def offline_env(monkeypatch: pytest.MonkeyPatch, root: Path, trackio_dir: Path, clearml_config: Path) -> None:
    for var, sub in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CACHE_DIR", "wandb/cache"),
        ("WANDB_DATA_DIR", "wandb/data"),
        ("WANDB_CONFIG_DIR", "wandb/config"),
        ("SWANLAB_LOG_DIR", "swanlog"),
        ("HOME", "home"),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(clearml_config))
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.setenv("TENSORBOARD_DIR", str(root / "tensorboard"))


def files_containing(root: Path, needle: bytes) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if needle in data or needle.hex().encode() in data:
                found.append(path)
    return found


def test_a_planted_secret_appears_nowhere(
    isolated: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    trackio_dir: Path,
    clearml_config_file: Path,
) -> None:
    import wandb

    wandb.teardown()
    offline_env(monkeypatch, isolated, trackio_dir, clearml_config_file)
    config = {
        "trainer": {"wandb_api_key": SECRET, "logger": BACKENDS, "project_name": "secrets"},
        "api_key": SECRET,
        "data": {"hf_token": SECRET, "tokenizer": "gpt2", "max_prompt_tokens": 512},
        "db": {"password": SECRET, "host": "localhost"},
        "cloud": [{"secret": SECRET}, {"access_key": SECRET}],
        "VOLC_SECRET_ACCESS_KEY": SECRET,
    }
    caplog.set_level(logging.DEBUG)
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{SECRET}")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"api_key={SECRET},team=rl")
        tracking = Tracking(f"secrets-{isolated.name}", "run", default_backend=BACKENDS, config=config)
        for step in range(1, 4):
            with trace_state("rollout", state_lane_id=0, token=SECRET, model="actor", step=step):
                tracking.log({"train/loss": 1.0 / step, "critic/score/mean": 0.5}, step)
        ValidationGenerationsLogger().log(BACKENDS, [("q", "a", 1.0)], 3)
        stats = tracking.finish()
        assert all(counts["dropped"] == 0 for counts in stats.values()), stats
        # The header was sent where it belongs...
        assert any(h.get("authorization") == f"Bearer {SECRET}" for h in receiver.received.headers)
        # ...and is in nothing that was recorded.
        received = {
            "spans": receiver.received.spans(),
            "logs": receiver.received.log_records(),
            "gauges": list(receiver.received.gauge_points()),
        }
        assert received["spans"] and received["gauges"]
        assert SECRET not in json.dumps(received, default=str)

    written = files_containing(isolated, SECRET.encode()) + files_containing(trackio_dir, SECRET.encode())
    assert written == [], f"the secret was written to {written}"
    out, err = capsys.readouterr()
    assert SECRET not in out and SECRET not in err
    assert all(SECRET not in record.getMessage() for record in caplog.records)
    # The config really reached the backends, redacted (e.g. MLflow's params).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{isolated / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(f"secrets-{isolated.name}").experiment_id])
    assert run.data.params["api_key"] == "<redacted>"
    assert run.data.params["data/tokenizer"] == "gpt2"
    assert run.data.params["data/max_prompt_tokens"] == "512"


def test_the_first_export_failure_says_why_once_without_credentials(caplog: pytest.LogCaptureFixture) -> None:
    """A tracker's export that raises: the first failure's reason is a warning (in the bridge
    process too, whose stderr is the training process's), with credentials in URLs scrubbed."""
    import logging

    from otel_tracking.exporters._base import BridgeMetricExporter, BridgeSession, StepRecord

    class Refusing(BridgeSession):
        @classmethod
        def open(cls, context: object) -> BridgeSession:
            return cls()

        def write_step(self, record: StepRecord) -> bool:
            raise ConnectionError("POST https://alice:s3cret-pw@tracker.example/api refused")

        def write_timing(self, step: int, key: str, seconds: float) -> bool:
            return True

        def finish(self, exit_code: int = 0) -> None:
            return None

    exporter = BridgeMetricExporter(Refusing())
    record = StepRecord(step=1, scalars={"loss": 1.0})
    with caplog.at_level(logging.WARNING, logger="otel_tracking"):
        for _ in range(3):
            assert exporter.export_records([record]).name == "FAILURE"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ConnectionError: POST https://<redacted>@tracker.example/api refused" in warnings[0]
    assert "s3cret" not in caplog.text and "alice" not in caplog.text
