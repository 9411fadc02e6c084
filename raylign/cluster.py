"""Ray for every raylign command: start a local Ray or join a cluster, and wait for actors with a limit.

A local Ray is started here, in one way, whatever the caller's environment holds:
``address="local"`` (a ``RAY_ADDRESS`` left in the environment does not redirect it),
Ray's own authentication default, and actor environments that never override it (a worker
told ``RAY_AUTH_MODE=disabled`` by its runtime environment cannot reach a head that uses
tokens, and Ray then retries its start for minutes). Joining a cluster leaves its
authentication alone: the token comes from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token`` as Ray reads them.

Every wait for actors to come up has a limit; past it the error names the actor, its node,
its state and the last error lines Ray logged on this machine. Every wait for their answers
has one too (:func:`get_within`); past it the error names the call, the actors still busy
with it and the setting that sets the limit.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("raylign")

# One thread per actor: several actors each using every core slow one another down many times over.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# glibc's malloc hands every block over 32 MiB (logits, the output layer's gradient) back to the kernel
# on free and maps fresh pages for the next; each first write to a fresh page faults, which on the
# 2-core test machine made a training step's forward 2-4x slower (``benchmarks/README.md``). Large
# blocks come from the heap instead and the heap is never shrunk, so later steps write into pages
# they used before. The price: an actor's resident memory stays at its peak.
REUSE_FREED_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"
# mallopt's parameter numbers (glibc's malloc.h) for the same two settings in a running process.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# Environment variables that must never reach an actor's runtime environment (see the module docstring).
NEVER_IN_ACTOR_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# How long a failed call waits to see whether a peer still computing died (the likelier cause).
PEER_DEATH_GRACE_S = 5.0


class StartupError(RuntimeError):
    """An actor, engine or worker did not come up (it failed, or did not answer in time).

    ``cause`` is the failed constructor's own error in one line, or None after a timeout."""

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


class ActorDied(RuntimeError):
    """An actor's process died while a caller waited for its answer (:func:`get_within`).

    ``name`` is the caller's name for it (``"rank 1 of 2"``, ``"engine 0"``) and ``index`` its
    position among the refs waited for."""

    def __init__(self, message: str, name: str, index: int):
        super().__init__(message)
        self.name = name
        self.index = index


