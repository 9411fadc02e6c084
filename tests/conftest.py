"""Suite-wide settings: one thread per process (2-core machines), no hub access."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# A test that reaches Ray without the ray_session fixture fails at once instead of starting a
# default local Ray (2 CPU slots) on which a later RL run in the same process waits until its
# startup timeout.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

import torch

from raylign.engine.deepspeed import torch_extensions_dir
from raylign.hardware import flush_denormals

# DeepSpeed's compiled ops: the folder scripts/install.sh prebuilds them into (raylign's default).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))

torch.set_num_threads(1)
flush_denormals()


def _own_cores() -> None:
    """Under pytest-xdist, give each worker process its own share of the cores, inherited by the Ray
    actors and subprocesses its tests start: RL workers size their torch threads to the cores they may
    run on (``placement.threads_per_worker: auto``), and two test processes that each took every core
    would slow each other down many times over."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    index, count_ = int(worker.removeprefix("gw")), int(count)
    if len(cores) >= count_:
        os.sched_setaffinity(0, cores[index::count_])


_own_cores()

import pytest  # noqa: E402

from tests import case_counts, file_order  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (starting Ray costs seconds)."""
    import ray

    from raylign.cluster import start_ray

    start_ray(num_cpus=8)  # logical slots: actors here are mostly idle waiting on each other
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    """Qwen2, tied embeddings, fp32, for the rollout and endpoint tests. Head size 32: the smallest
    vLLM's CPU attention supports."""
    from raylign.models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tied") / "model",
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=True,
        seed=1,
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-durations",
        metavar="PATH",
        help="write each test file's seconds in this run to PATH (the suite runs files in the order "
        "tests/durations.json gives, longest first)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("write_durations")
    if path:
        from raylign.hardware import cpu_bf16_support, cpu_model

        machine = f"{cpu_model()}, {os.cpu_count()} cores, {cpu_bf16_support().reason}"
        config.pluginmanager.register(file_order.DurationRecorder(Path(path), machine), "duration_recorder")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test files longest first (``tests/file_order.py``); soak runs are opt-in: they run only when
    ``-m`` names them."""
    file_order.order_by_duration(items, file_order.load_durations())
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="opt-in soak run: python -m pytest -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands the cases its property and fuzz tests generated to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["case_counts"] = case_counts.as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """The controller adds up what each xdist worker counted."""
    case_counts.add(getattr(node, "workeroutput", {}).get("case_counts", {}))


def pytest_terminal_summary(terminalreporter: object) -> None:
    case_counts.write_summary(terminalreporter)
