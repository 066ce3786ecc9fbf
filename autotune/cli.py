"""The `autotune` command: a thin argparse front over the subcommand modules."""
from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

from autotune.commands.argtypes import OneLineParser
from runtime.errors import NpumoeError
from runtime.interrupts import Terminated, signals_raise

# Subcommand modules, in the order `autotune --help` lists them (one per pipeline stage).
COMMANDS = ["models", "profile_device", "show_profile", "calibrate", "search", "plan_template", "run", "evaluate",
            "generate", "serve", "build", "bench", "doctor"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autotune", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"autotune.commands.{name}").register(sub)
    return parser


def _version() -> str:
    try:
        return version("npumoe")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# What a full disk or a closed reader looks like to a writer.
STREAM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EPIPE, errno.EIO, errno.EFBIG}


def _say(line: str) -> None:
    """One line on stderr; nothing when stderr itself cannot be written (the exit status still says it)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit does not fail (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor behind stdout (a test's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"autotune {args.command}: %(message)s")
    try:
        with signals_raise():
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # a full disk or a closed pipe shows here at the latest, not at exit
            return code
    except NpumoeError as e:
        _say(f"autotune {args.command}: error: {' '.join(str(e).split())}")  # one line
        return 2
    except OSError as e:
        if not isinstance(e, BrokenPipeError) and e.errno not in STREAM_ERRNOS:
            raise
        # a file writer names its file; a failed print or flush does not: that is the command's output stream
        where = e.filename or ("standard output" if isinstance(e, BrokenPipeError) else "the command's output")
        _silence_stdout()
        _say(f"autotune {args.command}: error: cannot write {where}: {e.strerror or e}")
        return 2
    except KeyboardInterrupt:
        print(f"autotune {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"autotune {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
