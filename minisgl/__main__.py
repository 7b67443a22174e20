"""`python -m minisgl [serve]`: the OpenAI-compatible server (or `--shell`); `python -m minisgl generate ...`:
offline completions.

Arguments are parsed before anything heavy is imported, so `--help` and a bad option answer at once.
"""

from __future__ import annotations

import difflib
import sys

from minisgl.utils.cli import EXIT_USAGE, print_error, run_command
from minisgl.utils.hf import find_model

COMMANDS = ("serve", "generate")


def _serve(argv: list[str]) -> int:
    from minisgl.server.args import parse_args

    args = parse_args(argv)
    # a missing model fails at once, not after seconds of imports and a child's start-up
    find_model(args.model)
    from minisgl.server.launch import serve

    return serve(args)


def _generate(argv: list[str]) -> int:
    from minisgl.llm.cli import main as generate_main

    return generate_main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = "serve"
    if argv and not argv[0].startswith("-"):
        command, argv = argv[0], argv[1:]
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            print_error(
                f"unknown command {command!r}; {hint}commands: serve (the default), generate "
                "(`python -m minisgl --help`, `python -m minisgl generate --help`)"
            )
            sys.exit(EXIT_USAGE)
    run_command(_generate if command == "generate" else _serve, argv)


if __name__ == "__main__":
    main()
