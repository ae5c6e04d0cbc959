"""Post-import hooks: run a function on a module right after it has been executed, before the
module that imported it gets to read its names.

That ordering is what lets us swap ``verl.utils.tracking.Tracking`` before ``from
verl.utils.tracking import Tracking`` (at the top of verl's trainers) binds it.  A module already
imported when its hook is added gets the hook at once.  Standard library only: this runs in every
process before anything else of ours is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Hook]] = {}
_searching: set[str] = set()  # names we are looking up ourselves (the finders after us answer)


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (now, if it already is)."""
    with _lock:
        _install_finder()
        module = sys.modules.get(name)
        if module is None or getattr(module, "__spec__", None) is None or _initializing(module):
            _hooks.setdefault(name, []).append(hook)
            return
    hook(module)


def _initializing(module: ModuleType) -> bool:
    return bool(getattr(module.__spec__, "_initializing", False))


def _run(module: ModuleType) -> None:
    with _lock:
        hooks = _hooks.pop(module.__name__, [])
    for hook in hooks:
        hook(module)  # each hook guards itself (install.py): a failing patch never fails the import


def _install_finder() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it asks the finders after it and wraps the loader."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _hooks or fullname in _searching:
            return None
        _searching.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _searching.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        # The module's own loader again, for anyone who reads it later (inspect, importlib.resources).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
