"""Every wait in raylign has a limit.

A static check over the package's source: each call that can block on another process, thread,
actor or host (``ray.get``, ``ray.wait``, process-group creation, HTTP clients, subprocess
waits, thread and process joins, queue gets, future results, asyncio waits) must pass a
timeout, so that a hung peer ends a run with an error instead of stalling it. A wait bounded
some other way belongs in :data:`ALLOWED`, with the reason.

And one of those limits for real: a worker call that outlives it raises a TimeoutError naming
the call, the rank and the setting to raise.
"""

from __future__ import annotations

import ast
import functools
import time
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "raylign"

# Functions that wait, by their full dotted name: the position of the timeout argument where
# it may be passed positionally, None where it is keyword-only (or the call is a client whose
# requests take their limit from its ``timeout``).
WAITING_FUNCTIONS: dict[str, int | None] = {
    "ray.get": None,
    "ray.wait": None,
    "torch.distributed.init_process_group": None,
    "torch.distributed.new_group": None,
    "deepspeed.init_distributed": None,
    "subprocess.run": None,
    "subprocess.call": None,
    "subprocess.check_call": None,
    "subprocess.check_output": None,
    "urllib.request.urlopen": 2,
    "aiohttp.ClientSession": None,
    "asyncio.wait": None,
    "asyncio.wait_for": 1,
    "concurrent.futures.wait": 1,
    "concurrent.futures.as_completed": 1,
    **{
        f"{module}.{verb}": None
        for module in ("requests", "httpx")
        for verb in ("get", "post", "put", "patch", "delete", "head", "options", "request")
    },
    "httpx.Client": None,
    "httpx.AsyncClient": None,
}
# Methods that wait whatever their receiver (Popen, Thread, Process, Event, Condition, Work,
# Future, queues): the position of their timeout argument. A ``.get`` or ``.join`` with a
# positional argument is taken for ``dict.get(key)`` or ``str.join(parts)``; a wait method
# with a positional argument has been given its timeout.
WAITING_METHODS: dict[str, int] = {"wait": 0, "join": 0, "result": 0, "get": 0, "communicate": 1}
# Waits with no timeout of their own: bounded only as the awaitable of an ``asyncio.wait_for``.
NEEDS_WAIT_FOR = {"asyncio.gather"}

# (path under raylign/, enclosing function, the call as written) -> why it is bounded anyway.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "cli/main.py",
        "_launch_ranks",
        "subprocess.call(cmd, env=env)",
    ): "the command's own run under torchrun, as long as training takes; its ranks' collectives are "
    "bounded by engine.dist_timeout_s, and torchrun ends when they do",
    (
        "rollout/sync_wire.py",
        "_wait_all",
        "work.wait()",
    ): "gloo broadcasts, which fail by themselves after their group's timeout (rollout.sync_timeout_s, given "
    "to make_gloo_group and to the colocated policy ranks' dist.new_group)",
    (
        "rollout/base.py",
        "generate",
        "asyncio.gather(*(self._group(list(ids), sampling, index) for index, ids in zip(indices, prompt_token_ids)))",
    ): "the engine's own prompt groups, computed where the engine runs; the callers that wait on an engine "
    "from another process or thread bound the whole request by rollout.generate_timeout_s "
    "(RolloutPool.generate and collect, ModelWorker._on_engine_loop)",
    ("agents/sandbox.py", "_supervise", "r.result()"): "only for the output readers in the done set of the "
    "bounded asyncio.wait just before: they have finished",
    ("rl/episodes.py", "finished", "future.result()"): "only for the futures the bounded "
    "concurrent.futures.wait just before returned as done",
    ("rl/episodes.py", "collect_all", "f.result()"): "after a bounded concurrent.futures.wait that raises "
    "unless every future is done",
    (
        "rl/episodes.py",
        "_group",
        "asyncio.gather(*(self._episode(prompt, sampling, prompt_index * sampling.n + j, f'{where}, episode {j}') "
        "for j in range(sampling.n)))",
    ): "episodes, each bounded by its own limits (engine requests by rollout.generate_timeout_s, environment "
    "calls by agent.step_timeout_s, the whole by agent.episode_timeout_s); the caller waits with a timeout",
    ("rl/episodes.py", "cancel_all", "asyncio.gather(*tasks, return_exceptions=True)"): "cancelled tasks, "
    "awaited by close() through .result(timeout=timeout_s)",
}


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> full dotted name, from the module's imports (``dist`` -> ``torch.distributed``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(func: ast.expr, imported: dict[str, str]) -> str | None:
    """``dist.new_group`` -> ``torch.distributed.new_group``; None unless the chain starts at an imported name."""
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in imported:
        return None
    return ".".join([imported[func.id], *reversed(parts)])


