"""The `slotserve` command line: one entry point, one module per command (cli/<command>.py,
each with `add_parser` and `run`)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from cli import bench, calibrate, compare, dashboard, down, experiment, generate, report, run, serve, status, top, up
from cli.help import Parser
from protocol.errors import SlotServeError

COMMANDS = (generate, compare, up, down, status, top, run, report, experiment, bench, calibrate, serve, dashboard)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="slotserve", description="Serve LLMs with pluggable batching policies and compare them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SlotServeError as err:
        print(f"slotserve: error: {err}", file=sys.stderr)
        return 2
    except ValidationError as err:
        first = err.errors()[0]
        print(f"slotserve: error: invalid {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
