"""Classes and functions of the user's own that a config names: ``path/to/file.py:Name`` or
``package.module:Name`` (an agent environment, an agent client, a rollout engine).

A file is loaded as a module of its own under a name no other process can import, so what it
defines travels to other processes by value (see :func:`raylign.rollout.pool.engine_class`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

FILE_MODULE_PREFIX = "raylign_user_"  # the module name of a file loaded by path starts with this


def load_callable(spec: str, setting: str) -> Any:
    """What ``spec`` names: ``path/to/file.py:name`` or ``package.module:name`` (``setting`` for errors)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{setting}: {spec!r} must be 'path/to/file.py:Name' or 'package.module:Name'")
    where, name = spec.split(":")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            where_from = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise FileNotFoundError(f"{setting}: {path} does not exist{where_from}")
        module_name = f"{FILE_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"{setting}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so that what it defines pickles by reference within this process
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    found = getattr(module, name, None)
    if found is None:
        raise AttributeError(f"{setting}: {where} has no {name!r}")
    if not callable(found):
        raise TypeError(f"{setting}: {spec} is not callable")
    return found


def loaded_from_file(obj: Any) -> bool:
    """Whether ``obj`` was defined in a file :func:`load_callable` loaded by path."""
    return str(getattr(obj, "__module__", "")).startswith(FILE_MODULE_PREFIX)