def actor_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``env_vars`` of an actor's runtime environment: :data:`WORKER_ENV`, glibc's allocator told
    to reuse freed memory (:data:`REUSE_FREED_MEMORY`; a ``GLIBC_TUNABLES`` of the caller's own,
    empty included, is passed on instead), plus ``extra``."""
    tunables = os.environ.get("GLIBC_TUNABLES", REUSE_FREED_MEMORY)
    env = {**WORKER_ENV, "GLIBC_TUNABLES": tunables, **(extra or {})}
    for key in NEVER_IN_ACTOR_ENV:
        env.pop(key, None)
    return env


def reuse_freed_memory() -> bool:
    """Give this process what :data:`REUSE_FREED_MEMORY` gives every actor, through glibc's
    ``mallopt`` (the environment is read only at a process's start): used by every raylign command,
    whose process trains when it runs on one rank. The heap is then trimmed only past 2 GiB free
    (``mallopt`` takes an int). Nothing is changed when the caller set ``GLIBC_TUNABLES`` (empty:
    glibc's defaults) or the C library is not glibc; returns whether it was changed."""
    import ctypes

    if "GLIBC_TUNABLES" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def start_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Start a local Ray (``address`` None) or join the cluster at ``address``.

    Returns True when this call started or joined Ray (the caller shuts it down), False when
    Ray was already initialised in this process (a notebook, a test session) and is used as it is.
    """
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": actor_env()}
    if address is None:
        ray.init(
            address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, runtime_env=runtime_env
        )
        return True
    try:
        ray.init(address=address, include_dashboard=False, runtime_env=runtime_env)
    except (ConnectionError, RuntimeError) as err:
        raise ConnectionError(_join_failure_message(address, err)) from err
    return True


def _join_failure_message(address: str, err: Exception) -> str:
    text = str(err)
    hint = "check that the cluster is running (`ray status` on its head node) and that this machine can reach it"
    if any(word in text for word in ("Unauthenticated", "InvalidAuthToken", "auth")):
        hint = (
            "the cluster uses token authentication: set RAY_AUTH_MODE=token and the cluster's token in "
            "RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token); "
            "`ray get-auth-token` on the head node prints it"
        )
    first_line = text.splitlines()[0] if text else repr(err)
    return f"could not join the Ray cluster at placement.ray_address={address!r}: {first_line}. Fix: {hint}"


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Ray for the block; a Ray started (or joined) here is shut down when the block ends."""
    import ray

    started = start_ray(address, num_cpus)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def wait_until_ready(
    actors: Mapping[str, Any],
    timeout_s: float,
    setting: str = "placement.startup_timeout_s",
    ready: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Wait until every actor in ``actors`` (name -> handle) has started, for at most ``timeout_s``.

    ``ready`` optionally maps a name to the object ref to wait for instead of the actor's
    ``__ray_ready__`` (for example an engine's first call, which returns once its model is
    loaded). Returns the results in the order of ``actors``. Raises :class:`StartupError`
    naming the first actor that failed (with the cause Ray reported) or, at the limit, every
    actor still pending with its state, node and the error lines Ray logged here.
    """
    import ray

    started = time.time()
    refs = {name: (ready or {}).get(name) or handle.__ray_ready__.remote() for name, handle in actors.items()}
    names = {ref: name for name, ref in refs.items()}
    pending = list(refs.values())
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            break
        name = names[done[0]]
        try:
            results[name] = ray.get(done[0], timeout=60)  # ready, so only fetching the result remains
        except Exception as err:  # the actor's constructor raised, or its process died
            cause = remote_cause(err)
            raise StartupError(f"{name} failed to start: {cause}", cause) from err
    if pending:
        lines = [f"{names[ref]}: {describe_actor(actors[names[ref]])}" for ref in pending]
        excerpt = ray_error_log_excerpt(since=started)
        raise StartupError(
            f"{len(pending)} of {len(actors)} actors did not start within {timeout_s:g} s ({setting}):\n  "
            + "\n  ".join(lines)
            + (
                "\nlast errors in Ray's logs on this machine:\n  " + "\n  ".join(excerpt)
                if excerpt
                else "\nRay logged no errors on this machine; a busy or too small cluster can leave actors waiting "
                "for resources (`ray status` shows them)"
            )
        )
    return [results[name] for name in actors]


def start_together(starts: Mapping[str, Callable[[], Any]]) -> tuple[dict[str, Any], BaseException | None]:
    """Run every start at once, each in a thread of its own, and wait for all of them: what each started,
    by name, and the first error one raised (None when all started). Each start bounds its own wait, as
    :func:`wait_until_ready` does, so this waits no longer than the slowest of them. What did start is
    returned even when another start failed, for the caller to stop."""
    if not starts:
        return {}, None
    with ThreadPoolExecutor(max_workers=len(starts), thread_name_prefix="start") as pool:
        futures = {name: pool.submit(start) for name, start in starts.items()}
    # The pool's exit waited for every start: each future is done, so none of these waits.
    failures = {name: future.exception(timeout=0) for name, future in futures.items()}
    started = {name: futures[name].result(timeout=0) for name, error in failures.items() if error is None}
    errors = [error for error in failures.values() if error is not None]
    return started, errors[0] if errors else None


def get_within(refs: Any, timeout_s: float, what: str, setting: str, names: Sequence[str] | None = None) -> Any:
    """``ray.get(refs)`` (one ref or a list of them), waiting at most ``timeout_s`` in all.

    ``what`` says what the refs are the results of (``"policy workers' train_policy"``) and
    ``names`` who computes each one (default ``call 0``, ``call 1``, ...). A call that failed
    raises its error as soon as it is known, not after the others finish; at the limit a
    TimeoutError names ``what``, the callees still busy and ``setting``, the option to raise.
    """
    import ray

    single = isinstance(refs, ray.ObjectRef)
    refs = [refs] if single else list(refs)
    names = list(names) if names is not None else [f"call {i}" for i in range(len(refs))]
    deadline = time.monotonic() + timeout_s
    results: dict[Any, Any] = {}
    pending = refs
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            busy = [name for ref, name in zip(refs, names) if ref not in results]
            raise TimeoutError(
                f"{what}: no answer within {timeout_s:g} s from {', '.join(busy)}; raise {setting} "
                "if it needs longer, or check their logs"
            )
        try:
            results[done[0]] = ray.get(done[0], timeout=max(0.0, deadline - time.monotonic()))  # raises its error
        except ray.exceptions.RayActorError as err:
            raise _died(what, refs, names, done[0], err) from err
        except ray.exceptions.RayTaskError as err:
            # A rank's collective fails when a peer dies: if one of the calls still pending died, that
            # death is the cause to report.
            grace = min(PEER_DEATH_GRACE_S, max(0.0, deadline - time.monotonic()))
            settled, _ = ray.wait(pending, num_returns=len(pending), timeout=grace) if pending else ([], [])
            for ref in settled:
                try:
                    ray.get(ref, timeout=1)
                except ray.exceptions.RayActorError as death:
                    raise _died(what, refs, names, ref, death) from err
                except Exception:  # another rank's own failure: the first one is reported
                    continue
            raise
    values = [results[ref] for ref in refs]
    return values[0] if single else values


def _died(what: str, refs: list[Any], names: list[str], ref: Any, err: Exception) -> ActorDied:
    index = refs.index(ref)
    return ActorDied(f"{what}: {names[index]} died while computing it ({death_cause(err)})", names[index], index)


def death_cause(err: Exception) -> str:
    """Why an actor died, in one line, from Ray's error: its exit detail, else its first line."""
    text = str(err)
    for marker in ("Worker exit detail:", "exit detail:"):
        if marker in text:
            detail = text.split(marker, 1)[1].strip().split(". ")[0].splitlines()[0]
            return f"its process exited: {detail}" if detail else "its process exited"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or type(err).__name__


def remote_cause(err: BaseException) -> str:
    """The innermost useful line of a Ray actor error: the exception the constructor raised, if any."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        return f"{type(cause).__name__}: {cause}"
    text = str(err).strip()
    # RayTaskError text ends with the original exception's last line.
    last = [line for line in text.splitlines() if line.strip()]
    return last[-1].strip() if last else repr(err)


def describe_actor(handle: Any) -> str:
    """One line: the actor's state, its node and death cause, from Ray's control store."""
    import ray

    try:
        info = ray._private.state.actors(handle._actor_id.hex())
    except Exception as err:  # the control store itself may be unreachable
        return f"state unknown ({err})"
    state = info.get("State", "unknown")
    node = info.get("Address", {}).get("IPAddress") or "no node yet"
    text = f"state {state}, node {node}"
    if state == "PENDING_CREATION":
        text += " (its worker process has not started, or is still starting)"
    if info.get("DeathCause"):
        text += f", death cause: {str(info['DeathCause'])[:300]}"
    return text


def ray_session_logs() -> str | None:
    """The log folder of this machine's Ray session (each worker's output is ``worker-*.out`` and
    ``worker-*.err`` there), or None without a session."""
    import ray

    try:
        node = ray._private.worker._global_node  # Ray has no public API for its session folder
        return os.path.join(node.get_session_dir_path(), "logs")  # type: ignore[attr-defined]
    except Exception:
        return None


def ray_error_log_excerpt(since: float = 0.0, limit: int = 8) -> list[str]:
    """The last ``limit`` distinct error lines in this machine's Ray session logs written after ``since``."""
    logs = ray_session_logs()
    if logs is None:
        return []
    words = ("Error", "error:", "Failed", "failed", "Unauthenticated", "Traceback", "Exception")
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(logs, "raylet.err")) + glob.glob(os.path.join(logs, "worker-*.err"))):
        try:
            if os.path.getmtime(path) < since:
                continue
            with open(path, errors="replace") as f:
                lines += [line.strip() for line in f if any(w in line for w in words) and "Traceback" not in line]
        except OSError:
            continue
    unique = list(dict.fromkeys(lines))
    return [line[:300] for line in unique[-limit:]]
