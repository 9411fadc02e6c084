"""Atomic training checkpoints.

Layout: the checkpoint of optimizer step N is ``<root>/step_<N>/``. It is written into
``<root>/.step_<N>.tmp/`` and renamed into place only once every rank has finished and rank 0
has written ``COMPLETE`` inside it. A crash at any point before ``COMPLETE`` leaves only an
unmarked temp folder, which :func:`latest_checkpoint` ignores, so resume always picks a whole
checkpoint; one after it, before the rename (while an older checkpoint of the same step is moved
aside), leaves a marked temp folder, which counts as that step's checkpoint. The folder must be on
a filesystem all ranks share (the RL controller checks that at start when its workers span several
nodes).

Inside a checkpoint, besides the backend's own files (``engine_state.pt`` for ``local``, a
DCP folder for ``fsdp2``, DeepSpeed's files for ``deepspeed``):

- ``meta.json``: backend and world size (resume must use the same world size), and every other
  file with its size (a resume refuses a checkpoint with one missing or of another size);
- ``scheduler.pt``: the learning-rate scheduler;
- ``rng_rank<r>.pt``: python, numpy, torch (and CUDA) generator states of rank r;
- ``client_state_rank<r>.pt``: the caller's dict (loader position, step counters) of rank r;
- ``COMPLETE``: written last.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml

from raylign.engine.distributed import barrier, broadcast_object, get_rank, get_world_size, is_main_process
from raylign.files import read_json_object

if TYPE_CHECKING:
    from raylign.engine.base import TrainEngine

COMPLETE_MARKER = "COMPLETE"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_DIR = re.compile(r"^\.step_(\d+)\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, or written: names the folder and what is wrong."""


def check_writable(folder: str | Path, setting: str) -> None:
    """Create ``folder`` and write a file in it, so that an output folder that cannot be written
    stops a run before it trains, not at its first save; the error names ``setting``."""
    folder = Path(folder)
    probe = folder / f".write_test_{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(
            f"{setting} {folder} cannot be written ({err.strerror or err}); choose another "
            "folder or make this one writable"
        ) from None


def check_resumes_same_model(output_dir: str | Path, model_path: str, resume: bool) -> None:
    """Before a run writes its config into ``output_dir``: a run that would resume a checkpoint there
    must train the model the run that wrote it trained (``model.path`` of the ``config.yaml`` beside
    it), else it would silently go on training those weights and never load ``model_path``."""
    output_dir = Path(output_dir)
    saved = output_dir / "config.yaml"
    if not resume or not saved.is_file() or latest_checkpoint(output_dir / "checkpoints") is None:
        return
    try:
        previous = (yaml.safe_load(saved.read_text()) or {}).get("model", {}).get("path")
    except (yaml.YAMLError, AttributeError, OSError):
        return  # not a config this project wrote: nothing to compare
    if previous is None or previous == model_path or Path(previous).resolve() == Path(model_path).resolve():
        return
    raise ValueError(
        f"train.output_dir {output_dir} holds checkpoints of a run of the model {previous!r}, and this run's "
        f"model.path is {model_path!r}: it would resume those weights instead of loading the model. Choose "
        "another train.output_dir, or set train.resume false to start over in this one"
    )


