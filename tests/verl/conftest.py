"""The verl tests run in the verl venv (``scripts/verl-venv``: verl 0.9.1 with torch, outside the
checkout), where ``scripts/test`` runs them.  The main venv has no verl; there only the light
older-verl test (no torch) is collected."""

from __future__ import annotations

import importlib.util

NEEDS_VERL = ["test_loop.py", "test_never_break.py", "test_verl_own_tests.py"]

collect_ignore = [] if importlib.util.find_spec("verl") is not None else NEEDS_VERL
