"""The package's layers import only downward (docs/architecture/index.md: "The code, layer by layer").

Every ``import`` in otel_tracking/, at module top or inside a function, and every
``importlib.import_module`` of a literal or f-string name, is read with ``ast``: a module may import
its own layer and the layers below it, never one above, and no modules import each other in a
circle (function-level imports count: a circle put off to call time is still one).  The package
root (``otel_tracking/__init__.py``: the lazy public names) and the three documented old import
paths (``otel_tracking.ray_tracing``, ``.propagation``, ``.worker``: re-exports) sit outside the
layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import otel_tracking

# the bottom layer first
LAYERS = [
    "compat", "signals", "config", "exporters", "delivery", "bridges", "runtime", "distributed", "api", "cli", "verl",
]  # fmt: skip
OUTSIDE = {"__init__", "__main__", "ray_tracing", "propagation", "worker"}
PACKAGE = Path(otel_tracking.__file__).parent


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "otel_tracking" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def imports_of(path: Path, module: str, names: bool = False) -> list[tuple[int, str]]:
    """(line, module) for each import; with ``names``, ``from package import x`` also gives
    ``package.x`` (x may be a module)."""
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
            if names:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            name = _literal_prefix(node.args[0])
            if name:
                found.append((node.lineno, name))
    return found


def _is_import_module(func: ast.expr) -> bool:
    """``importlib.import_module`` or a bare ``import_module``."""
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def _literal_prefix(arg: ast.expr) -> str | None:
    """The module a literal names, or the package an f-string's constant start names
    (``f"otel_tracking.exporters.{name}"`` imports a module of ``otel_tracking.exporters``)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None
    return None


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        names[".".join(relative.parts)] = path
    return names


def circles() -> list[list[str]]:
    """Every set of modules that import each other in a circle (Tarjan's strongly connected
    components over the module graph; a package's ``__init__`` is the package's name)."""
    modules = module_names()
    known = {name.removesuffix(".__init__"): name for name in modules}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for _, target in imports_of(path, name, names=True):
            while target and target not in known:  # `from package.module import name`: the module
                target = target.rpartition(".")[0]
            if target and known[target] != name and target != PACKAGE.name:
                graph[name].add(known[target])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


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


def _made_up_package(tmp_path: Path, monkeypatch, files: dict[str, str]) -> None:
    """An ``otel_tracking`` of these files (path inside the package -> text), checked instead."""
    package = tmp_path / "otel_tracking"
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    monkeypatch.setitem(globals(), "PACKAGE", package)


def test_the_check_sees_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """The check can fail: a signals module that imports the runtime is reported."""
    upward = "def f():\n    from otel_tracking.runtime import run\n"
    _made_up_package(tmp_path, monkeypatch, {"signals/values.py": upward})
    assert violations() == [
        "otel_tracking.signals.values:2 (signals) imports otel_tracking.runtime (runtime), a layer above it"
    ]


def test_the_check_reads_import_module_calls(tmp_path: Path, monkeypatch) -> None:
    """A module loaded by name (``importlib.import_module`` of a literal or an f-string) is an
    import too: a config module that loads the runtime that way is reported."""
    loads = "import importlib\ndef f(name):\n    return importlib.import_module(f'otel_tracking.runtime.{name}')\n"
    _made_up_package(tmp_path, monkeypatch, {"config/settings.py": loads})
    assert violations() == [
        "otel_tracking.config.settings:3 (config) imports otel_tracking.runtime (runtime), a layer above it"
    ]


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles() == []


def test_the_check_sees_a_circle_put_off_to_call_time(tmp_path: Path, monkeypatch) -> None:
    """Two modules of one layer, one importing the other inside a function: still a circle."""
    _made_up_package(
        tmp_path,
        monkeypatch,
        {
            "delivery/__init__.py": "",
            "delivery/spool.py": "def f():\n    from otel_tracking.delivery.registry import g\n",
            "delivery/registry.py": "from otel_tracking.delivery import spool\n",
        },
    )
    assert circles() == [["otel_tracking.delivery.registry", "otel_tracking.delivery.spool"]]


def test_the_old_import_paths_still_work() -> None:
    """Import paths the docs name (and older code used) from before the layers keep working for users."""
    from otel_tracking import propagation, ray_tracing, worker
    from otel_tracking.distributed import propagation as p
    from otel_tracking.distributed import ray_tracing as r
    from otel_tracking.distributed import worker as w

    # the very modules: a monkeypatch of otel_tracking.worker._defaults reaches the real one
    assert propagation is p and ray_tracing is r and worker is w


# Third-party names without a public home that only compat/ may touch: modules it may import, and
# private attributes (read as ``x.name`` or ``getattr(x, "name")``, assigned as ``x.name = ...``).
COMPAT_ONLY_MODULES = ("opentelemetry._logs", "opentelemetry.sdk._logs")
COMPAT_ONLY_ATTRIBUTES = {"_execute_remote_single_worker", "_workers", "_timer"}


def private_name_uses() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "compat":
            continue
        tree = ast.parse(path.read_text())
        for line, target in imports_of(path, "otel_tracking." + ".".join(relative.with_suffix("").parts)):
            if target.startswith(COMPAT_ONLY_MODULES):
                found.append(f"{relative}:{line} imports {target}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in COMPAT_ONLY_ATTRIBUTES:
                found.append(f"{relative}:{node.lineno} uses .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "setattr", "hasattr"}
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in COMPAT_ONLY_ATTRIBUTES
            ):
                found.append(f"{relative}:{node.lineno} uses {node.args[1].value!r}")
    return found


def test_verl_and_opentelemetry_logs_private_names_are_touched_only_in_compat() -> None:
    assert private_name_uses() == []


def test_the_private_name_check_sees_a_use_outside_compat(tmp_path: Path, monkeypatch) -> None:
    uses = (
        "from opentelemetry._logs import SeverityNumber\n"
        "def f(group, performance):\n"
        "    performance._timer = None\n"
        "    return getattr(group, '_workers', None)\n"
    )
    _made_up_package(tmp_path, monkeypatch, {"verl/waiting.py": uses, "compat/verl_internals.py": uses})
    assert private_name_uses() == [
        "verl/waiting.py:1 imports opentelemetry._logs",
        "verl/waiting.py:3 uses ._timer",
        "verl/waiting.py:4 uses '_workers'",
    ]
