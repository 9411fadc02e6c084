"""``raylign <command> [--config run.yaml] [--section.field value ...]``.

Thin entry point: parse the config, start ranks when asked, hand over to the command.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from raylign.cluster import reuse_freed_memory
from raylign.config.base import ConfigError, Section, describe_fields, overrides_from_argv, resolve_config, to_yaml


@dataclass(frozen=True)
class Command:
    """A subcommand: its config class and run function, as "module:attribute" (imported on use,
    so ``--help`` stays fast and a command's heavy dependencies load only when it runs)."""

    summary: str
    config: str
    run: str
    distributed: bool = True  # starts several ranks when engine.num_processes > 1

    def config_cls(self) -> type[Section]:
        return _load(self.config)

    def runner(self) -> Callable[[BaseModel], object]:
        return _load(self.run)


def _load(target: str):
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


COMMANDS: dict[str, Command] = {
    "quickstart": Command(
        "SFT warm-up then GRPO of a tiny model on a letter task on the CPU; reports what RL added.",
        "raylign.cli.quickstart:QuickstartConfig",
        "raylign.cli.quickstart:run_quickstart",
        distributed=False,
    ),
    "tiny-model": Command(
        "Build a tiny random model with a local tokenizer (for examples and tests).",
        "raylign.cli.tiny_model:TinyModelConfig",
        "raylign.cli.tiny_model:run_tiny_model",
        distributed=False,
    ),
    "sft": Command("Supervised fine-tuning.", "raylign.config.commands:SFTConfig", "raylign.trainers.sft:run_sft"),
    "rm": Command(
        "Train a reward model on preference pairs (Bradley-Terry).",
        "raylign.config.rm:RMConfig",
        "raylign.trainers.rm:run_rm",
    ),
    "prm": Command(
        "Train a process reward model on step-labelled solutions.",
        "raylign.config.prm:PRMConfig",
        "raylign.trainers.prm:run_prm",
    ),
    "dpo": Command(
        "Direct preference optimisation and its family (IPO, cDPO, DPO+NLL, SimPO, ORPO).",
        "raylign.config.dpo:DPOConfig",
        "raylign.trainers.dpo:run_dpo",
    ),
    "kto": Command(
        "KTO on unpaired desirable / undesirable examples.",
        "raylign.config.kto:KTOConfig",
        "raylign.trainers.kto:run_kto",
    ),
    "kd": Command(
        "Knowledge distillation from a frozen teacher.", "raylign.config.kd:KDConfig", "raylign.trainers.kd:run_kd"
    ),
    "generate": Command(
        "Batch generation with vLLM or transformers.",
        "raylign.config.pipeline:GenerateConfig",
        "raylign.pipeline.generate:run_generate",
        distributed=False,
    ),
    "score": Command(
        "Score generations with a reward model or reward functions.",
        "raylign.config.pipeline:ScoreConfig",
        "raylign.pipeline.score:run_score",
        distributed=False,
    ),
    "select": Command(
        "Select best-of-n samples or best-vs-worst pairs from scored generations.",
        "raylign.config.pipeline:SelectConfig",
        "raylign.pipeline.select:run_select",
        distributed=False,
    ),
    "rl": Command(
        "Online RL: PPO, GRPO, Dr.GRPO, REINFORCE++, RLOO, GSPO, DAPO on Ray with vLLM rollouts.",
        "raylign.config.rl:RLConfig",
        "raylign.rl.trainer:run_rl",
        distributed=False,
    ),
    "merge-lora": Command(
        "Merge a LoRA adapter folder into its base model (a plain Hugging Face folder).",
        "raylign.cli.merge_lora:MergeLoraConfig",
        "raylign.cli.merge_lora:run_merge_lora",
        distributed=False,
    ),
    "estimate-memory": Command(
        "Estimate device memory per rank of a training run from the model's shape and the parallel layout.",
        "raylign.cli.estimate_memory:EstimateMemoryConfig",
        "raylign.cli.estimate_memory:run_estimate_memory",
        distributed=False,
    ),
    "serve-rm": Command(
        "Serve a reward model or reward function over HTTP.",
        "raylign.cli.serve_rm:ServeRMConfig",
        "raylign.cli.serve_rm:run_serve_rm",
        distributed=False,
    ),
}


# Commands without a config file: name -> (summary, "module:main", main taking argv and returning the exit code).
PLAIN_COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": (
        "Check this machine for a run: versions, devices, bf16, Ray, packages and settings.",
        "raylign.cli.doctor:main",
    ),
}


def available_commands() -> dict[str, Command]:
    """The commands whose modules are present in this installation."""
    found = {}
    for name, command in COMMANDS.items():
        module = command.config.split(":")[0]
        if importlib.util.find_spec(module) is not None:
            found[name] = command
    return found


USAGE = """usage: raylign <command> [--config FILE.yaml] [--print-config] [--section.field VALUE ...]

commands:
{commands}

Every config field can be set in the YAML file or overridden on the command line with its
dotted path (command line > YAML file > defaults). `raylign <command> --help` lists the fields."""


def _usage() -> str:
    summaries = {name: c.summary for name, c in available_commands().items()}
    summaries.update({name: summary for name, (summary, _) in PLAIN_COMMANDS.items()})
    width = max(len(n) for n in summaries)
    rows = "\n".join(f"  {name.ljust(width)}  {summary}" for name, summary in summaries.items())
    return USAGE.format(commands=rows)


def help_option(dotted: str) -> str:
    """How ``--help`` names a field: ``--a.b``; a list item's field without dashes, since it is no option
    of its own (its list is given whole, in a file or as one value)."""
    return dotted if "[]." in dotted else f"--{dotted}"


