"""`docs/architecture/one-value.md` lists the hops of one value from ``log()`` to MLflow: it stays
true.  Each step it names is a function of ours that exists; a real ``log()`` into a real MLflow
store (sqlite, the trackers in this process: the same functions as with the bridge process, whose
reader then runs there) calls every one of them, in the page's order (but for the writer's and
the reader's loops, running since ``Tracking()``); and there are at most 10."""

from __future__ import annotations

import importlib
import re
import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from otel_tracking import Tracking

pytestmark = pytest.mark.backend  # needs mlflow

PAGE = Path(__file__).resolve().parent.parent / "docs" / "architecture" / "one-value.md"
_STEP = re.compile(r"^\d+\. `([a-z_/]+\.py)` `([A-Za-z_.]+)`", re.MULTILINE)


def _steps() -> list[tuple[str, str]]:
    return _STEP.findall(PAGE.read_text())


def _code(path: str, qualname: str) -> CodeType:
    module = importlib.import_module("otel_tracking." + path.removesuffix(".py").replace("/", "."))
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part)
    return found.__code__


def test_the_page_counts_at_most_ten_hops_and_names_functions_that_exist() -> None:
    steps = _steps()
    said = re.search(r"\*\*(\d+) hops\*\*", PAGE.read_text())
    assert said is not None and int(said.group(1)) == len(steps) <= 10, (said, steps)
    for path, qualname in steps:
        _code(path, qualname)  # raises when the page names something that is not there


def test_a_real_log_goes_through_every_hop_in_the_pages_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("OTEL_TRACKING_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.setenv("OTEL_TRACKING_BRIDGE_PROCESS", "false")
    codes = {_code(path, qualname): qualname for path, qualname in _steps()}
    first: dict[str, float] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            first.setdefault(codes[frame.f_code], time.monotonic())

    threading.setprofile(profile)  # from before Tracking(): the writer's and the reader's threads
    try:
        tracking = Tracking("one-value", "hops", default_backend=["mlflow"])
        sys.setprofile(profile)
        tracking.log({"loss": 0.5}, step=3)
        assert tracking.flush(60)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    tracking.finish()
    # A thread's loop (the writer's, the reader's) is called once, when its thread starts at
    # Tracking(); every other step is called for this value, in the page's order.
    loops = {"LogWriter._run", "LogReader.run"}
    steps = [qualname for _, qualname in _steps()]
    assert loops <= set(first) and set(steps) == set(first), (first, steps)
    called = [qualname for qualname in sorted(first, key=first.__getitem__) if qualname not in loops]
    assert called == [qualname for qualname in steps if qualname not in loops], (first, steps)
