"""The contract with the pinned verl (``compat/verl_internals.py``): every private name the switch
replaces or reads is there in this release, the release is one the names were checked against, and
the lookups give what the switch patches."""

from __future__ import annotations

import importlib
import logging
import types

import pytest

from otel_tracking.compat import verl_internals


def test_the_pinned_verl_has_every_private_name_and_is_a_tested_release() -> None:
    import verl

    assert verl_internals.tested_version(), (
        f"verl {verl.__version__} is not in TESTED_RELEASES {verl_internals.TESTED_RELEASES}: "
        "run the verl tests against it, then add it"
    )
    for where, names in verl_internals.PRIVATE_NAMES.items():
        module = importlib.import_module(where)
        for dotted in names:
            owner: object = module
            for part in dotted.split("."):
                owner = getattr(owner, part, None)
                assert owner is not None, f"{where}.{dotted} moved: the switch leaves that part of verl alone"
            assert callable(owner), f"{where}.{dotted} is no longer callable"


def test_the_lookups_find_what_the_switch_patches() -> None:
    base = importlib.import_module(verl_internals.WORKER_GROUP_MODULE)
    performance = importlib.import_module(verl_internals.TIMER_MODULE)

    found = verl_internals.worker_group_execute(base)
    assert found is not None and found[0] is base.RayWorkerGroup
    assert found[1].__name__ == "_execute_remote_single_worker"
    timer = verl_internals.performance_timer(performance)
    assert timer is not None and timer.__name__ == "_timer"
    # A worker group's public `workers` is what rank_in_group reads in this release.
    assert isinstance(base.RayWorkerGroup.__dict__["workers"], property)


def test_a_verl_without_the_names_gives_none_and_says_why_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="otel_tracking.verl")
    moved = types.ModuleType("verl.single_controller.ray.base")
    moved.RayWorkerGroup = type("RayWorkerGroup", (), {})  # type: ignore[attr-defined]
    assert verl_internals.worker_group_execute(moved) is None
    assert verl_internals.performance_timer(types.ModuleType("verl.utils.profiler.performance")) is None
    said = caplog.text
    assert "has no verl.single_controller.ray.base.RayWorkerGroup._execute_remote_single_worker" in said
    assert "has no verl.utils.profiler.performance._timer, though this release was checked to have it" in said
