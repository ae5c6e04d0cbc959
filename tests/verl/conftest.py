"""The verl tests run in the verl venv (``scripts/verl-venv``: verl 0.9.1 with torch, outside the
checkout), where ``scripts/test`` runs them.  The main venv has no verl; there only the light
older-verl test (no torch) is collected."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

NEEDS_VERL = [
    "test_loop.py",
    "test_never_break.py",
    "test_verl_own_tests.py",
    "test_agent_loop.py",
    "test_stall.py",
    "test_anatomy.py",
    "test_verl_internals.py",
]

# With ``tests`` on pytest's pythonpath, this folder itself is a namespace package named ``verl``:
# only a real verl (a package with an ``__init__.py``) counts.
_spec = importlib.util.find_spec("verl")
HAS_VERL = _spec is not None and (_spec.origin or "").endswith("__init__.py")
collect_ignore = [] if HAS_VERL else NEEDS_VERL


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster for one test module (``RayResourcePool`` asks for many logical CPUs);
    its GCS address."""
    import ray

    ray.init(num_cpus=100, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
