"""What every ovt command line (`ovt`, `ovt-trainer`, `ovt-auditor`, `ovt-arbiter`) shares:
running the subcommand argparse chose, with every expected failure as one line."""

from __future__ import annotations

import argparse
import sys

from protocol.errors import OvtError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def run_command(prog: str, args: argparse.Namespace) -> int:
    """Run `args.run(args)`. An OvtError (bad input, an unreachable or misbehaving peer) becomes
    one line on stderr and exits with its `exit_code`, never below 2: 0 and 1 are the commands'
    own results (matched / diverged, valid / invalid). Ctrl-C exits 130. No traceback for an
    expected failure."""
    try:
        return args.run(args)
    except OvtError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return max(err.exit_code, EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
