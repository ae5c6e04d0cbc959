"""The build backend: setuptools', with its scratch files outside the checkout.

``pip wheel .`` and ``pip install .`` build in the source tree, and setuptools leaves ``build/``
(and ``otel_tracking.egg-info/``) there.  Each hook here runs setuptools' own with those two
pointed into a temporary directory, through the extra config file distutils reads from
``DIST_EXTRA_CONFIG`` (setuptools >= 64), and removes that directory afterwards.  Nothing else changes: the
wheel and the sdist are setuptools' (``tests/test_cli_and_packaging.py`` builds both).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from setuptools import build_meta as _setuptools


@contextlib.contextmanager
def _scratch_outside() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="otel-tracking-build-") as scratch:
        config = os.path.join(scratch, "setup.cfg")
        with open(config, "w", encoding="utf-8") as f:
            f.write(f"[build]\nbuild_base = {os.path.join(scratch, 'build')}\n")
            f.write(f"[egg_info]\negg_base = {scratch}\n")
        previous = os.environ.get("DIST_EXTRA_CONFIG")
        os.environ["DIST_EXTRA_CONFIG"] = config
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("DIST_EXTRA_CONFIG", None)
            else:
                os.environ["DIST_EXTRA_CONFIG"] = previous


def _outside(hook: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _scratch_outside():
            return hook(*args, **kwargs)

    run.__name__ = run.__qualname__ = hook.__name__
    return run


# The PEP 517 and PEP 660 hooks; each of setuptools' would write into the checkout.
get_requires_for_build_wheel = _outside(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_sdist = _outside(_setuptools.get_requires_for_build_sdist)
prepare_metadata_for_build_wheel = _outside(_setuptools.prepare_metadata_for_build_wheel)
build_wheel = _outside(_setuptools.build_wheel)
build_sdist = _outside(_setuptools.build_sdist)
get_requires_for_build_editable = _outside(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_editable = _outside(_setuptools.prepare_metadata_for_build_editable)
build_editable = _outside(_setuptools.build_editable)
