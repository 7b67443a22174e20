"""`python -m minisgl`: start the scheduler and the tokenizer worker, wait until both are ready, then
serve the HTTP API in this process (or run the chat shell with --shell).

The children are spawned (not forked: torch and ZMQ state must not be shared) and never outlive
this process. If one of them dies the server goes down with a log line saying which, rather than
hanging its clients; SIGINT and SIGTERM stop everything in order (exit code 130 after SIGINT, as a
shell expects, and 0 after SIGTERM).

A child that fails to start sends its error to the parent, which reports it as one line (the
traceback too under MINISGL_LOG_LEVEL=debug, or when the error is not one a user can fix).
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import shutil
import signal
import socket
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.message.frontend import SchedulerStats
from minisgl.scheduler.check import RequestLimits
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.ranks import RankProcesses, check_tp
from minisgl.server.args import ServerArgs
from minisgl.server.client import EngineClient, ServeInfo
from minisgl.tokenizer.reasoning import reasoning_format
from minisgl.tokenizer.tool_parser import ToolSupport
from minisgl.tokenizer.worker import WorkerAddrs
from minisgl.utils.cli import EXIT_ERROR, EXIT_INTERRUPTED, EXPECTED_ERRORS, CommandError
from minisgl.utils.logger import init_logger
from minisgl.utils.mp import ipc_addr
from minisgl.utils.process import exit_now, exit_on_sigterm, init_child_process
from minisgl.utils.trace import TRACE, trace_server

logger = init_logger(__name__)

_STOP_TIMEOUT_S = 10.0


@dataclass
class ModelInfo:
    """What the scheduler tells the others once its model is loaded."""

    model_dir: str  # a Hugging Face folder (a GGUF file has been converted by now)
    limits: RequestLimits
    stats: SchedulerStats  # the idle scheduler's load: /metrics shows it from the first scrape
    # how the model takes tools: the tokenizer worker's finding, once it is ready
    tools: ToolSupport = field(default_factory=ToolSupport)


class StartupError(CommandError):
    """The server cannot start; the message says why and what to change."""


@dataclass
class ChildFailure:
    """What a child that failed to start sends its parent."""

    message: str
    traceback: str
    expected: bool  # a failure the user can fix (a missing file, a bad value): its message is enough

    @classmethod
    def of(cls, e: Exception) -> ChildFailure:
        return cls(str(e), traceback.format_exc(), isinstance(e, EXPECTED_ERRORS))


# ---- the child processes ----------------------------------------------------------------------
def _scheduler_main(config: SchedulerConfig, conn: Connection) -> None:
    init_child_process()
    try:
        from minisgl.scheduler.scheduler import Scheduler

        scheduler = Scheduler(config)
    except Exception as e:
        conn.send(("failed", ChildFailure.of(e)))
        # no interpreter teardown: the parent's SIGTERM would land in its atexit handlers
        exit_now(1)
    except SystemExit:  # SIGTERM from the parent while the model loads
        exit_now(0)
    info = ModelInfo(scheduler.engine.model_dir, scheduler.limits, scheduler.stats())
    conn.send(("ready", info))
    try:
        scheduler.run_forever()
    except (KeyboardInterrupt, SystemExit):  # an ExitMsg, or SIGTERM from the parent
        scheduler.shutdown()
        exit_now(0)


def _tokenizer_main(addrs: WorkerAddrs, conn: Connection, chat_template: str | None) -> None:
    init_child_process()
    try:
        import transformers  # noqa: F401  (imported while the scheduler loads: the slow part overlaps)

        from minisgl.tokenizer.tool_parser import detect_tool_support
        from minisgl.tokenizer.worker import TokenizerWorker
        from minisgl.utils.hf import load_tokenizer

        # the scheduler resolves the model (a GGUF file is converted once) and knows its context length
        info: ModelInfo = conn.recv()
        tokenizer = load_tokenizer(info.model_dir, chat_template)
        worker = TokenizerWorker(tokenizer, info.limits, addrs)
        tools = detect_tool_support(tokenizer, info.model_dir)
    except (EOFError, SystemExit):
        exit_now(0)  # the parent gave up (or stopped us) before the scheduler was ready
    except Exception as e:
        conn.send(("failed", ChildFailure.of(e)))
        exit_now(1)
    conn.send(("ready", tools))
    try:
        worker.run_forever()
    except SystemExit:  # SIGTERM from the parent
        worker.close()
        exit_now(0)


# ---- the parent's view of them ----------------------------------------------------------------
def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ServerProcesses:
    """The scheduler and the tokenizer worker: started together, watched, stopped together."""

    def __init__(self, args: ServerArgs) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="minisgl-")
        addr = lambda name: ipc_addr(self.ipc_dir, name)  # noqa: E731
        self.addrs = WorkerAddrs(
            requests=addr("tokenizer"),
            replies=addr("api"),
            backend=addr("scheduler"),
            detokenize=addr("detok"),
        )
        try:
            self.config = args.scheduler_config(self.addrs.backend, self.addrs.detokenize)
            if self.config.tp_info.size > 1:
                # before any process starts; a GGUF file is converted here, once, for every rank
                self.config.model_path = check_tp(self.config)
        except ValueError as e:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise StartupError(f"invalid engine option: {e}") from e
        per_node = self.config.tp_info.size // self.config.nnodes
        self.ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
        self.procs: list[BaseProcess] = []
        self.stopping = False

    def start_followers(self) -> None:
        """Start this node's ranks other than 0 (all of them on a node other than 0) and wait until ready."""
        first = max(self.ranks.start, 1)
        followers = RankProcesses(self.config, first, self.ranks.stop)
        self.procs += followers.procs
        try:
            followers.wait_ready()
        except RuntimeError as e:
            raise StartupError(str(e)) from e
        ranks = ", ".join(
            f"rank {r} (pid {p.pid})" for r, p in zip(range(first, self.ranks.stop), followers.procs)
        )
        logger.info(f"scheduler {ranks} ready")

    def wait(self) -> int:
        """On a node other than 0: wait until a rank ends (rank 0 stopped, or failed)."""
        wait([p.sentinel for p in self.procs])
        return 0 if all(p.exitcode == 0 for p in self.procs if not p.is_alive()) else EXIT_ERROR

    def start(self, while_waiting: Callable[[], None] | None = None) -> ModelInfo:
        """Start rank 0, the tokenizer worker and this node's other ranks, and wait until they are ready;
        `while_waiting` runs meanwhile."""
        ctx = mp.get_context("spawn")
        sched_conn, sched_child = ctx.Pipe()
        tok_conn, tok_child = ctx.Pipe()
        self.procs = [
            ctx.Process(
                target=_scheduler_main, args=(self.config, sched_child), name="scheduler", daemon=True
            ),
            ctx.Process(
                target=_tokenizer_main,
                args=(self.addrs, tok_child, self.config.chat_template),
                name="tokenizer",
                daemon=True,
            ),
        ]
        for p in self.procs:
            p.start()
        sched_child.close()
        tok_child.close()
        if while_waiting is not None:
            while_waiting()
        if len(self.ranks) > 1:
            self.start_followers()
        info = self._wait_ready(sched_conn, self.procs[0])
        tok_conn.send(info)
        info.tools = self._wait_ready(tok_conn, self.procs[1])
        logger.info(f"scheduler (pid {self.procs[0].pid}) and tokenizer (pid {self.procs[1].pid}) are ready")
        return info

    def _wait_ready(self, conn: Connection, proc: BaseProcess) -> Any:
        wait([conn, *(p.sentinel for p in self.procs)])
        if conn.poll():
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "failed", None
            if status == "ready":
                return payload
            if isinstance(payload, ChildFailure) and payload.expected:
                raise StartupError(payload.message, payload.traceback)
            if isinstance(payload, ChildFailure):  # a bug: its traceback is what a report needs
                raise StartupError(f"the {proc.name} process failed to start:\n{payload.traceback}")
        dead = next((p for p in self.procs if not p.is_alive()), proc)
        dead.join(1.0)
        raise StartupError(f"the {dead.name} process {_describe_exit(dead.exitcode)} during start-up")

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call `on_failure(reason)` from a thread if a child dies while the server runs."""

        def run() -> None:
            ready = wait([p.sentinel for p in self.procs])
            if self.stopping:
                return
            dead = next(p for p in self.procs if p.sentinel in ready)
            dead.join(1.0)
            reason = (
                f"the {dead.name} process (pid {dead.pid}) {_describe_exit(dead.exitcode)}; shutting down"
            )
            logger.error(reason)
            on_failure(reason)

        threading.Thread(target=run, name="minisgl-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(_STOP_TIMEOUT_S)
            if p.is_alive():
                logger.warning(f"the {p.name} process did not stop in {_STOP_TIMEOUT_S:.0f} s; killing it")
                p.kill()
                p.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


# ---- the main process -------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(
            f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host"
        ) from e
    sock.listen(2048)  # connections queue from now on, even while the model loads
    return sock


def _is_loopback(host: str) -> bool:
    """Whether `host` (an --host value) can be reached only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve to any address


