"""Fixtures of the agent tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def scratch_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory of this test's sandboxed runs (each makes its scratch folder there),
    where no other test, in this process or another worker, makes theirs."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    return parent
