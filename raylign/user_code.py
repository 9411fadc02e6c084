"""Code of the user's own that a config names: a class or function as ``path/to/file.py:Name`` or
``package.module:Name`` (an agent environment, an agent client, a rollout engine), and plugins,
files or modules imported for what they register (``plugins`` of the RL config: algorithms).

A file is loaded once per process as a module of its own under a name no other process can
import, so what it defines travels to other processes by value (see
:func:`raylign.rollout.pool.engine_class`). Plugins are imported again by every process that
builds the config (the controller and each training worker), so the names they register exist
wherever they are looked up.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

FILE_MODULE_PREFIX = "raylign_user_"  # the module name of a file loaded by path starts with this


class UserCodeError(ValueError):
    """User code a config names that cannot be imported; the message names the setting and why."""


def import_user_module(where: str, setting: str) -> ModuleType:
    """``where`` (a path to a ``.py`` file, or an importable module name) imported once per process."""
    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name and where.startswith(err.name):
                raise UserCodeError(
                    f"{setting}: no module named {where!r} (a file needs its .py ending; a module must be importable)"
                ) from None
            raise UserCodeError(f"{setting}: importing {where} failed:\n{_traceback(err)}") from None
        except Exception as err:
            raise UserCodeError(f"{setting}: importing {where} failed:\n{_traceback(err)}") from None
    path = Path(where).expanduser()
    if not path.is_file():
        where_from = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise FileNotFoundError(f"{setting}: {path} does not exist{where_from}")
    resolved = str(path.resolve())
    module_name = FILE_MODULE_PREFIX + hashlib.sha1(resolved.encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise UserCodeError(f"{setting}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so that what it defines pickles by reference within this process
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise UserCodeError(f"{setting}: importing {path} failed:\n{_traceback(err)}") from None
    return module


def load_callable(spec: str, setting: str) -> Any:
    """What ``spec`` names: ``path/to/file.py:name`` or ``package.module:name`` (``setting`` for errors)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{setting}: {spec!r} must be 'path/to/file.py:Name' or 'package.module:Name'")
    where, name = spec.split(":")
    module = import_user_module(where, setting)
    found = getattr(module, name, None)
    if found is None:
        raise AttributeError(f"{setting}: {where} has no {name!r}")
    if not callable(found):
        raise TypeError(f"{setting}: {spec} is not callable")
    return found


def absolute_file(spec: str) -> str:
    """A user's file path, absolute, so that processes started elsewhere (worker processes, other
    nodes) find the same file whatever their working directory."""
    return str(Path(spec).expanduser().resolve())


def import_plugins(specs: list[str], setting: str = "plugins") -> list[str]:
    """Import every plugin in order, once per process; the specs with file paths made absolute (so
    that worker processes, whatever their working directory, import the same files)."""
    resolved = []
    for i, spec in enumerate(specs):
        where = f"{setting}[{i}]"
        if not spec.strip():
            raise UserCodeError(f"{where}: empty; give a path to a .py file or a module name (package.module)")
        if spec.endswith(".py"):
            path = Path(spec).expanduser()
            if not path.is_file():  # a ValueError, which a config validator reports as a config error
                raise UserCodeError(f"{where}: {spec} does not exist (relative to {Path.cwd()})")
            spec = absolute_file(spec)
        import_user_module(spec, where)
        resolved.append(spec)
    return resolved


def loaded_from_file(obj: Any) -> bool:
    """Whether ``obj`` was defined in a file :func:`load_callable` loaded by path."""
    return str(getattr(obj, "__module__", "")).startswith(FILE_MODULE_PREFIX)


def _traceback(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
