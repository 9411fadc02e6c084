"""Reading the small JSON files raylign keeps beside models and checkpoints, with errors that name them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object ``path`` holds; ValueError naming the file when it is missing, unreadable, not
    JSON or not an object (json's own errors name no file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read: {err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{path}: not usable JSON: {err!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data
