"""Scheduler: receive -> pick a batch (prefill first) -> prepare -> forward -> handle results."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import count
from typing import Any

import torch

from minisgl.constrained.grammar import GrammarManager
from minisgl.core import Batch, ChunkedReq, Req, RequestError
from minisgl.engine.engine import ForwardOutput
from minisgl.engine.prepare import ForwardInput
from minisgl.engine.sample import LogprobsOutput, PromptLogprobsOutput
from minisgl.env import ENV
from minisgl.message import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, ExitMsg, UserMsg
from minisgl.message.backend import FlushCacheMsg
from minisgl.message.frontend import SchedulerStats
from minisgl.message.tokenizer import FlushCacheReply, TokenStepMsg
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.check import RequestLimits, check_request
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.io import SchedulerIOMixin
from minisgl.scheduler.prefill import PrefillManager
from minisgl.scheduler.table import TableManager
from minisgl.scheduler.utils import CacheStats, PendingReq
from minisgl.utils.hf import eos_token_ids, load_tokenizer
from minisgl.utils.logger import init_logger
from minisgl.utils.torch_utils import create_stream, pin, set_stream
from minisgl.utils.trace import TRACE

logger = init_logger(__name__)

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

        self.table_manager = TableManager(config.max_running_req, self.engine.token_pool)
        self.cache_manager = CacheManager(
            self.engine.num_pages,
            config.page_size,
            self.engine.page_table,
            config.cache_type,
            will_use=self.engine.kv_cache.will_use,
        )
        self.decode_manager = DecodeManager(config.page_size)
        self.prefill_manager = PrefillManager(
            self.cache_manager, self.table_manager, self.decode_manager, config.in_batch_prefix_share
        )

        self.finished_reqs: set[Req] = set()
        # under overlap scheduling a released slot can only be reallocated once any batch that might use it is done
        self._defer_slot_free = False
        self._deferred_slots: list[int] = []
        # the batch the device runs while the CPU handles the last one
        self._inflight_reqs: list[Req] = []
        self.limits = RequestLimits(
            self.engine.max_seq_len,
            self.engine.model_config.vocab_size,
            self.engine.num_pages,
            config.page_size,
        )
        self.tokenizer = load_tokenizer(self.engine.model_dir, config.chat_template)
        self.eos_token_ids = set(eos_token_ids(self.engine.model_dir, self.engine.hf_config, self.tokenizer))
        self._eos_ids = sorted(self.eos_token_ids)
        self.grammars = GrammarManager(
            self.tokenizer, self.engine.model_config.vocab_size, self._eos_ids, pin(self.device)
        )
        self.prefill_budget = config.max_extend_tokens
        if config.enable_mixed_chunk and self.device.type == "cuda":
            # a mixed step holds every running request, more than a prefill graph takes, so it runs eagerly and
            # its host launches outlast the device's work (docs/scheduling.md, "Mixed steps")
            logger.warning_rank0(
                "mixed steps run without CUDA graphs: on an H100 and an H200 they were slower than the plain "
                "schedule, offline and served (docs/benchmarks.md, 'Mixed steps on a GPU')"
            )
        # prompt logprobs of requests whose prompt is prefilled in chunks, gathered until the last chunk
        self._prompt_logprobs: dict[int, list[tuple[float, int, list[list[Any]]]]] = {}
        self.cache_stats = CacheStats()
        # called once per loop iteration with the prepared batch about to run (None when nothing runs):
        # tests and tools watch the schedule through this, never by replacing methods
        self.step_observers: list[Callable[[Batch | None], None]] = []
        super().__init__(config, self.engine.tp_cpu_group)
        rank, offline = config.tp_info.rank, config.offline_mode
        process = f"scheduler rank {rank}" if not offline or rank else "offline LLM"
        # offline, rank 0's process merges the parts; online, the launcher does
        TRACE.start(config.trace, process, owner=offline and rank == 0, device=self.device.type)

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
        finished (an EOS, or its grammar's end): that result is dropped through finished_reqs. A row
        freed while a batch in flight may still write it is handed out again only after that batch is done.

        A batch with constrained rows keeps the overlap too: its masks need step k's tokens, so only its
        model runs before step k's results are handled, and its sampling is launched after (`_launch`).
        """
        self._defer_slot_free = True
        busy = self.prefill_manager.runnable or self.decode_manager.runnable
        blocking = last_data is None and not busy
        self._process_msgs(self.receive_all(blocking))
        forward_input = self._schedule_next_batch()
        if forward_input is None:
            self._inflight_reqs = []
            self._process_last_data(last_data)
            # nothing is in flight: every freed row is safe to reuse
            self._release_deferred_slots()
            return None
        self._inflight_reqs = forward_input.batch.reqs
        return self._launch(forward_input, last_data)

    def normal_loop(self) -> None:
        """The plain loop: receive, schedule, forward, wait, handle results. The CPU and the device take turns."""
        # the plain loop has no in-flight batch, so the release takes effect at once
        self._defer_slot_free = False
        blocking = not (self.prefill_manager.runnable or self.decode_manager.runnable)
        self._process_msgs(self.receive_all(blocking))
        forward_input = self._schedule_next_batch()
        if forward_input is not None:
            self._process_last_data(self._launch(forward_input, None))

    def _schedule_next_batch(self) -> ForwardInput | None:
        TRACE.step_begin()
        # prefill first: prefill whenever anything is waiting and fits, decode otherwise
        batch = self._mixed_batch() if self.config.enable_mixed_chunk else None
        batch = (
            batch
            or self.prefill_manager.schedule_next_batch(self.prefill_budget)
            or self.decode_manager.schedule_next_batch()
        )
        forward_input = None
        if batch is not None:
            slots = None
            if batch.is_decode and self.cache_manager.page_size == 1:
                # the engine writes them to the page table with the step's other inputs: one copy, no gather
                slots = self.cache_manager.allocate_decode_slots(batch.reqs)
            else:
                self.cache_manager.allocate_paged(batch.reqs, decode=batch.is_decode)
            # the masks of constrained rows come later, when the tokens before them are known (_launch)
            forward_input = self.engine.prepare_batch(batch, self._eos_ids, slots)
        TRACE.step_prepared(batch)
        for observe in self.step_observers:
            observe(batch)
        return forward_input

    def _mixed_batch(self) -> Batch | None:
        """A prefill step that also decodes every running request (its last token an extend of one, over the
        KV it has), its budget less those tokens; a decode step where no prompt is admitted (no row or room), as
        without mixing; None where nothing waits, nothing runs, or the running requests alone would take the
        budget (the step is then a plain prefill or decode)."""
        running = self.decode_manager.running_reqs
        if not (self.prefill_manager.runnable and running) or len(running) >= self.prefill_budget:
            return None
        prefill = self.prefill_manager.schedule_next_batch(self.prefill_budget - len(running))
        if prefill is None:
            return self.decode_manager.schedule_next_batch()
        return Batch(reqs=prefill.reqs + list(running), phase="prefill")

    def _launch(self, forward_input: ForwardInput, last_data: ForwardData | None) -> ForwardData:
        """Launch step k+1 (`forward_input`) on the device and handle step k's results (`last_data`).

        Without constrained rows the whole step is queued at once, then step k is handled. With them the
        step is split: the model is queued, step k is handled while it runs (its tokens advance the
        grammar matchers), the masks are filled from the matchers and copied on the scheduler's stream,
        and the sampling is queued on the engine's stream behind that copy. Every rank takes the same
        path, so each waits for a grammar's compile at the same point (filling a mask or accepting a token).
        """
        batch = forward_input.batch
        split = self.grammars.constrains(batch.reqs)
        output: ForwardOutput | None = None
        with self.engine_stream_ctx:
            TRACE.forward_begin()
            if split:
                logits = self.engine.forward_model(forward_input)
            else:
                output = self.engine.forward_batch(forward_input)
            TRACE.forward_end()
        for req in batch.reqs:
            req.complete_one()
        self.decode_manager.filter_reqs(batch.reqs)
        self._process_last_data(last_data)
        if output is None:
            self.engine.set_token_mask(forward_input, self.grammars.fill_masks(batch.reqs))
            # the engine's stream waits for the scheduler's: the mask lands before the sampling reads it
            with self.engine_stream_ctx:
                output = self.engine.sample_batch(forward_input, logits)
                TRACE.step_sampled()
        return forward_input, output

    # ---- results -----------------------------------------------------------------------------
    def _process_last_data(self, last_data: ForwardData | None) -> None:
        if last_data is None:
            return
        TRACE.results_begin()
        batch, output = last_data[0].batch, last_data[1]
        logprobs = output.logprobs
        # the sample is on the CPU: this batch and every earlier one are done
        output.copy_done.synchronize()
        self._release_deferred_slots()
        reply: list[DetokenizeMsg | TokenStepMsg] = []
        # a token that carries nothing else (most of a decode step) goes out in two lists of ints, not as a
        # message of its own: one TokenStepMsg a step (the wire format's, message/tokenizer.py)
        plain_uids: list[int] = []
        plain_tokens: list[int] = []
        new_finished: set[Req] = set()
        # one conversion: indexing a tensor per request costs microseconds
        tokens = output.next_tokens_cpu.tolist()
        prompt_parts = _split_prompt_logprobs(output.prompt_logprobs, batch.reqs)
        is_prefill = batch.is_prefill
        grammars = self.grammars if self.grammars.active else None
        # these loops run for every request of every step (a decode step of 256 requests spent about a
        # millisecond of the host's time in one): a plain decode step takes only _decode_tokens' short one
        with self.cache_manager.lazy_free_region():
            rows: Iterable[tuple[int, Req, int]] = zip(count(), batch.reqs, tokens)
            rest: list[tuple[int, Req, int]] = []
            if is_prefill or prompt_parts is not None or logprobs is not None or grammars is not None:
                rows, rest = self._append_tokens(batch, tokens, prompt_parts, logprobs, grammars)
            rest += self._decode_tokens(rows, plain_uids, plain_tokens)
            for i, req, token in rest:
                reply.append(self._result_msg(i, req, token, is_prefill, logprobs, grammars, new_finished))
        if plain_uids:
            reply.insert(0, TokenStepMsg(plain_uids, plain_tokens))  # first, as pack_step orders them
        self.finished_reqs = new_finished
        TRACE.step_done(self, reply)
        self.reply(reply)
        TRACE.results_end()
        if ENV.DEBUG_CHECK_INTEGRITY.value:
            self.check_integrity()

    def _decode_tokens(
        self, rows: Iterable[tuple[int, Req, int]], plain_uids: list[int], plain_tokens: list[int]
    ) -> list[tuple[int, Req, int]]:
        """The decode rows (row, request, token) of requests without logprobs or a grammar, most of every decode
        step: each token appended, the plain ones (_finish_reason's decision written out: no stop token, short
        of max_tokens) into the two lists; the rest come back for a message of their own."""
        finished_reqs, eos = self.finished_reqs, self.eos_token_ids
        rest: list[tuple[int, Req, int]] = []
        for i, req, token in rows:
            if finished_reqs and req in finished_reqs:
                continue  # under overlap: it finished (or was aborted) last step but was already in this batch
            ids = req.input_ids
            ids.append(token)  # Req.append_host
            params = req.sampling_params
            if (
                len(ids) < req.max_device_len
                and (params.ignore_eos or token not in eos)
                and token not in params.stop_token_ids
            ):
                plain_uids.append(req.uid)
                plain_tokens.append(token)
            else:
                rest.append((i, req, token))
        return rest

    def _append_tokens(
        self,
        batch: Batch,
        tokens: list[int],
        prompt_parts: list[list[tuple[float, int, list[list[Any]]]]] | None,
        logprobs: LogprobsOutput | None,
        grammars: GrammarManager | None,
    ) -> tuple[list[tuple[int, Req, int]], list[tuple[int, Req, int]]]:
        """The general loop, for a step that is not plain decoding (a prefill, prompt logprobs, logprobs, a
        grammar): the rows that are plain decode rows after all (a decode step, no grammar, no logprobs asked),
        for _decode_tokens; and the others, their tokens appended (and grammars advanced), for a message each."""
        finished_reqs = self.finished_reqs
        plain_rows = batch.is_decode and grammars is None
        decode_rows: list[tuple[int, Req, int]] = []
        rows: list[tuple[int, Req, int]] = []
        for i, (req, token) in enumerate(zip(batch.reqs, tokens)):
            if prompt_parts is not None and prompt_parts[i] and req not in finished_reqs:
                self._prompt_logprobs.setdefault(req.uid, []).extend(prompt_parts[i])
            # a chunked request produces no output this step
            if isinstance(req, ChunkedReq):
                continue
            if plain_rows and (logprobs is None or req.sampling_params.logprobs is None):
                decode_rows.append((i, req, token))
                continue
            if finished_reqs and req in finished_reqs:
                # under overlap the request finished (or was aborted) last step but was already in this batch
                continue
            req.input_ids.append(token)  # Req.append_host
            if grammars is not None:
                grammars.accept(req.uid, token)
            rows.append((i, req, token))
        return decode_rows, rows

    def _result_msg(
        self,
        i: int,
        req: Req,
        token: int,
        is_prefill: bool,
        logprobs: LogprobsOutput | None,
        grammars: GrammarManager | None,
        new_finished: set[Req],
    ) -> DetokenizeMsg:
        """The message of row i's token (appended already): its logprobs, a prefill's prompt counts, its finish;
        a finished request's resources are freed, a prefilled one's prompt handed to the prefix cache."""
        uid, params = req.uid, req.sampling_params
        # a prompt's first token; a mixed step's decode rows (SchedulerConfig.enable_mixed_chunk) are not
        is_prefill = is_prefill and len(req.input_ids) == req.prompt_len + 1
        msg = DetokenizeMsg(uid=uid, next_token=token, finished=False)
        k = params.logprobs
        if logprobs is not None and k is not None:
            msg.logprob = float(logprobs.token_logprobs[i])
            msg.top_logprobs = list(
                zip(logprobs.top_ids[i, :k].tolist(), logprobs.top_logprobs[i, :k].tolist())
            )
        if is_prefill:
            msg.prompt_tokens, msg.cached_tokens = req.prompt_len, req.num_cached_tokens
            if params.prompt_logprobs is not None:
                # position p's entry is for the prompt token p + 1; the first token has none
                got = self._prompt_logprobs.pop(uid, [])
                ids = req.input_ids[: req.prompt_len]
                first: list[Any] = [ids[0], None, None, []]
                msg.prompt_logprobs = [first, *([t, *e] for t, e in zip(ids[1:], got))]
            self.cache_stats.prompt_tokens += req.prompt_len
            self.cache_stats.cached_tokens += req.num_cached_tokens
        # judged by the tokens the CPU has received, which does not depend on the scheduling rhythm
        reason = self._finish_reason(req, token, grammars)
        if reason is not None:
            msg.finished, msg.finish_reason = True, reason
            msg.matched_eos = reason == "stop" and token not in params.stop_token_ids
            self.decode_manager.remove_req(req)
            self._free_req_resources(req)
            new_finished.add(req)
        elif is_prefill:
            # prefill has just finished: hand the prompt's KV to the prefix cache right away
            self.cache_manager.cache_req(req, finished=False)
        return msg

    def _finish_reason(self, req: Req, token: int, grammars: GrammarManager | None) -> str | None:
        """The one finish decision on token ids: a stop token ("stop"), or max_tokens reached ("length").
        `grammars`: the scheduler's, or None when no request is constrained.

        Stop strings are text, so the detokenizer watches for them and aborts the request when one
        shows up. A "stop" here always means the last token is a stop token, which is not output.
        """
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if grammars is not None and grammars.is_done(req.uid):
            # the grammar accepted its stop token (an EOS): the output is complete
            return "stop"
        if len(req.input_ids) >= req.max_device_len:
            return "length"
        return None

    # ---- messages ----------------------------------------------------------------------------
    def _process_msgs(self, msgs: list[BaseBackendMsg]) -> None:
        # the SamplingParams objects of these messages checked so far, by id (the messages hold them, so the ids
        # stay theirs until the loop ends): LLM.generate sends one object for every prompt of a call
        checked: set[int] = set()
        for msg in msgs:
            self._process_one_msg(msg, checked)

    def _process_one_msg(self, msg: BaseBackendMsg, checked: set[int] | None = None) -> None:
        """`checked`: the ids of the SamplingParams objects that passed `check_params` among the messages this one
        arrived with (a server's messages each carry their own object, so only an offline call's repeat)."""
        if isinstance(msg, BatchBackendMsg):
            for m in msg.data:
                self._process_one_msg(m, checked)
        elif isinstance(msg, ExitMsg):
            raise KeyboardInterrupt
        elif isinstance(msg, UserMsg):
            try:
                params_id = id(msg.sampling_params)
                again = checked is not None and params_id in checked
                max_tokens = check_request(
                    msg.input_ids, msg.sampling_params, self.limits, params_checked=again
                )
                if checked is not None:
                    checked.add(params_id)
                self.grammars.add(msg.uid, msg.sampling_params)
            except RequestError as e:
                logger.warning_rank0(f"request {msg.uid} refused: {e}")
                TRACE.point(msg.uid, "refused", e.code)
                self.reply([DetokenizeMsg(msg.uid, -1, True, "error", str(e), error_code=e.code)])
                return
            params = msg.sampling_params
            pending = PendingReq(msg.uid, list(msg.input_ids), params, params.resolved_seed(), max_tokens)
            pending.rank = self.config.queue_rank(msg.priority)
            pending.cache_salt = msg.cache_salt
            self.prefill_manager.add_one_req(pending)
            TRACE.point(msg.uid, "queued")
        elif isinstance(msg, AbortBackendMsg):
            self._abort(msg.uid)
        elif isinstance(msg, FlushCacheMsg):
            self.reply([self.flush_cache(msg.uid)])
        else:
            raise NotImplementedError(f"Unknown message type: {type(msg)}")

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
        self.grammars.remove(uid)
        self._prompt_logprobs.pop(uid, None)
        TRACE.point(uid, "abort")
        self.reply([DetokenizeMsg(uid, -1, True, "abort")])

    def _free_req_resources(self, req: Req) -> None:
        self.grammars.remove(req.uid)
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

    # ---- checks, statistics and teardown -----------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """The scheduler's load right now: requests, table rows and KV pages."""
        cm = self.cache_manager
        return SchedulerStats(
            running=len(self.decode_manager.running_reqs),
            waiting=len(self.prefill_manager.pending_list),
            free_slots=self.table_manager.available_size,
            kv_pages_total=cm.num_pages,
            kv_pages_free=len(cm.free_pages),
            kv_pages_cached=cm.prefix_cache.total_pages,
            kv_pages_held=cm.private_pages(),
            kv_pages_evictable=cm.prefix_cache.evictable_pages,
            page_size=cm.page_size,
        )

    def flush_cache(self, uid: int = 0) -> FlushCacheReply:
        """Empty the prefix cache, only when no request runs or waits (SGLang's rule: a running request's
        pages are held, so a flush then would empty the cache only in part and tell a benchmark otherwise)."""
        busy = len(self.decode_manager.running_reqs) + len(self.prefill_manager.pending_list)
        if busy:
            return FlushCacheReply(
                uid, error=f"{busy} requests are running or waiting; flush once they are done"
            )
        freed = self.cache_manager.flush()
        logger.info_rank0(f"prefix cache flushed: {freed} pages freed")
        return FlushCacheReply(uid, freed)

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
        self.grammars.close()
        self.stop_other_ranks()
        self.engine.shutdown()
        TRACE.finish()

    def stop_other_ranks(self) -> None:
        """Offline, rank 0's owner waits here for the other ranks to end (their trace parts are complete)."""


def _split_prompt_logprobs(
    out: PromptLogprobsOutput | None, reqs: list[Req]
) -> list[list[tuple[float, int, list[list[Any]]]]] | None:
    """Each request's (log-probability, rank, top [[id, log-probability], ...]) of this step's prompt positions
    (None: no request of the step asked)."""
    if out is None:
        return None
    lps, ranks = out.token_logprobs.tolist(), out.ranks.tolist()
    top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
    parts, start = [], 0
    for req, n in zip(reqs, out.counts):
        k = req.sampling_params.prompt_logprobs or 0
        part = [
            (lps[j], ranks[j], [list(x) for x in zip(top_ids[j][:k], top_lps[j][:k])])
            for j in range(start, start + n)
        ]
        parts.append(part)
        start += n
    return parts


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
