"""The configuration reference, generated from the commands' pydantic schemas: every command, every
field with its type, default and description, as one Markdown page.

    python -m raylign.cli.config_reference docs/config-reference.md    # write the page
    python -m raylign.cli.config_reference                             # print it

The page in ``docs/`` is checked against this output by the test suite, so it cannot drift from
the code; run the first command after changing a config field.
"""

from __future__ import annotations

import sys
from pathlib import Path

from raylign.cli.main import COMMANDS
from raylign.config.base import describe_fields

HEADER = """# Configuration reference

Every field of every command, generated from the config classes by
`python -m raylign.cli.config_reference docs/config-reference.md` (do not edit by hand). A field is
set in the YAML file given with `--config`, or on the command line with its dotted path
(`--train.max_steps 100`); the command line wins over the file, the file over the defaults.
`raylign <command> --help` prints the same list, and `--print-config` the resolved values.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def command_reference(name: str) -> str:
    """One command's section: its summary, and a table per config section."""
    command = COMMANDS[name]
    cls = command.config_cls()
    lines = [f"## `raylign {name}`", "", command.summary, ""]
    doc = " ".join((cls.__doc__ or "").split())
    if doc:
        lines += [doc, ""]
    table_open = False
    for dotted, type_text, default, description in describe_fields(cls):
        if type_text in ("section", "optional section"):
            lines += ["", f"**`{dotted}`**: {_cell(description)}", ""]
            table_open = False
            continue
        if not table_open:
            lines += ["| field | type | default | description |", "|---|---|---|---|"]
            table_open = True
        lines.append(f"| `{dotted}` | {_cell(type_text)} | `{_cell(default)}` | {_cell(description)} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n")


def config_reference() -> str:
    """The whole page."""
    body = [HEADER, "Commands: " + ", ".join(f"`{name}`" for name in COMMANDS) + ".", ""]
    body += [command_reference(name) + "\n" for name in COMMANDS]
    return "\n".join(body).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = config_reference()
    if args:
        Path(args[0]).write_text(text)
        print(f"wrote {args[0]} ({len(text.splitlines())} lines)")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
