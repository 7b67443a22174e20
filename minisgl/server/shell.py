"""`python -m minisgl --shell`: chat with the model in the terminal.

The shell is a client of the same scheduler and tokenizer processes the HTTP server uses, so
replies stream token by token. The conversation is kept and sent whole each turn.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import TYPE_CHECKING, TextIO

from prompt_toolkit import PromptSession

from minisgl.core import SamplingParams
from minisgl.message.frontend import TokenizeMsg
from minisgl.server.client import EngineClient, ServeInfo
from minisgl.tokenizer.reasoning import ReasoningParser

if TYPE_CHECKING:
    from minisgl.server.launch import ServerProcesses

HELP = "/reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


class ChatShell:
    def __init__(
        self,
        client: EngineClient,
        info: ServeInfo,
        session: PromptSession | None = None,
        out: TextIO | None = None,
        params: SamplingParams | None = None,
    ) -> None:
        self.client = client
        self.info = info
        self.session = session or PromptSession()
        self.out = out or sys.stdout
        self.params = params or SamplingParams()  # greedy: the same question gets the same answer
        self.history: list[dict[str, str]] = []

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    async def run(self) -> None:
        self._write(f"minisgl shell, chatting with {self.info.model_name}. {HELP}\n")
        while True:
            try:
                line = (await self.session.prompt_async("> ")).strip()
            except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as a shell does
                continue
            except EOFError:
                break
            if line == "/exit":
                break
            if line == "/reset":
                self.history.clear()
                self._write("(new conversation)\n")
            elif line.startswith("/"):
                self._write(f"unknown command {line}; {HELP}\n")
            elif line:
                await self._turn(line)

    async def _turn(self, line: str) -> None:
        self.history.append({"role": "user", "content": line})
        fmt = self.info.reasoning
        msg = TokenizeMsg(
            [self.params], messages=list(self.history), reasoning=None if fmt is None else fmt.name
        )
        group = self.client.submit([msg])
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, group.close)  # Ctrl-C aborts this reply only
        text, reply = "", None
        parser: ReasoningParser | None = None
        thinking = False  # the reasoning's parenthesis is open
        try:
            while reply is None or not reply.finished:
                _, reply = await group.get()
                if fmt is None:
                    text += reply.text
                    self._write(reply.text)
                    continue
                # with a reasoning parser the reasoning is shown in parentheses and left out of the history,
                # as Qwen3's and DeepSeek-R1's model cards ask of a conversation
                parser = parser or ReasoningParser(fmt, bool(reply.reasoning_open))
                reasoning, answer = parser.step(reply.text, reply.finished)
                if reasoning:
                    self._write(reasoning if thinking else "(thinking: " + reasoning)
                    thinking = True
                if thinking and (answer or reply.finished):
                    self._write(")\n")
                    thinking = False
                text += answer
                self._write(answer)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            group.close()
        self._write("\n")
        if reply.finish_reason == "error":
            self.history.pop()
            self._write(f"error: {reply.error}\n")
            return
        if reply.finish_reason == "abort":
            self._write("(stopped)\n")
        elif reply.finish_reason == "length":
            self._write("(cut at the token limit)\n")
        self.history.append({"role": "assistant", "content": text})


async def _main(procs: ServerProcesses, info: ServeInfo) -> int:
    client = EngineClient(procs.addrs.requests, procs.addrs.replies)
    client.start()
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    failed: list[str] = []

    def on_failure(reason: str) -> None:
        failed.append(reason)
        loop.call_soon_threadsafe(client.fail_all, reason)
        loop.call_soon_threadsafe(task.cancel)

    procs.watch(on_failure)
    try:
        await ChatShell(client, info).run()
    except asyncio.CancelledError:
        if not failed:
            raise
    finally:
        client.close()
    return 1 if failed else 0


def run_shell(procs: ServerProcesses, info: ServeInfo) -> int:
    """Chat until /exit; the exit code is 1 if a worker process died."""
    return asyncio.run(_main(procs, info))
