"""What every ovt command line (`ovt`, `ovt-trainer`, `ovt-auditor`, `ovt-arbiter`) shares:
running the subcommand argparse chose, with every expected failure as one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocol.engine.allocator import keep_freed_memory
from protocol.errors import ConfigError, OvtError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def run_command(prog: str, args: argparse.Namespace) -> int:
    """Run `args.run(args)`, in a process whose malloc keeps freed memory for reuse
    (`allocator.keep_freed_memory`: any command may train or replay steps). An OvtError (bad
    input, an unreachable or misbehaving peer) becomes one line on stderr and exits with its
    `exit_code`, never below 2: 0 and 1 are the commands' own results (matched / diverged,
    valid / invalid). Ctrl-C exits 130. No traceback for an expected failure."""
    keep_freed_memory()
    try:
        return args.run(args)
    except OvtError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return max(err.exit_code, EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def config_item(item: str) -> tuple[str, object]:
    """One `--set KEY=VALUE` option: the value parsed as JSON where it is JSON (numbers,
    booleans, lists), else kept as a string. Raises ConfigError for a missing '='."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_data_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--data-dir DIR`, the one option (trainer, auditor, `ovt job run|audit`) naming the folder
    a node reads jobs' data files in; a path that is not a directory is a usage error."""
    parser.add_argument("--data-dir", type=_directory, default=None, metavar="DIR",
                        help="the folder jobs' data files are read in: a job's data path is "
                             "relative to it and may not leave it (not even through a "
                             "symbolic link); without it a job with a data file is refused")


def _directory(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return path
