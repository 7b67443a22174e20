"""What every command-line entry point shares: one-line errors, conventional exit codes, short usage errors.

A failure the user can fix (a missing model, a port in use, a bad option) is one line on stderr
that says what to change, and exit code 1; a bad option is exit code 2, as argparse has it; Ctrl-C
is exit code 130, with no traceback. MINISGL_LOG_LEVEL=debug adds the traceback. Anything else is
a bug and keeps Python's traceback. Nothing here imports torch: `--help` must stay fast.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from minisgl.env import ENV

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports after Ctrl-C


class CommandError(Exception):
    """A failure the user can fix; the message says how. `detail` (a child's traceback, say) is shown under debug."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


# the failures of a user's input: a path, a file's content, a value
EXPECTED_ERRORS = (CommandError, OSError, ValueError)


def add_no_prefix_cache(group: argparse._ArgumentGroup) -> None:
    """SGLang's and vLLM's flags for no prefix cache, as `--cache-type naive` (the server's and generate's)."""
    group.add_argument(
        "--disable-radix-cache",
        "--no-enable-prefix-caching",
        dest="cache_type",
        action="store_const",
        const="naive",
        help="no prefix cache: --cache-type naive (default: off)",
    )


def debug_enabled() -> bool:
    return str(ENV.LOG_LEVEL.value).upper() == "DEBUG"


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_command(main: Callable[[list[str]], int], argv: list[str]) -> NoReturn:
    """Run `main(argv)` and exit with its code, turning expected failures and Ctrl-C into an exit code."""
    try:
        code = main(argv)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except EXPECTED_ERRORS as e:
        print_error(str(e))
        if debug_enabled():
            traceback.print_exc()
            if isinstance(e, CommandError) and e.detail:
                print(e.detail, file=sys.stderr)
        code = EXIT_ERROR
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a usage error in one line that points at --help instead of the whole usage text."""

    def error(self, message: str) -> NoReturn:
        print_error(f"{message}; see `{self.prog} --help`")
        sys.exit(EXIT_USAGE)
