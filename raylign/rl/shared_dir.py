"""Whether a run's output folder is one folder for every node of the run, checked before it trains.

The controller and every training worker write into ``train.output_dir``: each rank its part of
a checkpoint, the controller the marker that completes it and its own state, policy rank 0 the
final export; a resumed run reads them all back. On several nodes the folder must therefore be
on a filesystem every node mounts at the same path (NFS, a parallel or cloud filesystem), or the
first checkpoint fails, or worse, a resume finds half of one.

On one node the check costs nothing. On several, each node of the run (those hosting workers,
and the controller's) writes a file named after itself into a fresh subfolder, from a zero-CPU
Ray task pinned to that node; then each node looks every other node's file up by name. A file
is looked up by name, never found by listing the folder, and looked for again for a few seconds
before it counts as missing: NFS clients cache directory listings, not names never looked up.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raylign.cluster import get_within

log = logging.getLogger("raylign")

CHECK_FOLDER = ".raylign_shared_check"
# How long a node keeps looking for another node's file before it counts as missing.
SETTLE_S = 5.0


class SharedDirectoryError(RuntimeError):
    """The nodes of a run do not see one another's files in the folder the run writes to."""


def check_shared_directory(
    directory: str | Path, nodes: set[str], setting: str, timeout_s: float, settle_s: float = SETTLE_S
) -> None:
    """Fail, naming the nodes and ``setting``, unless every node in ``nodes`` and the controller's
    own node see the same ``directory``. Nothing happens when they are all one node."""
    import ray

    nodes = set(nodes) | {ray.get_runtime_context().get_node_id()}
    if len(nodes) == 1:
        return
    check_views({node: str(directory) for node in nodes}, setting, timeout_s, settle_s)


def check_views(views: Mapping[str, str], setting: str, timeout_s: float, settle_s: float = SETTLE_S) -> None:
    """The check itself, where node ``n`` sees the folder as ``views[n]`` (the same path on every
    node in a run; a test gives each node a folder of its own to see how a node-local disk fails).

    Each node writes its file, then looks up everyone's; the files are removed afterwards."""
    import ray

    token = uuid.uuid4().hex
    nodes = sorted(views)
    what = f"{setting}: checking that every node sees the same folder"

    def on_each_node(function: Any, *args: Any) -> list[Any]:
        """``function(views[node], token, node, *args)`` on every node, in ``nodes`` order."""
        remote = ray.remote(function)
        refs = [
            remote.options(num_cpus=0, scheduling_strategy=_on_node(node)).remote(views[node], token, node, *args)
            for node in nodes
        ]
        return get_within(refs, timeout_s, what, "placement.startup_timeout_s", [f"node {n}" for n in nodes])

    try:
        failed = on_each_node(write_marker)
        unwritable = {node: cause for node, cause in zip(nodes, failed) if cause is not None}
        if unwritable:
            raise SharedDirectoryError(_unwritable_message(unwritable, views, setting))
        seen = on_each_node(markers_seen, nodes, settle_s)
    finally:
        try:
            on_each_node(remove_marker)
        except Exception as err:  # a leftover file is harmless; the check's own outcome matters
            log.warning("%s: could not remove the check's files (%s)", setting, str(err).splitlines()[0])
    missing = {node: sorted(set(nodes) - set(found)) for node, found in zip(nodes, seen) if set(nodes) - set(found)}
    if missing:
        raise SharedDirectoryError(_not_shared_message(missing, views, setting))


def _on_node(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


def _folder(directory: str, token: str) -> Path:
    return Path(directory) / CHECK_FOLDER / token


def write_marker(directory: str, token: str, node: str) -> str | None:
    """On node ``node``: write its file; None, or why it could not."""
    try:
        folder = _folder(directory, token)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / node).write_text(node)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def markers_seen(directory: str, token: str, node: str, nodes: list[str], settle_s: float) -> list[str]:
    """The nodes among ``nodes`` whose files node ``node`` sees, looking again for up to ``settle_s`` seconds."""
    folder = _folder(directory, token)
    deadline = time.monotonic() + settle_s
    while True:
        seen = [other for other in nodes if (folder / other).is_file()]
        if len(seen) == len(nodes) or time.monotonic() >= deadline:
            return seen
        time.sleep(0.2)


def remove_marker(directory: str, token: str, node: str) -> None:
    """Remove this node's file, and the check's folders once empty (whichever node empties them)."""
    folder = _folder(directory, token)
    (folder / node).unlink(missing_ok=True)
    for empty in (folder, folder.parent):
        try:
            empty.rmdir()
        except OSError:  # another node's file is still there, or the folder is gone already
            break


def _addresses() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}


def _name(node: str, addresses: dict[str, str]) -> str:
    return f"{addresses.get(node, '?')} (node {node[:8]})"


def _not_shared_message(missing: dict[str, list[str]], views: Mapping[str, str], setting: str) -> str:
    addresses = _addresses()
    lines = [
        f"{_name(node, addresses)} does not see the files written by "
        + ", ".join(_name(other, addresses) for other in others)
        for node, others in missing.items()
    ]
    return (
        f"{setting} {_folders(views)} is not one folder shared by the nodes of this run:\n  "
        + "\n  ".join(lines)
        + f"\nEvery training worker and the controller write checkpoints there and read them back on resume: "
        f"set {setting} to a folder on a filesystem every node mounts at the same path (NFS, a parallel or "
        "cloud filesystem), or place the whole run on one node"
    )


def _unwritable_message(causes: dict[str, str], views: Mapping[str, str], setting: str) -> str:
    addresses = _addresses()
    lines = [f"{_name(node, addresses)}: {cause}" for node, cause in causes.items()]
    return (
        f"{setting} {_folders(views)} cannot be written on every node of this run:\n  "
        + "\n  ".join(lines)
        + f"\nset {setting} to a folder every node can write, on a filesystem they all mount at the same path"
    )


def _folders(views: Mapping[str, str]) -> str:
    """The folder, or each node's view of it when they differ."""
    distinct = sorted(set(views.values()))
    return distinct[0] if len(distinct) == 1 else "(" + ", ".join(distinct) + ")"
