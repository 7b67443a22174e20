"""One logger for the whole package; `warning_rank0` and friends speak only from TP rank 0."""

from __future__ import annotations

import logging

from minisgl.env import ENV

_RANK = 0


class _Logger(logging.LoggerAdapter):
    def info_rank0(self, msg: str, *args: object) -> None:
        if _RANK == 0:
            self.info(msg, *args)

    def warning_rank0(self, msg: str, *args: object) -> None:
        if _RANK == 0:
            self.warning(msg, *args)


def set_log_rank(rank: int) -> None:
    global _RANK
    _RANK = rank


def init_logger(name: str) -> _Logger:
    base = logging.getLogger("minisgl")
    if not base.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
        )
        base.addHandler(handler)
        base.setLevel(str(ENV.LOG_LEVEL.value).upper())
        base.propagate = False
    return _Logger(logging.getLogger(name), {})
