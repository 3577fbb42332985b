"""The `kubetrain` command: thin argument handling over the API model, the drivers and the client.

The composition root of the command line: it may load the control plane
(kubetrain.api, engine, drivers, client, report), the trainer (kubetrain.trainer: checkpoints, export)
and the benchmarks (kubetrain.bench), each inside the commands that need
it, so that `kubetrain operator` in the operator's image never loads torch.
commands.py holds the commands, parser.py their arguments.

Errors the user can fix are printed as one line each (file, field path,
message) with exit code 2, never as a traceback.
"""

from __future__ import annotations

import sys

from kubetrain.api import InvalidSpec
from kubetrain.client.api import ClientError

from .commands import EXIT_USAGE, UsageError, print_invalid
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidSpec as err:
        print_invalid(err)
        return EXIT_USAGE
    except UsageError as err:
        print(f"kubetrain: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as err:  # logs, wait, export, report of cluster jobs: the message names the job
        print(f"kubetrain: {err}", file=sys.stderr)
        return EXIT_USAGE
