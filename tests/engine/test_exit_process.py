"""How a finished rank ends: ``exit_process`` and the CLI's own process entry.

A rank must not run the interpreter's shutdown, where torch's gloo threads can abort it; each test
runs a fresh interpreter and tells from an ``atexit`` handler whether the shutdown ran.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHUTDOWN_MARK = "the interpreter's shutdown ran"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import atexit\natexit.register(lambda: print({SHUTDOWN_MARK!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_process_ends_with_the_status_after_flushing_logs_and_streams_and_skips_the_shutdown(tmp_path):
    log = tmp_path / "run.log"
    done = run_python(f"""
        import logging, sys
        from raylign.engine.distributed import exit_process
        logging.basicConfig(filename={str(log)!r}, level=logging.INFO, format="%(message)s")
        logging.getLogger("raylign").info("step 3 saved")
        sys.stdout.write("no newline yet")  # held in the pipe's buffer until flushed
        sys.stderr.write("to stderr")
        exit_process(3)
        print("after exit_process")
    """)
    assert done.returncode == 3
    assert done.stdout == "no newline yet"  # flushed; neither the next line nor the shutdown's mark
    assert done.stderr == "to stderr"
    assert log.read_text() == "step 3 saved\n"


def test_the_cli_entry_of_a_process_in_a_group_ends_through_exit_process_and_an_explicit_call_returns():
    join_group = textwrap.dedent("""
        import sys
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        from raylign.cli.main import main
    """)
    as_entry = run_python(join_group + "sys.argv = ['raylign', 'no-such-command']\nmain()\nprint('returned')\n")
    assert as_entry.returncode == 2, as_entry.stderr  # the command's own status, from the process's end
    assert "unknown command 'no-such-command'" in as_entry.stderr
    assert as_entry.stdout == ""  # neither "returned" nor the shutdown's mark
    called = run_python(join_group + "print('returned', main(['no-such-command']))\n")
    assert called.returncode == 0, called.stderr
    assert called.stdout == f"returned 2\n{SHUTDOWN_MARK}\n"
    alone = run_python("from raylign.cli.main import main\nimport sys\nsys.argv = ['raylign', 'x']\nprint(main())\n")
    assert alone.stdout == f"2\n{SHUTDOWN_MARK}\n"  # no process group: the usual shutdown
