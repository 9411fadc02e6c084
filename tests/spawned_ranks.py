"""Tests that run several gloo ranks as processes spawned by torch.multiprocessing.

Spawned ranks unpickle their function by module name, so the code they run lives in a
top-level module next to its test (spawn hands the parent's ``sys.path`` to the children):
:func:`import_worker` imports it that way, whatever pytest's import mode.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.multiprocessing as mp

from raylign.engine.distributed import exit_process, host_rendezvous_store


def import_worker(test_file: str, name: str) -> ModuleType:
    """The module ``name`` from the folder of ``test_file``, importable by the spawned ranks."""
    folder = str(Path(test_file).parent)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def spawn_and_join(fn: Callable[..., Any], args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``fn(rank, port, *args)`` in ``nprocs`` processes; a rank's error is raised here, and ranks
    still running after ``timeout_s`` are killed and reported as ``what``.

    ``port`` is that of a rendezvous store this process hosts until the ranks have finished, as
    torchrun's agent does: the ranks all join it as clients (``TORCHELASTIC_USE_AGENT_STORE``). Its
    socket is bound here, on a port the OS picks; a free port found first and bound by rank 0 seconds
    later, once spawned, could be taken in between by another process (seen as EADDRINUSE with the
    suite's workers side by side).
    """
    store = host_rendezvous_store("127.0.0.1", world_size=nprocs, timeout_s=timeout_s)
    finished = mp.get_context("spawn").Barrier(nprocs)
    context = mp.spawn(_run_rank, args=(finished, fn, store.port, *args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the {nprocs} {what} did not finish within {timeout_s} s")
    del store  # held until here: the ranks used it to the end


def _run_rank(rank: int, finished: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(rank, *args)``, then, once every rank has finished (no rank leaves a collective its peers
    are still in), the end through :func:`exit_process`: no interpreter shutdown, where gloo's threads
    can abort a finished rank. An error propagates to ``mp.spawn``.

    Every rank joins the store :func:`spawn_and_join` hosts as a client, whether its group starts
    from ``env://`` or ``tcp://``."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    fn(rank, *args)
    finished.wait(timeout=120)
    exit_process(0)


def as_gloo_rank(rank: int, world_size: int, port: int) -> None:
    """Make this spawned process rank ``rank`` of ``world_size`` on this machine: the environment
    torch.distributed and the engines read, one torch thread.

    The group the rank then starts is never destroyed: the process ends through :func:`_run_rank`'s
    :func:`exit_process`, after every rank has finished. Destroying a gloo group can deadlock: the
    last reference to it may go (``destroy_process_group``, or a DDP reducer that held it) while the
    main thread holds the GIL and joins the group's worker threads, and a worker thread still
    releasing a finished collective's tensors waits for the GIL to drop their Python objects.
    """
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)


def time_unanswered_all_reduce(group: Any, out: str) -> None:
    """All-reduce in ``group``, which the other ranks never join; write to ``out`` as JSON how long
    this rank waited (``waited_s``) and the error it got (``error``, empty if none)."""
    import torch.distributed as dist

    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        error = ""
    except RuntimeError as err:
        error = str(err)
    Path(out).write_text(json.dumps({"waited_s": time.monotonic() - started, "error": error}))