# what the first streamed reply imports (starlette's task group and memory streams, through anyio): 9 ms of the
# first request's time to first token, taken at start instead; names of another anyio are skipped
_FIRST_REQUEST_IMPORTS = (
    "anyio._core._sockets",
    "anyio.streams.memory",
    "anyio.streams.stapled",
    "anyio.streams.tls",
)


def _import_http_server() -> None:
    import importlib

    import uvicorn  # noqa: F401

    import minisgl.server.api_server  # noqa: F401

    for name in _FIRST_REQUEST_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _serve_http(args: ServerArgs, sock: socket.socket, procs: ServerProcesses, info: ServeInfo) -> int:
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.guard import HttpLimits, h11_protocol

    def make_client() -> EngineClient:
        return EngineClient(
            procs.addrs.requests,
            procs.addrs.replies,
            info.stats,
            log_requests=True,
            log_text=args.log_requests,
            model_name=info.model_name,
        )

    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def on_start() -> None:
        # said once the server handles its signals: Ctrl-C from here on is an orderly shutdown
        logger.info(f"minisgl is serving {info.model_name} at {url} (OpenAI API: {url}/v1)")

    http = HttpLimits(args.max_request_bytes, args.read_timeout, args.max_request_bytes_in_flight)
    app = create_app(info, make_client, http, on_start, api_key=args.api_key)
    config = uvicorn.Config(
        app,
        log_level="warning",
        http=h11_protocol(http.read_timeout_s),
        timeout_keep_alive=http.keep_alive_s,
        # a stream still open at shutdown gets a few seconds to finish, then is cut
        timeout_graceful_shutdown=3,
    )
    server = uvicorn.Server(config)
    failed: list[str] = []

    def on_failure(reason: str) -> None:
        failed.append(reason)
        loop = getattr(app.state, "loop", None)
        if loop is not None:  # end the requests in flight now: no reply will come for them
            loop.call_soon_threadsafe(app.state.client.fail_all, reason)
        server.should_exit = True

    procs.watch(on_failure)
    try:
        # uvicorn handles SIGINT itself and raises it again once it has stopped: KeyboardInterrupt here
        server.run(sockets=[sock])
    finally:
        if not failed:  # a dead worker has already said "shutting down"
            logger.info("shutting down")
    return EXIT_ERROR if failed else 0


