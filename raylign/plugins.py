"""User code a config names by path: plugin modules that register algorithms.

A plugin is a Python file (``path/to/file.py``) or an importable module (``package.module``).
Importing it runs its ``@ADVANTAGE_ESTIMATORS.register(...)``-style decorators, after which the
names it registered can be used in the config. Every process that builds the config imports the
plugins again (the controller and each training worker), so what they register exists where
it is called. A module is imported once per process, however often a config is validated.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType


class PluginError(ValueError):
    """A plugin that cannot be found or imported; the message names it and why."""


def resolve_plugin(spec: str, setting: str = "plugins") -> str:
    """``spec`` with a file path made absolute (so that worker processes, whatever their working
    directory, import the same file); a module name is returned as given."""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"{setting}: {spec!r} must be a path to a .py file or a module name (package.module)")
    if not spec.endswith(".py"):
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise PluginError(f"{setting}: {spec} does not exist (relative to {Path.cwd()})")
    return str(path.resolve())


def import_plugin(spec: str, setting: str = "plugins") -> ModuleType:
    """Import ``spec`` (see :func:`resolve_plugin`) once per process and return the module."""
    spec = resolve_plugin(spec, setting)
    if spec.endswith(".py"):
        module_name = "raylign_plugin_" + hashlib.sha1(spec.encode()).hexdigest()[:12]
        if module_name in sys.modules:
            return sys.modules[module_name]
        module_spec = importlib.util.spec_from_file_location(module_name, spec)
        if module_spec is None or module_spec.loader is None:
            raise PluginError(f"{setting}: {spec} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # what it defines pickles by reference within this process
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise PluginError(f"{setting}: importing {spec} failed:\n{_traceback(err)}") from None
        return module
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as err:
        if err.name and spec.startswith(err.name):
            raise PluginError(
                f"{setting}: no module named {spec!r} (a file needs its .py ending; a module must be importable)"
            ) from None
        raise PluginError(f"{setting}: importing {spec} failed:\n{_traceback(err)}") from None
    except Exception as err:
        raise PluginError(f"{setting}: importing {spec} failed:\n{_traceback(err)}") from None


def import_plugins(specs: list[str], setting: str = "plugins") -> list[str]:
    """Import every plugin in order; the specs as resolved (file paths absolute)."""
    resolved = [resolve_plugin(spec, f"{setting}[{i}]") for i, spec in enumerate(specs)]
    for i, spec in enumerate(resolved):
        import_plugin(spec, f"{setting}[{i}]")
    return resolved


def _traceback(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
