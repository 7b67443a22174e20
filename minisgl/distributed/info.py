"""Which tensor-parallel rank this process is, of how many."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not (0 <= self.rank < self.size):
            raise ValueError(f"tensor parallel rank {self.rank} of {self.size} is not valid")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO = DistributedInfo(0, 1)


def set_tp_info(info: DistributedInfo) -> None:
    global _TP_INFO
    _TP_INFO = info


def get_tp_info() -> DistributedInfo:
    return _TP_INFO
