"""LLM: the offline interface, a Scheduler that takes its requests from a list and keeps its results."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.llm.inputs import (
    Prompt,
    conversation_list,
    prompt_list,
    sampling_list,
    sglang_prompts,
    tool_plan,
)
from minisgl.llm.options import llm_options, option_names
from minisgl.llm.outputs import RequestOutput
from minisgl.llm.progress import GenerateProgress, GenerationInterrupted
from minisgl.message import AbortBackendMsg, BaseBackendMsg, DetokenizeMsg, UserMsg
from minisgl.message.backend import FlushCacheMsg
from minisgl.message.tokenizer import TokenStepMsg
from minisgl.params import INT64_MAX, INT64_MIN, choice_params
from minisgl.scheduler.check import check_params
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.ranks import RankProcesses, check_tp, free_tcp_addr
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, step_batch
from minisgl.tokenizer.template_kwargs import TemplateKwargsCheck
from minisgl.tokenizer.tool_parser import ToolSupport, detect_tool_support
from minisgl.utils.hf import chat_template_ids
from minisgl.utils.torch_utils import parse_dtype
from minisgl.utils.trace import TRACE


class RequestAllFinished(Exception):
    """Raised from receive_msg when every request has its answer: it ends run_forever."""


@dataclass
class RequestStatus:
    uid: int
    input_ids: list[int]
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    # with prompt_logprobs: None for the first prompt token, then {token id: log-probability} of the prompt
    # token and the most likely ones
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with logprobs: {token id: log-probability} of each output token and the most likely ones
    logprobs: list[dict[int, float]] | None = None
    prompt: str | None = None  # the prompt's text where it came as text (vLLM's RequestOutput.prompt)
    index: int = 0  # which of its prompt's n completions
    # the stop string or stop_token_ids id that ended it (vLLM's stop_reason; None for EOS or a length)
    stop_reason: int | str | None = None


@dataclass
class _Pending:
    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0


class LLM(Scheduler):
    """The offline inference interface: no processes at all, reusing the scheduler's main loop directly.

    It overrides the scheduler's two IO methods: receive_msg takes requests from the pending list
    (feeding them in within the prefill budget) and send_result records the generated tokens. Once
    everything is done and the scheduler would block for a new message, RequestAllFinished breaks
    out of run_forever.
    """

    def __init__(
        self,
        model_path: str | None = None,
        dtype: torch.dtype | str | None = "auto",
        tp_size: int | None = None,
        **kwargs: Any,
    ):
        """`tp_size` > 1 runs rank 0 in this process and starts the other ranks as child processes. The other
        options are SchedulerConfig's, under vLLM's and SGLang's names too (`model`, `tensor_parallel_size`,
        `max_model_len`, `enforce_eager`, ...: llm/options.py)."""
        kwargs = llm_options(kwargs, option_names())
        for name, value in (("model_path", model_path), ("tp_size", tp_size)):
            if name in kwargs and value is not None:
                raise TypeError(f"LLM() got {name} twice, under two names; pass one")
        model_path = kwargs.pop("model_path", model_path)
        tp_size = kwargs.pop("tp_size", tp_size) or 1
        config = SchedulerConfig(
            model_path=model_path,
            tp_info=DistributedInfo(0, tp_size),
            dtype=parse_dtype(dtype),
            offline_mode=True,
            **kwargs,
        )
        self._ranks: RankProcesses | None = None
        if tp_size > 1:
            config.validate()
            config.model_path = check_tp(config)
            config.distributed_addr = free_tcp_addr()
            self._ranks = RankProcesses(config, 1, tp_size)
        try:
            if self._ranks is not None:
                self._ranks.wait_started()
            super().__init__(config)
            if self._ranks is not None:
                self._ranks.wait_ready()
        except BaseException:
            if self._ranks is not None:
                self._ranks.kill()
            raise
        self.pending_requests: list[_Pending] = []
        self.status_map: dict[int, RequestStatus] = {}
        self._abort_queue: list[int] = []
        self._progress = GenerateProgress(0, enabled=False)
        self._check_template_kwargs = TemplateKwargsCheck(self.tokenizer)
        self._tool_support: ToolSupport | None = None  # read from the chat template at the first chat

    def _tokenize_one(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return prompt

    def receive_msg(self, blocking: bool = False) -> list[BaseBackendMsg]:
        aborts = set(self._abort_queue)
        self._abort_queue.clear()
        # a request not yet handed to the scheduler holds nothing there: it is answered here
        unsent = aborts & {p.uid for p in self.pending_requests}
        self.pending_requests = [p for p in self.pending_requests if p.uid not in unsent]
        self.send_result([DetokenizeMsg(uid, -1, True, "abort") for uid in sorted(unsent)])
        results: list[BaseBackendMsg] = [AbortBackendMsg(uid) for uid in sorted(aborts - unsent)]
        if blocking and not self.pending_requests and not results:
            raise RequestAllFinished()
        added = total_len = 0
        for pending in self.pending_requests:
            if total_len >= self.prefill_budget:
                break
            total_len += len(pending.input_ids)
            added += 1
            results.append(UserMsg(pending.uid, pending.input_ids, pending.sampling_params, pending.priority))
        self.pending_requests = self.pending_requests[added:]
        return results

    def send_result(self, reply: list[DetokenizeMsg | TokenStepMsg]) -> None:
        msgs: list[DetokenizeMsg] = []
        for m in reply:
            if isinstance(m, TokenStepMsg):
                msgs += self._take_tokens(m)
            else:
                msgs.append(m)
        self._send_messages(msgs)

    def _take_tokens(self, step: TokenStepMsg) -> list[DetokenizeMsg]:
        """A step's plain tokens into the outputs; those that need the detokenizers' step (a detokenizer
        that decodes as it goes, or a request answered already) come back as messages."""
        status_map = self.status_map
        rest: list[DetokenizeMsg] = []
        for uid, token in zip(step.uids, step.tokens):
            status = status_map[uid]
            detokenizer = status.detokenizer
            # what IncrementalDetokenizer.take_plain does, written out (a call a token cost a tenth of this
            # loop's time); a plain token is never negative and ends nothing
            if detokenizer.lazy and status.finish_reason is None:
                detokenizer.ids.append(token)
                status.output_ids.append(token)
            else:
                rest.append(DetokenizeMsg(uid, token, False))
        self._progress.add_tokens(len(step.uids) - len(rest))
        return rest

    def _send_messages(self, reply: list[DetokenizeMsg]) -> None:
        # a step's messages go through the detokenizers together (one call, as the server's tokenizer worker
        # does), each request at most once a call: a request answered twice (an abort racing a finish under
        # overlap) has its second message in a call after the first
        if len({m.uid for m in reply}) == len(reply):
            self._send_results(reply)
            return
        start = 0
        while start < len(reply):
            seen: set[int] = set()
            end = start
            while end < len(reply) and reply[end].uid not in seen:
                seen.add(reply[end].uid)
                end += 1
            self._send_results(reply[start:end])
            start = end

    def _send_results(self, reply: list[DetokenizeMsg]) -> None:
        """send_result for messages of distinct requests."""
        status_map, progress = self.status_map, self._progress
        todo: list[tuple[RequestStatus, DetokenizeMsg]] = []
        for msg in reply:
            status = status_map[msg.uid]
            if status.finish_reason is not None:
                progress.update(msg)
                continue  # the first answer stands (an abort racing a finish under overlap sends both)
            # most of a step: a token past the first, nothing to decode or end
            if not msg.prompt_tokens and msg.prompt_logprobs is None and status.detokenizer.take_plain(msg):
                status.output_ids.append(msg.next_token)
                if status.logprobs is not None and msg.logprob is not None:
                    status.logprobs.append({msg.next_token: msg.logprob, **dict(msg.top_logprobs or [])})
                progress.update(msg)
                continue
            if msg.prompt_tokens:
                status.cached_tokens = msg.cached_tokens
            if msg.prompt_logprobs is not None:
                status.prompt_logprobs = [
                    None if lp is None else {token: lp, **{int(t): x for t, x in top}}
                    for token, lp, _, top in msg.prompt_logprobs
                ]
            todo.append((status, msg))
        steps = step_batch(self.tokenizer, [(status.detokenizer, msg) for status, msg in todo])
        for (status, msg), step in zip(todo, steps):
            if step.output_token is not None:
                status.output_ids.append(step.output_token)
                if status.logprobs is not None and msg.logprob is not None:
                    status.logprobs.append({msg.next_token: msg.logprob, **dict(msg.top_logprobs or [])})
            if step.abort:
                self._abort_queue.append(msg.uid)
            if step.finished:
                status.finish_reason, status.error = step.finish_reason, msg.error
                if step.finish_reason == "stop":  # a stop string, else the stop token unless it was an EOS
                    detokenizer = status.detokenizer
                    status.stop_reason = (
                        detokenizer.matched
                        if detokenizer.stopped
                        else (None if msg.matched_eos else msg.next_token)
                    )
                TRACE.point(msg.uid, "answer", step.finish_reason)
            # the bar last: a Ctrl-C typed on seeing it count a request finds that request finished
            progress.update(msg)

    def abort(self, uid: int) -> None:
        """Abort request `uid` of the running generate call (from a callback or another thread)."""
        self._abort_queue.append(uid)

    def generate(
        self,
        prompts: Any = None,
        sampling_params: Any = None,
        use_tqdm: bool | None = None,
        priority: list[int] | None = None,
        *,
        prompt: Any = None,
        input_ids: Any = None,
    ) -> list[RequestOutput] | RequestOutput:
        """Generate for every prompt; each output is a dict with text, token_ids, finish_reason, stop_reason and
        error that also reads as vLLM's RequestOutput (`out.outputs[0].text`, `out.prompt`; llm/outputs.py). With
        `SamplingParams(n=k)` a prompt has k outputs in a row (SGLang's offline shape: len(prompts) * k outputs
        for one n), the prompt tokenized once and, from in_batch_prefix_share tokens, computed once; with a seed,
        completion i is seeded seed + i, as the server seeds its choices.

        `prompts`: a prompt or a list of them, each a string, a list of token ids, or vLLM's prompt dicts
        ({"prompt": text}, {"prompt_token_ids": ids}); another shape is a ValueError naming it. `sampling_params`:
        one for every prompt or one each, each a SamplingParams or a dict of its fields (SGLang's way, its names
        such as max_new_tokens too).

        SGLang's keywords instead of `prompts`: `prompt=` (a string or a list) or `input_ids=` (token ids or a list
        of them); then, as SGLang's `Engine.generate` does, one prompt alone gets one output, not a list of one.

        `priority` (one integer a prompt, vLLM's argument) orders the prompts' admission under priority
        scheduling (`LLM(..., priority_scheduling=True)`: higher values first, or lower with
        `low_priority_values_first=True`), equal ones in the list's order; without it, a ValueError.

        With `logprobs=k`, `logprobs` holds, for each of token_ids, {token id: log-probability} of that
        token and the k most likely (vLLM's shape, as dicts); with `prompt_logprobs=k`, `prompt_logprobs`
        the same for each prompt token (None for the first).

        Invalid sampling parameters raise ValueError before anything is scheduled. A prompt the model
        cannot take gets finish_reason "error" and a message, while the others complete.
        `use_tqdm` shows a progress bar on stderr (None: when stderr is a terminal).
        Ctrl-C raises GenerationInterrupted, a KeyboardInterrupt whose `outputs` hold every prompt's
        output: what finished as usual, the rest with finish_reason "abort" and the tokens so far.
        """
        alone = False
        if prompts is None and prompt is None and input_ids is None:
            raise ValueError(
                "prompts=None is invalid: pass a prompt or a list of prompts (or SGLang's prompt= or input_ids=)"
            )
        if prompts is not None:
            if prompt is not None or input_ids is not None:
                raise ValueError("pass the prompts once: as prompts, or as SGLang's prompt= or input_ids=")
            prompts = prompt_list(prompts)
        else:
            prompts, alone = sglang_prompts(prompt, input_ids)
        outputs = self._generate(prompts, sampling_list(sampling_params, len(prompts)), use_tqdm, priority)
        return outputs[0] if alone and len(outputs) == 1 else outputs

    def _generate(
        self,
        prompts: list[Prompt],
        sampling_params: list[SamplingParams],
        use_tqdm: bool | None,
        priority: list[int] | None,
    ) -> list[RequestOutput]:
        # one object for every prompt: checked once
        for sp in {id(sp): sp for sp in sampling_params}.values():
            check_params(sp)
        priorities = self._priorities(priority, len(prompts))
        if self._ranks is not None and not self._ranks.alive():
            raise RuntimeError(
                "a tensor-parallel rank has stopped (after an error or an interrupt); build a new LLM"
            )
        self.pending_requests, self.status_map = [], {}
        self._abort_queue.clear()  # uids start from 0 again: an old abort must not hit a new request
        # a prompt's n completions in a row (SGLang's offline shape), the prompt tokenized once; the scheduler
        # holds the others back a step to find it in the prefix cache (in_batch_prefix_share)
        jobs: list[tuple[list[int], SamplingParams, int, str | None, int]] = []
        for prompt, sp, rank in zip(prompts, sampling_params, priorities):
            ids = self._tokenize_one(prompt)  # a list of its own (prompt_list's or the tokenizer's)
            choices = choice_params(replace(sp, n=1), sp.n) if sp.n > 1 else [sp]
            text = prompt if isinstance(prompt, str) else None
            # a list each: a request's ids grow with its output
            jobs += [
                (ids if i == 0 else list(ids), choice, rank, text, i) for i, choice in enumerate(choices)
            ]
        for uid, (input_ids, sp, rank, text, index) in enumerate(jobs):
            self.pending_requests.append(_Pending(uid, input_ids, sp, rank))
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                sp.stop,
                streaming=False,
                min_tokens=sp.min_tokens,
                skip_special_tokens=sp.skip_special_tokens,
                keep_stop=sp.include_stop_str_in_output,
            )
            self.status_map[uid] = RequestStatus(
                uid,
                input_ids,
                detokenizer,
                logprobs=[] if sp.logprobs is not None else None,
                prompt=text,
                index=index,
            )
        # handed to the scheduler in the order its queue keeps (the sort is stable: ties stay in the list's order)
        self.pending_requests.sort(key=lambda p: self.config.queue_rank(p.priority))
        self._progress = GenerateProgress(len(jobs), use_tqdm)
        TRACE.arrivals(list(self.status_map))
        try:
            self.run_forever()
        except RequestAllFinished:
            pass
        except KeyboardInterrupt:
            self._progress.close()  # the bar stops at what finished: the aborts that follow are not progress
            self._stop_ranks_after_error()
            self.abort_all()
            raise GenerationInterrupted(
                [self._output(self.status_map[i]) for i in range(len(jobs))]
            ) from None
        except BaseException:
            self._stop_ranks_after_error()
            self.abort_all()  # an error mid-run must not leave rows and pages taken
            raise
        finally:
            self._progress.close()
        return [self._output(self.status_map[i]) for i in range(len(jobs))]

    def chat(
        self,
        conversations: list[list[dict[str, Any]]] | list[dict[str, Any]],
        sampling_params: Any = None,
        use_tqdm: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: list[int] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for each conversation ([{"role": ..., "content": ...}, ...]; one conversation alone
        too, as vLLM's chat takes it) with the model's chat template, its messages checked as the server
        checks a request's (a bad one is a ValueError naming it); `chat_template_kwargs`: variables the
        template reads (e.g. Qwen3's enable_thinking), as the server takes them; `priority` as for generate;
        `continue_final_message` (vLLM's) continues each conversation's last (assistant) message instead of
        starting a new one, and `add_generation_prompt=False` ends the prompt after the last message; `tools`
        (vLLM's: OpenAI's function tools, checked as the server checks them) go to a template that renders them,
        or are described in a system message where it renders none; the calls stay in the output's text."""
        conversations, options = conversation_list(
            conversations, add_generation_prompt, continue_final_message
        )
        if self._tool_support is None:
            self._tool_support = detect_tool_support(self.tokenizer, self.engine.model_dir)
        # as the server: a template that renders no tools gets them, and earlier calls, as text
        plan = tool_plan(tools, self._tool_support)
        prompts = [
            self.apply_chat_template(plan.messages(c), chat_template_kwargs, **o, tools=plan.template_tools)
            for c, o in zip(conversations, options)
        ]
        # the rendered prompts are the tokenizer's ids: generate's checks of a caller's prompts have nothing to find
        outputs = self._generate(prompts, sampling_list(sampling_params, len(prompts)), use_tqdm, priority)
        # each output's `prompt` the rendered conversation, as vLLM's chat gives it: the ids decoded, special
        # tokens kept, once a conversation (its n choices follow it, index 1 .. n-1)
        text = None
        for out in outputs:
            if out.index == 0:
                text = self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
            out.prompt = text
        return outputs

    def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer (transformers'), as generate and chat use it."""
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: empty the prefix cache between generate calls, on every rank (a benchmark's cold start);
        True once emptied."""
        if self.tp_info.size > 1:
            # the other ranks wait for rank 0's next messages: they take this one and empty theirs
            self._broadcast_msgs([FlushCacheMsg(0)])
        reply = self.flush_cache()
        return reply.error is None

    def _priorities(self, priority: list[int] | None, n: int) -> list[int]:
        """generate's `priority` checked: one integer a prompt, and priority scheduling on to use them."""
        if priority is None:
            return [0] * n
        if not self.config.priority_scheduling:
            raise ValueError(
                "priority orders requests under priority scheduling, which is off; build the LLM with "
                "priority_scheduling=True, or leave priority out"
            )
        if len(priority) != n:
            raise ValueError(f"{n} prompts but {len(priority)} priorities; pass one each")
        for p in priority:
            if not (isinstance(p, int) and not isinstance(p, bool) and INT64_MIN <= p <= INT64_MAX):
                raise ValueError(f"priority {p!r} is invalid: each must be an integer in [-2**63, 2**63 - 1]")
        return list(priority)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        if chat_template_kwargs:
            self._check_template_kwargs(chat_template_kwargs)
        return chat_template_ids(
            self.tokenizer,
            messages,
            chat_template_kwargs,
            add_generation_prompt,
            continue_final_message,
            tools,
        )

    def _output(self, status: RequestStatus) -> RequestOutput:
        fields = {
            "text": status.detokenizer.text,
            "token_ids": list(status.output_ids),
            "finish_reason": status.finish_reason,
            "stop_reason": status.stop_reason,
            "error": status.error,
            "prompt_tokens": len(status.input_ids),
            "cached_tokens": status.cached_tokens,
            "prompt_logprobs": status.prompt_logprobs,
            "logprobs": status.logprobs,
        }
        return RequestOutput(fields, status.uid, status.prompt, list(status.input_ids), status.index)

    def _stop_ranks_after_error(self) -> None:
        # the other ranks may be inside a step that rank 0 left: they cannot be brought back in step
        if self._ranks is not None:
            self._ranks.kill()

    def stop_other_ranks(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
