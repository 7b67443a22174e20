"""TableManager: the rows of the page table and the token pool, one per running request."""

from __future__ import annotations

import torch


class TableManager:
    def __init__(self, max_running_req: int, token_pool: torch.Tensor) -> None:
        self.max_running_req = max_running_req
        # the engine's token pool: an admitted request's prompt is written into its row
        self.token_pool = token_pool
        self._free_slots = list(range(max_running_req))

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free_slots, f"table row {slot} freed twice"
        self._free_slots.append(slot)
