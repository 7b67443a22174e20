"""`python -m minisgl`: the OpenAI-compatible server (or `--shell`); `python -m minisgl generate ...`: offline completions."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        from minisgl.llm.cli import main as generate_main

        generate_main(argv[1:])
        return
    from minisgl.server.launch import main as server_main

    server_main(argv)


if __name__ == "__main__":
    main()
