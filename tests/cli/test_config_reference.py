"""The configuration reference in docs/ is the one the schemas generate, and every field has a description."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylign.cli.config_reference import config_reference
from raylign.cli.main import COMMANDS
from raylign.config.base import describe_fields

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_the_reference_page_is_the_generated_one():
    assert PAGE.read_text() == config_reference(), (
        "docs/config-reference.md is out of date: run python -m raylign.cli.config_reference docs/config-reference.md"
    )


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_field_of_every_command_is_described_and_listed(name):
    fields = describe_fields(COMMANDS[name].config_cls())
    undescribed = [dotted for dotted, _, _, description in fields if not description.strip()]
    assert not undescribed, f"raylign {name}: fields without a description: {undescribed}"
    page = config_reference()
    for dotted, type_text, _, _ in fields:
        assert (f"**`{dotted}`**" if type_text.endswith("section") else f"| `{dotted}` |") in page, (name, dotted)