def command_help(name: str) -> str:
    cls = COMMANDS[name].config_cls()
    lines = [
        f"usage: raylign {name} [--config FILE.yaml] [--print-config] [--section.field VALUE ...]",
        "",
        (cls.__doc__ or "").strip(),
        "",
        "fields (dotted path, type, default):",
    ]
    if "preset" in cls.model_fields:
        lines[-1:-1] = [
            "A preset sets some of these defaults its own way (the algorithm's, for one); --print-config shows",
            "the values a run will use.",
            "",
        ]
    for dotted, type_text, default, description in describe_fields(cls):
        if type_text in ("section", "optional section"):
            lines.append(f"\n  [{dotted}] {description}")
            if not dotted.endswith("]") and "[]." not in dotted and description.endswith("Each item has these fields:"):
                lines.append(f"        On the command line, the whole list: --{dotted} '[{{field: value, ...}}, ...]'")
            continue
        lines.append(f"  {help_option(dotted)}  ({type_text}, default {default})")
        if description:
            lines.append(f"        {description}")
    return "\n".join(lines)


def _split_args(argv: list[str]) -> tuple[str | None, bool, bool, list[str]]:
    config_paths, print_config, want_help, rest = [], False, False, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help = True
        elif arg == "--print-config":
            print_config = True
        elif arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            config_paths.append(argv[i + 1])
            i += 1
        elif arg.startswith("--config="):
            config_paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if len(config_paths) > 1:  # the last one won, and the others were dropped without a word
        raise ConfigError(
            f"--config is given {len(config_paths)} times ({', '.join(config_paths)}); give one file, and the "
            "fields that differ as --section.field VALUE"
        )
    return (config_paths[0] if config_paths else None), print_config, want_help, rest


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    if sys.stderr.isatty():  # a terminal: rich's coloured, wrapped lines
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:  # a log file or a pipe: one plain line per message, on stderr
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=fmt, handlers=[handler], force=True)
    for noisy in ("httpx", "urllib3", "filelock", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _launch_ranks(name: str, argv: list[str], num_processes: int) -> int:
    """Re-run this command under torchrun with ``num_processes`` ranks on this machine.

    torchrun's folder for the ranks' error files is a temporary one, removed when they end (its
    default, a new ``torchelastic_*`` folder in the temporary directory, is never removed)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="raylign-torchrun-") as logs:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={num_processes}",
            f"--log-dir={logs}",
            "-m",
            "raylign.cli.main",
            name,
            *argv,
        ]
        return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    """The ``raylign`` command on ``argv``; returns its exit status.

    Without ``argv`` it is this process's command (its own arguments), and a process that joined a
    process group (a rank torchrun started) ends here through
    :func:`raylign.engine.distributed.exit_process`, so that a finished rank cannot abort in the
    interpreter's shutdown.
    """
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed stdout fails here, not in the interpreter's shutdown
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # The reader of stdout has quit (``raylign --help | head -1``): stop quietly, as other
        # command-line tools do. What is still buffered goes to /dev/null at the exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    distributed = sys.modules.get("torch.distributed")
    if argv is None and distributed is not None and distributed.is_initialized():
        from raylign.engine.distributed import exit_process

        exit_process(code)
    return code


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket that nothing reads any more (a broken pipe of a
    connection the command opened itself is a fault of its own, with its traceback)."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _run(argv: list[str]) -> int:
    reuse_freed_memory()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name in PLAIN_COMMANDS:
        return _load(PLAIN_COMMANDS[name][1])(rest)
    if name not in available_commands():
        print(f"raylign: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    command = COMMANDS[name]
    cls = command.config_cls()
    try:
        config_path, print_config, want_help, override_args = _split_args(rest)
        if want_help:
            print(command_help(name))
            return 0
        cfg = resolve_config(cls, config_path, overrides_from_argv(cls, override_args))
    except ConfigError as err:
        print(f"raylign {name}: {err}", file=sys.stderr)
        return 2
    if print_config:
        print(to_yaml(cfg), end="")
        return 0
    engine = getattr(cfg, "engine", None)
    if command.distributed and engine is not None and engine.num_processes > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(name, rest, engine.num_processes)
    setup_logging()
    from raylign.hardware import name_cpu_accelerator_for_deepspeed

    name_cpu_accelerator_for_deepspeed()
    try:
        command.runner()(cfg)
    except _user_facing_errors() as err:
        if os.environ.get("RAYLIGN_DEBUG"):
            raise
        logging.getLogger("raylign").error("%s (set RAYLIGN_DEBUG=1 for the traceback)", err)
        return 1
    return 0


def _user_facing_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message says what went wrong and what to do: logged as one line, no traceback."""
    from raylign.cluster import StartupError
    from raylign.engine.checkpoint import CheckpointError
    from raylign.errors import MissingPackageError
    from raylign.rl.shared_dir import SharedDirectoryError
    from raylign.rl.verify import AdapterMismatch, WeightSyncDrift
    from raylign.rollout.rewards.base import RewardError

    return (
        ValueError,  # ConfigError, DataError and the checks of every command
        FileNotFoundError,
        NotADirectoryError,  # a file given where a folder belongs (a model or tokenizer path)
        PermissionError,  # a file or folder this user may not read or write, named by the error
        MissingPackageError,  # a missing optional package, named with its install command
        FloatingPointError,  # too many steps in a row skipped for non-finite values
        RewardError,
        CheckpointError,
        StartupError,
        SharedDirectoryError,
        WeightSyncDrift,
        AdapterMismatch,
    )


if __name__ == "__main__":
    sys.exit(main())
