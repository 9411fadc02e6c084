"""The documentation site builds with ``mkdocs build --strict``, and its runnable blocks run as written.

A code block is runnable when the line before its opening fence is ``<!-- docs-test -->``. The
runnable blocks of a page run in the order they appear, in one fresh clone of the repository, from
its root, under a clean environment whose PATH starts with the clone's ``.venv/bin`` (what
``source .venv/bin/activate`` gives): ``bash`` blocks with ``bash -e``, ``python`` blocks as a file
given to ``python``. A page's later blocks see what its earlier ones wrote.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import yaml

from tests.clean_run import REPO, SYSTEM_PATH, fresh_clone, run_clean

DOCS = REPO / "docs"
RUN_MARK = "<!-- docs-test -->"
FENCE = re.compile(r"^```(\w+)\s*$")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, counted from 1
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language})"


def runnable_blocks(text: str, name: str) -> list[Block]:
    """The blocks of page ``name`` marked runnable, in order; a mark not above a bash or python fence is an error."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != RUN_MARK:
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(1) not in ("bash", "python"):
            raise AssertionError(f"{name}:{i + 1}: {RUN_MARK} must stand right above a ```bash or ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{name}:{i + 2}: the runnable block is never closed")
        blocks.append(Block(name, i + 2, fence.group(1), "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def nav_pages() -> list[str]:
    """Every page the site's navigation lists, as a path under docs/."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages: list[str] = []

    def walk(entries):
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                walk(value) if isinstance(value, list) else pages.append(value)

    walk(nav)
    return pages


def page_blocks(page: str) -> list[Block]:
    return runnable_blocks((DOCS / page).read_text(), page)


PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
PAGES_WITH_BLOCKS = [page for page in PAGES if page_blocks(page)]


def test_the_site_builds_strictly_with_every_page_in_the_navigation(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert sorted(nav_pages()) == PAGES
    for page in PAGES:
        html = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert (site / html).is_file(), f"{page} was not built into {html}"


def test_every_guide_runs_at_least_one_of_its_commands():
    guides = sorted(str(p.relative_to(DOCS)) for p in (DOCS / "guides").glob("*.md"))
    assert guides, "no guides found"
    assert [g for g in guides if g not in PAGES_WITH_BLOCKS] == []


def test_marked_blocks_are_found_in_order_and_a_stray_mark_is_refused():
    text = "\n".join(
        ["intro", "```bash", "echo skipped", "```", RUN_MARK, "```bash", "echo one", "```"]
        + [RUN_MARK, "```python", "print(2)", "```"]
    )
    blocks = runnable_blocks(text, "p.md")
    assert [(b.line, b.language, b.code) for b in blocks] == [(6, "bash", "echo one\n"), (10, "python", "print(2)\n")]
    with pytest.raises(AssertionError, match=r"q.md:2: <!-- docs-test --> must stand right above"):
        runnable_blocks(f"text\n{RUN_MARK}\nnot a fence\n", "q.md")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS)
def test_the_runnable_blocks_of_each_page_run_as_written(page, tmp_path):
    clone = fresh_clone(tmp_path)
    path = f"{clone / '.venv' / 'bin'}:{SYSTEM_PATH}"
    for number, block in enumerate(page_blocks(page)):
        if block.language == "bash":
            command = f"set -e\n{block.code}"
        else:
            script = clone / f".docs_block_{number}.py"
            script.write_text(block.code)
            command = f"python {script.name}"
        try:
            run_clean(command, clone, timeout=600, path=path)
        except AssertionError as err:
            raise AssertionError(f"the block at {block} failed:\n{block.code}\n{err}") from None
