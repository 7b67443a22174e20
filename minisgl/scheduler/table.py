"""TableManager: the rows of the page table and the token pool, one per running request."""

from __future__ import annotations

import torch


class TableManager:
    def __init__(self, max_running_req: int, page_table: torch.Tensor) -> None:
        self.max_running_req = max_running_req
        self.page_table = page_table
        # token_pool[row, pos] is the token at position pos of the request in that row, kept on the device
        self.token_pool = torch.zeros_like(page_table)
        self._free_slots = list(range(max_running_req))

    @property
    def available_size(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        assert slot not in self._free_slots, f"table row {slot} freed twice"
        self._free_slots.append(slot)
