"""DecodeManager: the requests that are decoding."""

from __future__ import annotations

from collections.abc import Iterable, ValuesView
from dataclasses import dataclass, field

from minisgl.core import Batch, Req


@dataclass
class DecodeManager:
    page_size: int
    # by uid, in the order they joined: every TP rank takes the same messages in the same order, so this order is
    # the same on every rank and a batch is built without a sort (a set, iterated by object address, was sorted)
    running: dict[int, Req] = field(default_factory=dict)

    @property
    def running_reqs(self) -> ValuesView[Req]:
        return self.running.values()

    def filter_reqs(self, reqs: Iterable[Req]) -> None:
        """After a forward pass: this step's requests that can decode join (or stay), the others leave. A
        request not in the step has not changed, so only the step's are looked at."""
        running = self.running
        for req in reqs:
            if req.can_decode:
                running[req.uid] = (
                    req  # a prompt's last chunk is a new Req of the same uid: it takes the place
                )
            elif running.get(req.uid) is req:
                del running[req.uid]

    def remove_req(self, req: Req) -> None:
        if self.running.get(req.uid) is req:
            del self.running[req.uid]

    def abort_req(self, uid: int) -> Req | None:
        return self.running.pop(uid, None)

    @property
    def inflight_tokens(self) -> int:
        """How many more tokens of KV the running requests may still take (plus one page of slack each)."""
        reserved = (self.page_size - 1) * len(self.running)
        return sum(req.remain_len for req in self.running.values()) + reserved

    def schedule_next_batch(self) -> Batch | None:
        if not self.runnable:
            return None
        return Batch(reqs=list(self.running.values()), phase="decode")

    @property
    def runnable(self) -> bool:
        return len(self.running) > 0
