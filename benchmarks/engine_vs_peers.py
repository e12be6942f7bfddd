"""slotserve's engine against transformers (static generate, continuous batching, a plain
decode step) on this machine: the same as `slotserve bench`, as a script CI does not run.

    .venv/bin/python benchmarks/engine_vs_peers.py --json results/bench.json
"""

import argparse
import sys

from cli.bench import add_parser

if __name__ == "__main__":  # the rows run in spawned processes, which import this file
    parser = argparse.ArgumentParser(prog="engine_vs_peers.py")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(args.func(args))
