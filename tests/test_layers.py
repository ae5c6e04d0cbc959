"""The package's layers import only downward (README: "The code, layer by layer").

Every ``import`` in otel_tracking/, at module top or inside a function, is read with ``ast``: a
module may import its own layer and the layers below it, never one above.  The package root
(``otel_tracking/__init__.py``: the lazy public names) and the three documented old import paths
(``otel_tracking.ray_tracing``, ``.propagation``, ``.worker``: re-exports) sit outside the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import otel_tracking

LAYERS = ["signals", "config", "exporters", "delivery", "bridges", "runtime", "distributed", "api", "cli", "verl"]
OUTSIDE = {"__init__", "__main__", "ray_tracing", "propagation", "worker"}
PACKAGE = Path(otel_tracking.__file__).parent


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "otel_tracking" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            # `from otel_tracking.config import settings` names a module of that layer either way
            found.append((node.lineno, base))
    return found


def violations() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts)
        if len(relative.parts) == 2 and relative.parts[1] in OUTSIDE:
            continue
        mine = layer_of(module)
        assert mine is not None, f"{module} sits in no layer: put it in one of {LAYERS}"
        for line, target in imports_of(path, module):
            theirs = layer_of(target)
            if target.split(".")[0] == "otel_tracking_stack" and mine != "cli":
                wrong.append(f"{module}:{line} imports {target}: only the CLI loads the stack tooling")
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs}), a layer above it")
            if target in {f"otel_tracking.{name}" for name in OUTSIDE - {"__init__", "__main__"}}:
                wrong.append(f"{module}:{line} imports the re-export {target}: import its module in distributed/")
    return wrong


def test_every_import_points_downward() -> None:
    assert violations() == []


def test_the_check_sees_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """The check can fail: a signals module that imports the runtime is reported."""
    package = tmp_path / "otel_tracking"
    (package / "signals").mkdir(parents=True)
    (package / "signals" / "values.py").write_text("def f():\n    from otel_tracking.runtime import run\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert violations() == [
        "otel_tracking.signals.values:2 (signals) imports otel_tracking.runtime (runtime), a layer above it"
    ]


def test_the_old_import_paths_still_work() -> None:
    """README-documented paths from before the layers keep working for users."""
    from otel_tracking import propagation, ray_tracing, worker
    from otel_tracking.distributed import propagation as p
    from otel_tracking.distributed import ray_tracing as r
    from otel_tracking.distributed import worker as w

    # the very modules: a monkeypatch of otel_tracking.worker._defaults reaches the real one
    assert propagation is p and ray_tracing is r and worker is w
