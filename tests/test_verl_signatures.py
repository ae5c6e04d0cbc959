"""verl that moved: ``RLInsightLogger`` methods whose signatures differ from verl 0.9.1's are
called as verl expects (every argument untouched), and our side still finds each argument by its
name.  Stand-in classes with the changed signatures, patched as the verl switch patches verl's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from otel_tracking import Tracking
from otel_tracking.verl.tracking_swap import patch_rl_insight


def _moved_verl() -> type:
    class RLInsightLogger:  # a verl whose methods moved
        calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        @classmethod
        def enabled(cls) -> bool:
            return True

        @classmethod
        @contextmanager
        def trace_state(
            cls, state_name: str, state_lane_id: Any = None, *, color: str = "", **labels: Any
        ) -> Iterator[None]:
            cls.calls.append(("trace_state", (state_name, state_lane_id), {"color": color, **labels}))
            yield

        @classmethod
        def log(cls, data: dict[str, Any], step: int, *, commit: bool = True) -> str:
            cls.calls.append(("log", (data, step), {"commit": commit}))
            return "verl's own"

        @classmethod
        def register_metrics(cls, server_addresses: list[str], labels: Any = None, job_name: Any = None) -> None:
            cls.calls.append(("register_metrics", (server_addresses,), {"labels": labels, "job_name": job_name}))

    return RLInsightLogger


def test_moved_signatures_reach_verl_untouched_and_ours_by_name(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACKING_SCRAPE_TARGETS_DIR", str(isolated / "targets"))
    verl = _moved_verl()
    assert patch_rl_insight(verl) == []
    tracking = Tracking("proj", "exp", default_backend=["file"])
    # state_lane_id by position, and a keyword 0.9.1 does not have: no TypeError, verl gets both
    with verl.trace_state("update_actor", "rank_3", color="red", step=1):
        pass
    assert verl.log({"actor/lr": 1e-6}, 1, commit=False) == "verl's own"
    # reordered optional arguments: labels and job_name stay apart
    verl.register_metrics(["127.0.0.1:9000"], [{"replica": "0"}], "vllm")
    tracking.log({"loss": 1.0}, step=1)
    tracking.finish()

    assert verl.calls == [
        ("trace_state", ("update_actor", "rank_3"), {"color": "red", "step": 1}),
        ("log", ({"actor/lr": 1e-6}, 1), {"commit": False}),
        ("register_metrics", (["127.0.0.1:9000"],), {"labels": [{"replica": "0"}], "job_name": "vllm"}),
    ]
    events = [json.loads(line) for line in (isolated / "proj" / "exp.events.jsonl").read_text().splitlines()]
    (span,) = [e for e in events if e.get("name") == "update_actor"]
    assert span["attributes"]["ml.lane"] == "rank_3" and span["attributes"]["ml.step"] == 1
    assert span["attributes"]["ml.label.color"] == "red"  # a keyword 0.9.1 does not have: a label
    (targets,) = (isolated / "targets").glob("*.json")
    (group,) = json.loads(targets.read_text())
    assert group["targets"] == ["127.0.0.1:9000"]
    assert group["labels"]["job"] == "vllm" and group["labels"]["replica"] == "0"
