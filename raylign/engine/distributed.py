"""Process-group set-up and the few collectives trainers need outside the engines.

Works the same under ``torchrun`` and inside Ray actors: both set ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK`` (Ray callers set them by hand). Without
``WORLD_SIZE`` everything is a single process and the helpers are no-ops.

Ray callers rendezvous through a store that rank 0 hosts on its own node before anyone dials it
(:func:`host_rendezvous_store`, :func:`join_rendezvous_store`): the address is the one rank 0
reports, wherever Ray placed it, and its port is taken before it is handed out.

On CPU the backend is gloo. On CUDA it is ``cpu:gloo,cuda:nccl``: nccl for GPU tensors, gloo
for the CPU tensors that CPU-offloaded optimizers and small metric reductions use.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min"]
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _env_int(name: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={text!r} must be an integer") from None


def select_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when GPUs are visible, else the CPU.

    A Ray actor usually sees exactly one GPU (Ray sets ``CUDA_VISIBLE_DEVICES``), so with a
    single visible GPU the index is 0 whatever ``LOCAL_RANK`` says.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = 0 if count == 1 else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= count:
        raise RuntimeError(f"LOCAL_RANK={index} but only {count} GPUs are visible (CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(timeout_s: int = 1800, store: dist.Store | None = None) -> tuple[int, int, torch.device]:
    """Join the process group described by the environment; returns ``(rank, world_size, device)``.

    Without ``WORLD_SIZE`` in the environment this is a single process and no group is created.
    Calling it again after the group exists just reports the current values. ``store``: the
    rendezvous store to use instead of the one ``MASTER_ADDR`` / ``MASTER_PORT`` describe.
    """
    device = select_device()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    world_size = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if store is None and name not in os.environ:
            raise RuntimeError(f"WORLD_SIZE is set but {name} is not: set both MASTER_ADDR and MASTER_PORT")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        store=store,
    )
    return rank, world_size, device


def exit_process(code: int) -> NoReturn:
    """End this process now with exit status ``code``, without the interpreter's shutdown.

    For a rank whose work is done and whose outputs are written and closed. During the
    interpreter's shutdown a gloo worker thread of torch.distributed can still drop the last
    reference to a tensor that Python created; taking the GIL for it then ends the thread through
    ``pthread_exit``, which aborts the whole process ("terminate called without an active
    exception") and turns a finished run into a failed one. ``os._exit`` runs no shutdown: the logs
    and standard streams are flushed here, and the operating system closes the group's sockets.
    The group's rendezvous store must live elsewhere (torchrun's agent holds it): a rank that hosts
    the store and leaves at once can strand peers still talking to it.

    Leave the group alive: destroying it (``destroy_process_group``, or its last reference going)
    joins gloo's worker threads while holding the GIL, and a worker still releasing a finished
    collective's Python tensors waits for the GIL: the rank hangs.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):  # closed or gone: nothing left to flush
            stream.flush()
    os._exit(code)


def host_rendezvous_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's side of a rendezvous: a store listening on a port the OS picks on this machine.

    The socket is bound before its address is handed to the other ranks, so no other process
    can take the port in between. ``host`` is this machine's address as the others reach it.
    """
    return dist.TCPStore(
        host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_rendezvous_store(host: str, port: int, world_size: int, timeout_s: float, who: str) -> dist.TCPStore:
    """Another rank's side: connect to rank 0's store at ``host:port``, trying for at most ``timeout_s``.

    ``who`` names the caller in the error (``"policy rank 1 on node 10.0.0.2"``)."""
    try:
        return dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError is a RuntimeError
        raise RuntimeError(
            f"{who} could not reach the process group's rendezvous at {host}:{port} (hosted by rank 0 on its "
            f"node) within {timeout_s:g} s (engine.dist_timeout_s): {str(err).splitlines()[0] if str(err) else err}. "
            "That port must be open between the nodes of the cluster"
        ) from err


def ensure_process_group(timeout_s: int = 1800) -> tuple[int, int, torch.device]:
    """Like :func:`init_distributed`, but create a one-rank group when none is described.

    The sharded backends need a process group even when only one process runs
    (``raylign train ... --engine.backend fsdp2`` without torchrun).
    """
    if "WORLD_SIZE" in os.environ or (dist.is_available() and dist.is_initialized()):
        return init_distributed(timeout_s)
    device = select_device()
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # One rank has no one to meet: an in-process store, no port. A free port found first and bound
    # later could be taken in between by another process (seen as EADDRINUSE with tests side by side).
    dist.init_process_group(
        backend=backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return 0, 1, device


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0 (and in a single process): the rank that writes files and logs."""
    return get_rank() == 0


def barrier() -> None:
    if is_distributed() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s picklable ``obj`` on every rank (identity in a single process)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def broadcast_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0's named tensors (``named``; ignored elsewhere) on every rank, as CPU tensors, one at a
    time: a header of names, dtypes and shapes first, then each tensor broadcast over the default group
    on ``device`` (the group's device: a GPU under NCCL). Collective: every rank iterates it to the end."""
    main = is_main_process()
    tensors = dict(named) if main else {}
    header = broadcast_object([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()] if main else None)
    for name, dtype, shape in header:
        buffer = tensors.pop(name).to(device) if main else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buffer, src=0)
        yield name, buffer.cpu()
        del buffer


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: on a GPU the most its tensors took
    (``torch.cuda.max_memory_allocated``), on the CPU its peak resident size (``ru_maxrss``: tensors,
    the interpreter and the libraries together)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def all_reduce_scalars(values: Sequence[float], op: ReduceOp = "mean") -> list[float]:
    """Reduce python numbers across ranks in one collective (float64, so counts stay exact)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(tensor, op=_TORCH_OPS[op])
    if op == "mean":
        tensor /= dist.get_world_size()
    return tensor.tolist()


def sequence_parallel_groups(
    size: int, timeout_s: int, tensor_parallel: int = 1
) -> tuple[dist.ProcessGroup | None, int, int]:
    """Split the ranks into groups of ``size`` that share rows (sequence parallelism).

    Ranks are laid out data-parallel, then sequence-parallel, then tensor-parallel (the fastest):
    rank ``(d * size + s) * tensor_parallel + t`` runs chunk ``s`` of data-parallel shard ``d`` with
    slice ``t`` of every split matrix, so a group holds the ranks of one ``d`` and one ``t``
    (consecutive ranks without tensor parallel). Returns this rank's group (None when ``size`` is 1),
    its data-parallel rank and the data-parallel size. Collective: every rank creates every group,
    in the same order.
    """
    world, rank = get_world_size(), get_rank()
    copies = size * tensor_parallel  # ranks that share every micro-batch
    if world % copies:
        raise ValueError(
            f"engine.sequence_parallel_size x engine.tensor_parallel_size ({size} x {tensor_parallel}) must divide "
            f"the number of ranks ({world})"
        )
    if size == 1:
        return None, rank // copies, world // copies
    mine = None
    timeout = datetime.timedelta(seconds=timeout_s)
    for first in range(0, world, copies):
        for t in range(tensor_parallel):
            ranks = [first + s * tensor_parallel + t for s in range(size)]
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
    return mine, rank // copies, world // copies