def _has_timeout(call: ast.Call, position: int | None) -> bool:
    """Whether the call passes a timeout (an explicit ``None`` is no timeout)."""
    for keyword in call.keywords:
        if keyword.arg in ("timeout", "timeout_s"):
            return not (isinstance(keyword.value, ast.Constant) and keyword.value.value is None)
    if position is not None and len(call.args) > position:
        value = call.args[position]
        return not (isinstance(value, ast.Constant) and value.value is None)
    return False


def _is_unbounded_wait(call: ast.Call, imported: dict[str, str]) -> bool:
    name = _dotted(call.func, imported)
    if name in WAITING_FUNCTIONS:
        return not _has_timeout(call, WAITING_FUNCTIONS[name])
    if name in NEEDS_WAIT_FOR:
        return True
    if isinstance(call.func, ast.Attribute) and call.func.attr in WAITING_METHODS:
        method = call.func.attr
        if method in ("get", "join") and call.args:  # dict.get(key), str.join(parts), ...
            return False
        if method == "get" and any(
            k.arg == "block" and isinstance(k.value, ast.Constant) and k.value.value is False for k in call.keywords
        ):  # queue.get(block=False) does not wait
            return False
        return not _has_timeout(call, WAITING_METHODS[method])
    return False


def _bounded_by_wait_for(tree: ast.AST, imported: dict[str, str]) -> set[int]:
    """The awaitables handed to an ``asyncio.wait_for`` with a timeout (ids of their nodes)."""
    return {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.args
        and _dotted(node.func, imported) == "asyncio.wait_for"
        and _has_timeout(node, WAITING_FUNCTIONS["asyncio.wait_for"])
    }


