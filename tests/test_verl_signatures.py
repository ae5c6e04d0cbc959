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


def _bound(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``inspect.signature(...).bind`` makes of a call, catch-alls merged: what ``_arguments``
    must give at every call, the first of its shape (bound) and the next ones (planned)."""
    import inspect

    signature = inspect.signature(function)
    arguments = dict(signature.bind("cls", *args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def test_arguments_of_a_call_shape_seen_before_are_what_bind_gives() -> None:
    from otel_tracking.verl.tracking_swap import _arguments

    def verl_091(cls: Any, state_name: str, *, state_lane_id: Any = None, **labels: Any) -> None: ...

    def moved(cls: Any, state_name: str, state_lane_id: Any = None, /, color: str = "", **labels: Any) -> None: ...

    def starred(cls: Any, state_name: str, *rest: Any, **labels: Any) -> None: ...

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
        (verl_091, ("update_actor",), {"state_lane_id": "rank_0"}),
        (verl_091, (), {"state_name": "gen", "state_lane_id": 3, "model": "actor"}),
        (verl_091, ("gen",), {"step": 2, "state_lane_id": 1}),
        (moved, ("update_actor", "rank_3"), {"color": "red", "step": 1}),
        (moved, ("update_actor", "rank_3", "blue"), {}),
        (starred, ("a", "b", "c"), {"x": 1}),
    ]
    for function, args, kwargs in calls:
        for _ in range(3):  # the first call of a shape binds, the next ones follow its plan
            assert _arguments(function, "cls", args, dict(kwargs)) == _bound(function, args, kwargs)
    for _ in range(3):  # a shape verl refuses is refused every time, never planned
        with pytest.raises(TypeError):
            _arguments(verl_091, "cls", ("gen", "rank_0"), {})
        with pytest.raises(TypeError):
            _arguments(verl_091, "cls", ("gen",), {"state_name": "twice"})
        with pytest.raises(TypeError):  # bind's rule for a positional-only name given by keyword
            _arguments(moved, "cls", ("update_actor",), {"state_lane_id": "rank_0"})
    # the plan is per shape: the same names in another order, or one more, bind again
    for kwargs in ({"state_lane_id": 1, "model": "m"}, {"model": "m", "state_lane_id": 1}, {"state_lane_id": 1}):
        assert _arguments(verl_091, "cls", ("gen",), kwargs) == _bound(verl_091, ("gen",), kwargs)


def _suppressing_verl(entered: list[str]) -> type:
    class RLInsightLogger:  # rl_insight enabled: verl's trace_state runs inside ours
        @classmethod
        def enabled(cls) -> bool:
            return True

        @classmethod
        @contextmanager
        def trace_state(cls, state_name: str, *, state_lane_id: Any = None, **labels: Any) -> Iterator[None]:
            if state_name == "refused":
                raise RuntimeError("verl's own trace_state failed")
            entered.append(state_name)
            try:
                yield
            except KeyError:  # verl's own swallows this one
                entered.append("swallowed")

        @classmethod
        def log(cls, data: dict[str, Any], step: int) -> None: ...

        @classmethod
        def register_metrics(cls, server_addresses: list[str], labels: Any = None, job_name: Any = None) -> None: ...

    return RLInsightLogger


def test_trace_state_keeps_what_a_context_manager_of_verl_does(isolated: Path) -> None:
    entered: list[str] = []
    verl = _suppressing_verl(entered)
    assert patch_rl_insight(verl) == []
    tracking = Tracking("proj", "exp", default_backend=["file"])
    with verl.trace_state("fine", state_lane_id="rank_0"):
        pass
    with verl.trace_state("swallowed"):  # verl's own suppresses it: so does ours, the span is no error
        raise KeyError("verl's to swallow")
    with pytest.raises(ValueError), verl.trace_state("failed"):
        raise ValueError("the phase failed")
    with pytest.raises(RuntimeError), verl.trace_state("refused"):
        pass

    @verl.trace_state("decorated")  # as @contextmanager's could be: a fresh span per call
    def twice(n: int) -> int:
        return n if n == 0 else twice(n - 1)

    assert twice(1) == 0
    tracking.finish()

    assert entered == ["fine", "swallowed", "swallowed", "failed", "decorated", "decorated"]
    events = [json.loads(line) for line in (isolated / "proj" / "exp.events.jsonl").read_text().splitlines()]
    spans = {e["name"]: e for e in events if e.get("name") in ("fine", "swallowed", "failed", "refused")}
    assert [e["name"] for e in events if e.get("name") == "decorated"] == ["decorated", "decorated"]
    assert spans["fine"]["attributes"]["ml.lane"] == "rank_0"
    for name, failed in (("fine", False), ("swallowed", False), ("failed", True), ("refused", True)):
        assert (spans[name]["status"] == "ERROR") is failed, (name, spans[name]["status"])


class _Workers(list):  # type: ignore[type-arg]
    """A worker list that counts how often it is walked."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _Workers.walks += 1
        return super().__iter__()


def test_a_workers_rank_is_found_without_walking_the_group_at_every_call() -> None:
    """The driver looks each worker-group call's worker up: at 1,024 workers a walk per call is a
    million steps per phase.  The map is made once per group (and again only when it changes)."""
    from otel_tracking.compat.verl_internals import rank_in_group

    handles = [object() for _ in range(1024)]
    group = type("Group", (), {})()
    group.workers = _Workers(handles)
    _Workers.walks = 0
    assert [rank_in_group(group, w) for w in handles] == [(i, 1024) for i in range(1024)]
    assert _Workers.walks == 1
    assert rank_in_group(group, object()) == (-1, 1024)  # not one of the group's

    handles[5], handles[7] = handles[7], handles[5]  # changed in place: found at its new rank
    group.workers[5], group.workers[7] = handles[5], handles[7]
    assert rank_in_group(group, handles[5]) == (5, 1024)
    group.workers.append(object())  # grown: looked up in the new list
    assert rank_in_group(group, group.workers[-1]) == (1024, 1025)

    private_only = type("OlderGroup", (), {})()
    private_only._workers = handles  # a group with only the private list
    assert rank_in_group(private_only, handles[3]) == (3, 1024)
