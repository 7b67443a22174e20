"""Scheduler: receive -> pick a batch (prefill first) -> prepare -> forward -> handle results."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from minisgl.core import Batch, ChunkedReq, Req
from minisgl.engine.engine import ForwardOutput
from minisgl.engine.sample import BatchSamplingArgs
from minisgl.env import ENV
from minisgl.message import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, ExitMsg, UserMsg
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.io import SchedulerIOMixin
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.table import TableManager
from minisgl.scheduler.utils import CacheStats, PendingReq
from minisgl.utils.hf import eos_token_ids, load_tokenizer
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import div_ceil
from minisgl.utils.torch_utils import create_stream, pin, set_stream

logger = init_logger(__name__)

Indice2D = tuple[torch.Tensor, torch.Tensor]


class ForwardInput(NamedTuple):
    batch: Batch
    sample_args: BatchSamplingArgs
    input_mapping: Indice2D
    write_mapping: Indice2D


ForwardData = tuple[ForwardInput, ForwardOutput]


class Scheduler(SchedulerIOMixin):
    def __init__(self, config: SchedulerConfig):
        from minisgl.engine import Engine

        config.validate()
        self.engine = Engine(config)
        self.config = config
        # the scheduler prepares metadata on its own stream while the engine computes on another, so the two overlap
        self.device = self.engine.device
        self.stream = create_stream(self.device)
        self.engine_stream_ctx = _EngineStreamCtx(self.engine.stream, self.stream)
        set_stream(self.stream)

        self.table_manager = TableManager(config.max_running_req, self.engine.page_table)
        self.cache_manager = CacheManager(
            self.engine.num_pages, config.page_size, self.engine.page_table, config.cache_type
        )
        self.decode_manager = DecodeManager(config.page_size)
        self.prefill_manager = PrefillManager(
            self.cache_manager, self.table_manager, self.decode_manager, config.in_batch_prefix_share
        )

        self.finished_reqs: set[Req] = set()
        # under overlap scheduling a released slot can only be reallocated once any batch that might use it is done
        self._defer_slot_free = False
        self._deferred_slots: list[int] = []
        self._inflight_reqs: list[Req] = []  # the batch the device runs while the CPU handles the last one
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self.eos_token_ids = set(eos_token_ids(self.engine.model_dir, self.engine.hf_config, self.tokenizer))
        self.eos_token_id = self.tokenizer.eos_token_id
        self.token_pool = self.table_manager.token_pool
        self.prefill_budget = config.max_extend_tokens
        self.cache_stats = CacheStats()
        super().__init__(config, self.engine.tp_cpu_group)

    # ---- the loop ----------------------------------------------------------------------------
    def run_forever(self) -> None:
        if self.device.type == "cuda" and not ENV.DISABLE_OVERLAP_SCHEDULING.value:
            last_data: ForwardData | None = None
            while True:
                last_data = self.overlap_loop(last_data)
        while True:
            self.normal_loop()

    def overlap_loop(self, last_data: ForwardData | None) -> ForwardData | None:
        """The overlap loop: launch step k+1, then handle step k's results while the device runs it.

        Batch k+1 is built before step k's tokens are known, so it may hold a request that step k
        finished (an EOS): that result is dropped through finished_reqs. A row freed while a batch
        in flight may still write it is handed out again only after that batch is done.
        """
        self._defer_slot_free = True
        busy = self.prefill_manager.runnable or self.decode_manager.runnable
        blocking = last_data is None and not busy
        for msg in self.receive_msg(blocking=blocking):
            self._process_one_msg(msg)
        forward_input = self._schedule_next_batch()
        ongoing = None
        if forward_input is not None:
            with self.engine_stream_ctx:
                ongoing = (forward_input, self._forward(forward_input))
        self._inflight_reqs = ongoing[0].batch.reqs if ongoing is not None else []
        self._process_last_data(last_data)
        if ongoing is None:
            self._release_deferred_slots()  # nothing is in flight: every freed row is safe to reuse
        return ongoing

    def normal_loop(self) -> None:
        """The plain loop: receive, schedule, forward, wait, handle results. The CPU and the device take turns."""
        self._defer_slot_free = (
            False  # the plain loop has no in-flight batch, so the release takes effect at once
        )
        blocking = not (self.prefill_manager.runnable or self.decode_manager.runnable)
        for msg in self.receive_msg(blocking=blocking):
            self._process_one_msg(msg)
        forward_input = self._schedule_next_batch()
        ongoing = None
        if forward_input is not None:
            with self.engine_stream_ctx:
                ongoing = (forward_input, self._forward(forward_input))
        self._process_last_data(ongoing)

    def _schedule_next_batch(self) -> ForwardInput | None:
        # prefill first: prefill whenever anything is waiting and fits, decode otherwise
        batch = (
            self.prefill_manager.schedule_next_batch(self.prefill_budget)
            or self.decode_manager.schedule_next_batch()
        )
        return self._prepare_batch(batch) if batch else None

    def _prepare_batch(self, batch: Batch) -> ForwardInput:
        self.engine.graph_runner.pad_batch(batch)
        self.cache_manager.allocate_paged(batch.reqs)
        batch.positions = _make_positions(batch, self.device)
        input_mapping = _make_input_tuple(batch, self.device)
        write_mapping = _make_write_tuple(batch, self.device)
        batch.out_loc = self.engine.page_table[input_mapping].to(torch.int64)
        if batch.is_prefill:
            batch.last_indices = _make_last_indices(batch, self.device)
        self.engine.attn_backend.prepare_metadata(batch)
        return ForwardInput(
            batch, self.engine.sampler.prepare(batch, self.token_pool), input_mapping, write_mapping
        )

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        batch, sample_args, input_mapping, write_mapping = forward_input
        batch.input_ids = self.token_pool[
            input_mapping
        ]  # the input is gathered on the device, never through the CPU
        output = self.engine.forward_batch(batch, sample_args)
        self.token_pool[write_mapping] = (
            output.next_tokens_gpu
        )  # the sample is written straight back as the next step's input
        self.decode_manager.filter_reqs(batch.reqs)
        return output

    # ---- results -----------------------------------------------------------------------------
    def _process_last_data(self, last_data: ForwardData | None) -> None:
        if last_data is None:
            return
        batch, (_, next_tokens_cpu, copy_done) = last_data[0].batch, last_data[1]
        logprobs = last_data[1].logprobs
        copy_done.synchronize()  # the sample is on the CPU: this batch and every earlier one are done
        self._release_deferred_slots()
        reply: list[DetokenizeMsg] = []
        new_finished: set[Req] = set()
        tokens = next_tokens_cpu.tolist()  # one conversion: indexing a tensor per request costs microseconds
        with self.cache_manager.lazy_free_region():
            for i, req in enumerate(batch.reqs):
                if isinstance(req, ChunkedReq):  # a chunked request produces no output this step
                    continue
                if req in self.finished_reqs:
                    # under overlap the request finished (or was aborted) last step but was already in this batch
                    continue
                token = tokens[i]
                req.append_host(token)
                msg = DetokenizeMsg(uid=req.uid, next_token=token, finished=False)
                k = req.sampling_params.logprobs
                if logprobs is not None and k is not None:
                    msg.logprob = float(logprobs.token_logprobs[i])
                    msg.top_logprobs = list(
                        zip(logprobs.top_ids[i, :k].tolist(), logprobs.top_logprobs[i, :k].tolist())
                    )
                if batch.is_prefill:
                    msg.prompt_tokens, msg.cached_tokens = req.prompt_len, req.num_cached_tokens
                    self.cache_stats.prompt_tokens += req.prompt_len
                    self.cache_stats.cached_tokens += req.num_cached_tokens
                # judged by the tokens the CPU has received, which does not depend on the scheduling rhythm
                reason = self._finish_reason(req, token)
                msg.finished, msg.finish_reason = reason is not None, reason
                reply.append(msg)
                if reason is not None:
                    self.decode_manager.remove_req(req)
                    self._free_req_resources(req)
                    new_finished.add(req)
                elif (
                    batch.is_prefill
                ):  # prefill has just finished: hand the prompt's KV to the prefix cache right away
                    self.cache_manager.cache_req(req, finished=False)
        self.finished_reqs = new_finished
        self.send_result(reply)
        if ENV.DEBUG_CHECK_INTEGRITY.value:
            self.check_integrity()

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._hit_stop_string(req):
            return "stop"
        if len(req.input_ids) >= req.max_device_len:
            return "length"
        return None

    def _hit_stop_string(self, req: Req) -> bool:
        stops = req.sampling_params.stop
        # a stop string first shows up in the text of the newest tokens; a token is rarely empty, so this window covers it
        window = max(len(s) for s in stops) + 4
        start = max(req.prompt_len, len(req.input_ids) - window)
        text = self.tokenizer.decode(req.input_ids[start:])
        return any(s in text for s in stops)

    # ---- messages ----------------------------------------------------------------------------
    def _process_one_msg(self, msg: BaseBackendMsg) -> None:
        if isinstance(msg, BatchBackendMsg):
            for m in msg.data:
                self._process_one_msg(m)
        elif isinstance(msg, ExitMsg):
            raise KeyboardInterrupt
        elif isinstance(msg, UserMsg):
            error = self._check_user_msg(msg)
            if error is not None:
                logger.warning_rank0(f"request {msg.uid} refused: {error}")
                self.send_result([DetokenizeMsg(msg.uid, -1, True, "error", error)])
                return
            params = msg.sampling_params
            params.max_tokens = min(params.max_tokens, self.engine.max_seq_len - len(msg.input_ids))
            self.prefill_manager.add_one_req(
                PendingReq(msg.uid, list(msg.input_ids), params, params.resolved_seed())
            )
        elif isinstance(msg, AbortBackendMsg):
            self._abort(msg.uid)
        else:
            raise NotImplementedError(f"Unknown message type: {type(msg)}")

    def _check_user_msg(self, msg: UserMsg) -> str | None:
        """What is wrong with a request, in words that say what to change; None if it can run."""
        try:
            msg.sampling_params.validate()
        except ValueError as e:
            return str(e)
        input_len, max_seq_len = len(msg.input_ids), self.engine.max_seq_len
        if input_len == 0:
            return "the prompt is empty; send at least one token"
        vocab = self.engine.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in msg.input_ids):
            return f"the prompt has token ids outside the vocabulary [0, {vocab})"
        if input_len >= max_seq_len:
            return (
                f"the prompt has {input_len} tokens; this model takes at most {max_seq_len - 1} "
                f"prompt tokens (context length {max_seq_len}, one token left to generate). Shorten the prompt."
            )
        max_tokens = min(msg.sampling_params.max_tokens, max_seq_len - input_len)
        ps = self.config.page_size
        # the same whole pages PrefillAdder asks for, so a request that passes here is admitted once the pool is idle
        if div_ceil(input_len + max_tokens, ps) > self.engine.num_pages:
            room = self.engine.num_pages * ps - input_len
            fix = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
            return (
                f"the prompt ({input_len} tokens) plus max_tokens ({max_tokens}) needs {input_len + max_tokens} "
                f"tokens of KV cache, but the whole pool holds {self.engine.num_pages * ps}; {fix}"
            )
        return None

    def _abort(self, uid: int) -> None:
        pending = self.prefill_manager.abort_req(uid)
        req: Req | None = None
        if pending is not None:
            req = pending.chunked_req  # a request mid-chunk holds a row, pages and cache locks
        else:
            req = self.decode_manager.abort_req(uid)
            if req is None:
                return  # already finished, or never known: nothing is held
        if req is not None:
            self._free_table_slot(req.table_idx)
            self.cache_manager.free_req(req)
            # under overlap it may still be in an in-flight batch: its result there is dropped
            self.finished_reqs.add(req)
        self.send_result([DetokenizeMsg(uid, -1, True, "abort")])

    def _free_req_resources(self, req: Req) -> None:
        self._free_table_slot(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)

    def _free_table_slot(self, slot: int) -> None:
        if self._defer_slot_free:
            self._deferred_slots.append(slot)
        else:
            self.table_manager.free(slot)

    def _release_deferred_slots(self) -> None:
        for slot in self._deferred_slots:
            self.table_manager.free(slot)
        self._deferred_slots.clear()

    # ---- checks and teardown -------------------------------------------------------------------
    def abort_all(self) -> None:
        """Abort every waiting and running request, freeing what each holds (after an error in the loop)."""
        uids = [p.uid for p in self.prefill_manager.pending_list] + [
            r.uid for r in self.decode_manager.running_reqs
        ]
        for uid in uids:
            self._abort(uid)
        self._release_deferred_slots()

    def check_integrity(self) -> None:
        """Every KV page is free, cached or held by a running request; every table row is free or in use."""
        self.cache_manager.check_integrity()
        held_rows = {r.table_idx for r in self.decode_manager.running_reqs}
        held_rows |= {p.chunked_req.table_idx for p in self.prefill_manager.pending_list if p.chunked_req}
        # under overlap, requests of the batch in flight hold their rows until its results are handled
        held_rows |= {r.table_idx for r in self._inflight_reqs if r not in self.finished_reqs}
        if held_rows != set(self.cache_manager.rows):
            raise AssertionError(
                f"rows with KV pages {sorted(self.cache_manager.rows)} != rows in use {sorted(held_rows)}"
            )
        free = self.table_manager.available_size + len(self._deferred_slots)
        if free + len(held_rows) != self.table_manager.max_running_req:
            raise AssertionError(
                f"table rows broken: {free} free + {len(held_rows)} held != {self.table_manager.max_running_req}"
            )

    def shutdown(self) -> None:
        self.close_io()
        self.engine.shutdown()


class _EngineStreamCtx:
    """Runs a block on the engine's stream, after what the scheduler's stream has queued for the batch.

    The batch's inputs (host-to-device copies, page-table writes) are queued on the scheduler's stream;
    the forward pass on the engine's stream must not start before they land.
    """

    def __init__(self, engine_stream: Any, scheduler_stream: Any) -> None:
        self.engine_stream = engine_stream
        self.scheduler_stream = scheduler_stream
        self._ctx: Any = None

    def __enter__(self) -> None:
        if self.engine_stream is None:
            return
        self.engine_stream.wait_stream(self.scheduler_stream)
        self._ctx = torch.cuda.stream(self.engine_stream)
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None


def _lens(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    reqs = batch.padded_reqs
    starts = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
    lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
    return starts, lens


def _make_positions(batch: Batch, device: torch.device) -> torch.Tensor:
    """[cached_len, device_len) of every request, packed into one dimension."""
    starts, lens = _lens(batch)
    if batch.is_decode:
        return starts.pin_memory().to(device, non_blocking=True) if pin(device) else starts
    offsets = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    pos = torch.arange(int(lens.sum())) - offsets + torch.repeat_interleave(starts, lens)
    return pos.to(device, non_blocking=True)


def _make_input_tuple(batch: Batch, device: torch.device) -> Indice2D:
    """(row, position) of every input token: the input comes from the token pool, its KV slot from the page table."""
    _, lens = _lens(batch)
    rows = torch.repeat_interleave(
        torch.tensor([r.table_idx for r in batch.padded_reqs], dtype=torch.int64), lens
    )
    return rows.to(device, non_blocking=True), batch.positions


def _make_write_tuple(batch: Batch, device: torch.device) -> Indice2D:
    """The sampled token is written to token_pool[table_idx, device_len], the next step's input position.

    A column of -1 means do not write: a chunked request, or one that can no longer generate
    (writing -1 lands in the last column, harmlessly). device_len is incremented inside
    forward_batch, so the value read here is the one before: exactly the new token's position.
    """
    rows = torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64, pin_memory=pin(device))
    cols = torch.tensor(
        [r.device_len if r.can_decode else -1 for r in batch.reqs], dtype=torch.int64, pin_memory=pin(device)
    )
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)


def _make_last_indices(batch: Batch, device: torch.device) -> torch.Tensor:
    _, lens = _lens(batch)
    return (torch.cumsum(lens, 0) - 1).to(device, non_blocking=True)