def step_directory(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def temp_directory(final: str | Path) -> Path:
    """Where a checkpoint is assembled before it is renamed to ``final``."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp"


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / COMPLETE_MARKER).is_file()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint under ``root``, oldest first: the marked
    ``step_<N>`` folders, and a marked ``.step_<N>.tmp`` where its save stopped before renaming it
    into place (the ``step_<N>`` it replaced already moved aside)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    unrenamed: dict[int, Path] = {}
    for child in root.iterdir():
        named, temp = _STEP_DIR.match(child.name), _TEMP_DIR.match(child.name)
        if (named or temp) and child.is_dir() and is_complete(child):
            (found if named else unrenamed)[int((named or temp).group(1))] = child  # type: ignore[union-attr]
    return sorted({**unrenamed, **found}.items())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete ``step_<N>`` folder under ``root``; temp and unmarked folders are ignored."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | Path, keep_last: int, newest: int | None = None) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints and leftover temp folders.

    ``newest``: the step just saved. Checkpoints of later steps are deleted first: they belong to a
    run this one started over from in the same folder (``train.resume: false``; a resumed run starts
    from the newest), and kept they would push the checkpoints of this run out (the one just written
    first) and be what the next resume continues.

    Rank 0 only; call it when no save is in progress. ``keep_last <= 0`` keeps everything else.
    """
    removed: list[Path] = []
    root = Path(root)
    checkpoints = complete_checkpoints(root)
    if newest is not None:
        for step, folder in checkpoints:
            if step > newest:
                shutil.rmtree(folder)
                removed.append(folder)
        checkpoints = [(step, folder) for step, folder in checkpoints if step <= newest]
    if keep_last > 0:
        for _, folder in checkpoints[:-keep_last]:
            shutil.rmtree(folder)
            removed.append(folder)
    kept = {folder for _, folder in checkpoints}
    for pattern in (".step_*.tmp", ".step_*.old"):  # left by crashes during a save or a replace
        for stale in root.glob(pattern):
            if stale not in kept and stale.exists():
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale)
    return removed


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare_temp_directory(final: Path) -> Path:
    temp = temp_directory(final)
    if is_main_process():
        final.parent.mkdir(parents=True, exist_ok=True)
        if temp.exists():
            shutil.rmtree(temp)  # left by an earlier crash
        temp.mkdir()
    barrier()
    return temp