def unbounded_waits(source: str, path: str = "<source>") -> list[tuple[str, int, str, str]]:
    """``(path, line, enclosing function, call text on one line)`` of every wait in ``source`` without a timeout."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    bounded = _bounded_by_wait_for(tree, imported)
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and id(child) not in bounded and _is_unbounded_wait(child, imported):
                text = ast.unparse(child)  # the same text however the call is laid out
                found.append((path, child.lineno, function, text))
            visit(child, inner)

    visit(tree, "<module>")
    return found


@functools.cache
def package_waits() -> list[tuple[str, int, str, str]]:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        found += unbounded_waits(file.read_text(), file.relative_to(PACKAGE).as_posix())
    return found


def test_every_wait_in_the_package_has_a_timeout():
    unbounded = [
        f"raylign/{path}:{line}: {call}"
        for path, line, function, call in package_waits()
        if (path, function, call) not in ALLOWED
    ]
    assert not unbounded, (
        "waits without a timeout (pass one, configurable where a user may need longer; or "
        "add the call to ALLOWED with the reason it is bounded anyway):\n" + "\n".join(unbounded)
    )


def test_every_allowed_wait_still_exists():
    present = {(path, function, call) for path, _, function, call in package_waits()}
    assert set(ALLOWED) <= present, f"ALLOWED lists waits that are gone: {sorted(set(ALLOWED) - present)}"


def test_the_check_flags_a_ray_get_without_timeout_and_only_that():
    source = "import ray\n\ndef f(x):\n    a = ray.get(x)\n    b = ray.get(x, timeout=3)\n    return a, b\n"
    assert unbounded_waits(source) == [("<source>", 4, "f", "ray.get(x)")]


@pytest.mark.parametrize(
    "call, unbounded",
    [
        ("dist.new_group(backend='gloo')", True),
        ("dist.new_group(backend='gloo', timeout=t)", False),
        ("ray.wait(refs, timeout=None)", True),
        ("proc.wait()", True),
        ("proc.wait(5)", False),
        ("thread.join()", True),
        ("thread.join(5)", False),
        ("', '.join(parts)", False),
        ("queue.get()", True),
        ("queue.get(timeout=1)", False),
        ("queue.get(block=True)", True),
        ("queue.get(block=False)", False),
        ("row.get('key')", False),
        ("future.result()", True),
        ("proc.communicate(data)", True),
        ("proc.communicate(data, 5)", False),
        ("subprocess.run(['ls'])", True),
        ("asyncio.gather(*tasks)", True),
        ("asyncio.wait_for(asyncio.gather(*tasks), timeout=5)", False),
        ("asyncio.wait_for(event.wait(), 5)", False),
        ("urlopen(url)", True),
        ("urlopen(url, None, 5)", False),
    ],
)
def test_the_check_knows_each_kind_of_wait(call, unbounded):
    source = (
        "import asyncio, subprocess, ray\nimport torch.distributed as dist\n"
        f"from urllib.request import urlopen\n{call}\n"
    )
    assert bool(unbounded_waits(source)) is unbounded


def test_a_worker_call_past_its_timeout_names_the_method_the_rank_and_the_setting(ray_session):
    import ray

    from raylign.cluster import wait_until_ready
    from raylign.rl.group import WorkerGroup

    @ray.remote(num_cpus=0)
    class Sleeper:
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    group = WorkerGroup.__new__(WorkerGroup)  # a group of these actors, without the model workers' start-up
    group.role, group.workers, group.call_timeout_s = "policy", [Sleeper.remote(), Sleeper.remote()], 2.0
    try:
        wait_until_ready({f"sleeper {rank}": worker for rank, worker in enumerate(group.workers)}, 120)
        assert group.call_sharded("nap", [0.0, 0.5]) == [0.0, 0.5]
        started = time.monotonic()
        with pytest.raises(TimeoutError) as raised:
            group.call_sharded("nap", [0.0, 30.0])
        assert time.monotonic() - started < 10
    finally:
        group.kill()
    message = str(raised.value)
    assert "nap" in message and "rank 1" in message and "rank 0" not in message
    assert "placement.worker_call_timeout_s" in message


def test_a_colocated_engine_call_past_its_timeout_names_the_call_the_rank_and_the_setting():
    """A policy worker waits on its colocated engine's loop (a thread of its own) at most
    rollout.generate_timeout_s; the error names the engine's method, or the weight sync it was loading."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from raylign.rl.worker import ModelWorker

    class Engine:
        async def generate(self, seconds: float) -> float:
            await asyncio.sleep(seconds)
            return seconds

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker = ModelWorker.__new__(ModelWorker)  # the engine's side of a worker, without its model
    worker.rank, worker._engine_loop = 1, loop
    worker.cfg = SimpleNamespace(rollout=SimpleNamespace(generate_timeout_s=0.5))
    try:
        assert worker._on_engine_loop(Engine().generate(0.0)) == 0.0
        for what, named in ((None, "Engine.generate"), ("loading weight sync 3", "loading weight sync 3")):
            started = time.monotonic()
            with pytest.raises(TimeoutError) as raised:
                worker._on_engine_loop(Engine().generate(30.0), what)
            assert time.monotonic() - started < 5
            message = str(raised.value)
            assert message.startswith(f"policy rank 1: its colocated rollout engine did not finish {named} within")
            assert "rollout.generate_timeout_s" in message
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_sync_group_that_never_forms_is_named_with_its_engine_store_and_setting(ray_session):
    """The engine's call to join returned, yet its workers never reached the group (gloo's own ports
    blocked between nodes, say): the sender's side fails at rollout.sync_timeout_s with an error that says
    which group, not gloo's bare one."""
    import ray

    from raylign.rollout.weight_sync import WeightSyncSender, open_group_as_sender

    sender = WeightSyncSender.__new__(WeightSyncSender)  # the group-forming step alone, without engines
    sender.timeout_s = 2.0
    store, port = open_group_as_sender("127.0.0.1", 2, sender.timeout_s)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        sender._group_once_joined(store, 2, ray.put(None), 3)
    assert time.monotonic() - started < 30
    message = str(raised.value)
    assert message.startswith(
        f"weight sync: the sync group with engine 3 (world size 2, store 127.0.0.1:{port}) did not form within "
        "rollout.sync_timeout_s=2 s: "
    )
    assert raised.value.__cause__ is not None
