"""``raylign <command> [--config run.yaml] [--section.field value ...]``.

Thin entry point: parse the config, start ranks when asked, hand over to the command.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from raylign.config.base import ConfigError, describe_fields, overrides_from_argv, resolve_config, to_yaml


@dataclass(frozen=True)
class Command:
    summary: str
    config_cls: Callable[[], type[BaseModel]]  # imported lazily so --help stays fast
    run: Callable[[BaseModel], object]
    distributed: bool = True  # starts several ranks when engine.num_processes > 1


def _sft_config():
    from raylign.config.commands import SFTConfig

    return SFTConfig


def _run_sft(cfg) -> object:
    from raylign.trainers.sft import SFTTrainer

    return SFTTrainer(cfg).run()


def _quickstart_config():
    from raylign.cli.quickstart import QuickstartConfig

    return QuickstartConfig


def _run_quickstart(cfg) -> object:
    from raylign.cli.quickstart import run_quickstart

    return run_quickstart(cfg)


COMMANDS: dict[str, Command] = {
    "quickstart": Command("Train a tiny model to reverse letter sequences on the CPU and report accuracy.",
                          _quickstart_config, _run_quickstart, distributed=False),
    "sft": Command("Supervised fine-tuning.", _sft_config, _run_sft),
}

USAGE = """usage: raylign <command> [--config FILE.yaml] [--print-config] [--section.field VALUE ...]

commands:
{commands}

Every config field can be set in the YAML file or overridden on the command line with its
dotted path (command line > YAML file > defaults). `raylign <command> --help` lists the fields."""


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    rows = "\n".join(f"  {name.ljust(width)}  {c.summary}" for name, c in COMMANDS.items())
    return USAGE.format(commands=rows)


def command_help(name: str) -> str:
    cls = COMMANDS[name].config_cls()
    lines = [f"usage: raylign {name} [--config FILE.yaml] [--print-config] [--section.field VALUE ...]", "",
             (cls.__doc__ or "").strip(), "", "fields (dotted path, type, default):"]
    for dotted, type_text, default, description in describe_fields(cls):
        if type_text == "section":
            lines.append(f"\n  [{dotted}] {description}")
            continue
        lines.append(f"  --{dotted}  ({type_text}, default {default})")
        if description:
            lines.append(f"        {description}")
    return "\n".join(lines)


def _split_args(argv: list[str]) -> tuple[str | None, bool, bool, list[str]]:
    config_path, print_config, want_help, rest = None, False, False, []
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
            config_path = argv[i + 1]
            i += 1
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config_path, print_config, want_help, rest


def setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    try:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    except ImportError:  # pragma: no cover - rich is a dependency
        handler = logging.StreamHandler()
        fmt = "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=fmt, handlers=[handler], force=True)
    for noisy in ("httpx", "urllib3", "filelock", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _launch_ranks(name: str, argv: list[str], num_processes: int) -> int:
    """Re-run this command under torchrun with ``num_processes`` ranks on this machine."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_processes}",
           "-m", "raylign.cli.main", name, *argv]
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"raylign: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    command = COMMANDS[name]
    try:
        config_path, print_config, want_help, override_args = _split_args(rest)
        if want_help:
            print(command_help(name))
            return 0
        cfg = resolve_config(command.config_cls(), config_path, overrides_from_argv(override_args))
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
    try:
        command.run(cfg)
    except (ValueError, FileNotFoundError, ConfigError) as err:
        if os.environ.get("RAYLIGN_DEBUG"):
            raise
        logging.getLogger("raylign").error("%s (set RAYLIGN_DEBUG=1 for the traceback)", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