def _commit(temp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0: mark ``temp`` complete, then rename it onto ``final`` (replacing an older one)."""
    # Flush every file before the marker, so that even a machine crash (not only a process
    # crash) cannot leave a marked checkpoint with missing data. meta.json lists each with its
    # size: a copy cut short keeps the marker, which sorts first, and a resume checks the rest.
    files = {}
    for folder, _, names in os.walk(temp):
        for name in names:
            path = Path(folder) / name
            _fsync_path(path)
            files[path.relative_to(temp).as_posix()] = path.stat().st_size
    (temp / META_FILE).write_text(json.dumps({**meta, "files": dict(sorted(files.items()))}, indent=2))
    _fsync_path(temp / META_FILE)
    marker = temp / COMPLETE_MARKER
    marker.write_text("ok\n")
    _fsync_path(marker)
    _fsync_path(temp)
    replaced = final.parent / f".{final.name}.old"
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        final.rename(replaced)
    temp.rename(final)
    _fsync_path(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def write_atomically(final: str | Path, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Collective: every rank calls ``write(temp_folder)``; the folder appears at ``final`` when all are done."""
    final = Path(final)
    temp = _prepare_temp_directory(final)
    try:
        write(temp)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
        raise _not_written(final, temp, err) from err
    barrier()
    if is_main_process():
        try:
            _commit(temp, final, meta)
        except OSError as err:
            raise _not_written(final, temp, err) from err
    barrier()
    return final


def _not_written(final: Path, temp: Path, err: Exception) -> CheckpointError:
    """The error for a checkpoint that could not be written; its partial folder is removed (the
    space goes back, and nothing half-written is left beside the whole checkpoints)."""
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    shutil.rmtree(temp, ignore_errors=True)
    # torch.save reports a full disk as a failed write ("unexpected pos ..."), without ENOSPC.
    full = getattr(err, "errno", None) == errno.ENOSPC or (free is not None and free < 2**20)
    where = (
        f"the filesystem is full ({free / 2**20:.1f} MiB free)"
        if full
        else f"{free / 2**20:.0f} MiB free there"
        if free is not None
        else "free space unknown"
    )
    return CheckpointError(
        f"checkpoint {final.name} could not be written in {final.parent}: {where}; {err}. "
        "The checkpoints before it are whole: make room (or move the output folder) and run "
        "again to resume from the newest"
    )


def read_meta(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    if not is_complete(directory):
        raise CheckpointError(
            f"checkpoint {directory} is incomplete or missing (no {COMPLETE_MARKER} marker); "
            "use latest_checkpoint(root) to find a usable one"
        )
    try:
        meta = read_json_object(directory / META_FILE)
    except ValueError as err:
        raise _damaged(directory, str(err)) from None
    _check_files(directory, meta.get("files"))
    return meta


def _check_files(directory: Path, files: Any) -> None:
    """Every file the checkpoint was written with is there, at the size it was written (checkpoints
    written without the list are not checked)."""
    if files is None:
        return
    if not isinstance(files, dict) or not all(isinstance(size, int) for size in files.values()):
        raise _damaged(directory, f"{META_FILE}: 'files' is not a mapping of file names to sizes")
    for name, size in files.items():
        try:
            found = (directory / name).stat().st_size
        except FileNotFoundError:
            raise _damaged(directory, f"{name} is missing") from None
        if found != size:
            raise _damaged(directory, f"{name} is {found} bytes, {size} when written")


def _damaged(directory: Path, problem: str) -> CheckpointError:
    # A copy (cp -r, rsync) cut short can hold the marker without the files that sort after it.
    return CheckpointError(
        f"checkpoint {directory} is damaged: {problem}. Delete this folder to resume from the checkpoint before it"
    )


def load_file(directory: Path, name: str, weights_only: bool = True) -> Any:
    """``torch.load`` of the checkpoint file ``name``; one missing or unreadable is a CheckpointError naming it."""
    path = directory / name
    try:
        return torch.load(path, weights_only=weights_only)
    except FileNotFoundError:
        raise _damaged(directory, f"{name} is missing") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise _damaged(directory, f"{name} cannot be read ({first_line})") from None


# --------------------------------------------------------------------------- RNG and client state


def capture_rng_state() -> dict[str, Any]:
    """Generator states of python, numpy, torch and (if present) every CUDA device."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    saved = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": saved["bit_generator"],
            "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
            "has_gauss": saved["has_gauss"],
            "gauss": saved["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rank_state(directory: Path, client_state: dict[str, Any]) -> None:
    """This rank's RNG states and the caller's dict."""
    rank = get_rank()
    torch.save(capture_rng_state(), directory / f"rng_rank{rank}.pt")
    torch.save(client_state, directory / f"client_state_rank{rank}.pt")


def load_rank_state(directory: Path) -> dict[str, Any]:
    """Restore this rank's RNG states; returns the caller's dict."""
    rank = get_rank()
    rng_file = directory / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise CheckpointError(f"checkpoint {directory} has no state for rank {rank} ({rng_file.name} missing)")
    # The python generator state is a tuple of ints, which the safe loader accepts.
    restore_rng_state(load_file(directory, rng_file.name))
    # The caller's dict may hold any picklable object; this run wrote it itself.
    return load_file(directory, f"client_state_rank{rank}.pt", weights_only=False)


def check_world_size(directory: Path, meta: dict[str, Any], backend: str) -> None:
    world_size = get_world_size()
    if meta.get("backend") != backend:
        raise CheckpointError(
            f"checkpoint {directory} was written by the {meta.get('backend')!r} backend; this run uses {backend!r}"
        )
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint {directory} was written by {meta.get('world_size')} ranks; this run has {world_size}. "
            "Resume with the same number of processes (or export and restart from the weights)."
        )


# --------------------------------------------------------------------------- step-level helpers


def save_step_checkpoint(
    engine: TrainEngine, root: str | Path, step: int, client_state: dict[str, Any], keep_last: int = 0
) -> Path:
    """Collective: save ``<root>/step_<step>`` atomically, then prune to the ``keep_last`` newest (and drop
    any of a later step, see :func:`prune_checkpoints`)."""
    final = step_directory(root, step)
    engine.save_checkpoint(final, client_state)
    if is_main_process():
        prune_checkpoints(root, keep_last, newest=step)
    barrier()
    return final


def resume_latest(engine: TrainEngine, root: str | Path) -> dict[str, Any] | None:
    """Collective: load the newest complete checkpoint under ``root``; None when there is none."""
    # Rank 0 decides and tells the others, so all ranks load the same folder even if the
    # listing changes under them.
    latest = broadcast_object(latest_checkpoint(root) if is_main_process() else None)
    if latest is None:
        return None
    return engine.load_checkpoint(latest)
