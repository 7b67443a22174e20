"""`python -m minisgl [serve]`: the OpenAI-compatible server (or `--shell`); `python -m minisgl generate ...`:
offline completions.

Arguments are parsed before anything heavy is imported, so `--help` and a bad option answer at once.
"""

from __future__ import annotations

import atexit
import difflib
import os
import sys
from typing import NoReturn

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


def main_then_exit() -> NoReturn:
    """main, then the process's exit without the interpreter's teardown of its modules (about 0.4 s of a 4 s
    `generate` on a 2-core machine): the atexit handlers still run (a trace's end, the
    logging handlers' flush, multiprocessing's children) and stdout and stderr are flushed, so nothing is lost."""
    code: object = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    # as the interpreter reads sys.exit's argument: None is 0, a message is printed and 1
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more to write
            pass
    os._exit(code)


if __name__ == "__main__":
    main_then_exit()
