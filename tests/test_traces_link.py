"""The end-of-run summary's link to the run's traces in a trace UI (``OTEL_TRACKING_TRACES_URL``)."""

from __future__ import annotations

import time
import urllib.parse

import pytest

from otel_tracking import Tracking
from otel_tracking.config.settings import ConfigError
from tests.otlp_receiver import HttpReceiver


def test_the_summary_links_to_the_runs_traces_when_they_go_over_otlp(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "GRPO-Math")
        monkeypatch.setenv("OTEL_TRACKING_TRACES_URL", "http://127.0.0.1:9411/zipkin/")
        before_ms = time.time() * 1000
        tracking = Tracking("proj", "exp", default_backend=[])
        tracking.log({"loss": 1.0}, step=1)
        tracking.finish()
        after_ms = time.time() * 1000
    lines = [line for line in capsys.readouterr().err.splitlines() if "the run's traces" in line]
    assert len(lines) == 1
    link = lines[0].split("the run's traces: ", 1)[1]
    parts = urllib.parse.urlsplit(link)
    assert f"{parts.scheme}://{parts.netloc}{parts.path}" == "http://127.0.0.1:9411/zipkin/"
    query = dict(urllib.parse.parse_qsl(parts.query))
    assert query["serviceName"] == "grpo-math"  # as Zipkin keeps it
    assert query["annotationQuery"] == f"ml.run.id={tracking.run_id}"
    # the run's time range, with a margin, and a limit: Zipkin's page searches as it opens
    assert query["lookback"] == "range" and int(query["limit"]) >= 1000
    assert int(query["startTs"]) <= before_ms - 30_000 and int(query["endTs"]) >= after_ms + 30_000
    assert int(query["endTs"]) - int(query["startTs"]) < after_ms - before_ms + 300_000


def test_no_link_without_otlp_traces(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_TRACKING_TRACES_URL", "http://127.0.0.1:9411/zipkin/")
    Tracking("proj", "exp", default_backend=["file"]).finish()
    assert "the run's traces" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("127.0.0.1:9411/zipkin", "is not an http(s) URL"),
        ("file:///tmp/x", "is not an http(s) URL"),
        ("http://user:hunter2@zipkin:9411/", "must not carry credentials"),
    ],
)
def test_a_bad_traces_url_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("OTEL_TRACKING_TRACES_URL", value)
    with pytest.raises(ConfigError, match="OTEL_TRACKING_TRACES_URL") as raised:
        Tracking("proj", "exp", default_backend=["console"])
    assert message in str(raised.value)
    assert "hunter2" not in str(raised.value)