def serve(args: ServerArgs) -> int:
    """Serve (or run the shell) until stopped; the exit code: 0, 1 on a failure, 130 after Ctrl-C."""
    exit_on_sigterm()
    trace_server(args.trace)
    sock: socket.socket | None = None
    procs: ServerProcesses | None = None
    try:
        if not args.shell and args.node_rank == 0:
            sock = _bind(args.host, args.port)
            if args.api_key is None and not _is_loopback(args.host):
                logger.warning(
                    f"listening on {args.host}, beyond this machine, without an API key: anyone who can "
                    "reach the port can use the model; pass --api-key (or set MINISGL_API_KEY)"
                )
        procs = ServerProcesses(args)
        if args.node_rank > 0:  # this node only computes: its ranks follow node 0's rank 0
            procs.start_followers()
            return procs.wait()
        # the server's own imports overlap the children's start-up
        model = procs.start(while_waiting=None if args.shell else _import_http_server)
        names = args.model_names
        tools = (
            model.tools
            if args.tool_call_parser is None
            else replace(model.tools, parser=args.tool_call_parser)
        )
        info = ServeInfo(
            names[0],
            args.model,
            model.limits.max_seq_len,
            other_names=names[1:],
            stats=model.stats,
            tools=tools,
            reasoning=None if args.reasoning_parser is None else reasoning_format(args.reasoning_parser),
            priority_scheduling=args.priority_scheduling,
            server_args={k: v for k, v in asdict(args).items() if k != "api_key"},
        )
        if args.shell:
            from minisgl.server.shell import run_shell

            return run_shell(procs, info)
        assert sock is not None
        return _serve_http(args, sock, procs, info)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if procs is not None:
            procs.stop()
        if sock is not None:
            sock.close()
        TRACE.finish()  # the children have stopped: their parts are complete
