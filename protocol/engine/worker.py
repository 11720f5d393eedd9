"""The entry point of a data-parallel worker process (`protocol.engine.dataparallel`).

A node's `WorkerGroup` starts `python -m protocol.engine.worker ...`; nobody runs it by hand.
It is a module of its own so that the worker imports `dataparallel` once, under its own name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocol.engine.dataparallel import DEFAULT_TIMEOUT_S, Recipe, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m protocol.engine.worker",
        description="A data-parallel worker of an ovt node (started by the node, not by hand).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--recipe", required=True, help="JSON: {builder, args}")
    args = parser.parse_args(argv)
    body = json.loads(args.recipe)
    return serve(args.rank, args.world, args.rendezvous, Recipe(body["builder"], body["args"]),
                 args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
