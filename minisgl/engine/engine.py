"""Engine: the model, the paged KV pool, the page table, the attention backend and the sampler of one rank."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from minisgl.attention import create_attn_backend
from minisgl.core import Batch, Context, set_global_ctx
from minisgl.distributed import set_tp_info
from minisgl.engine.config import EngineConfig
from minisgl.engine.cpu_compile import CompiledDecode
from minisgl.engine.fused_head import FusedHead, fused_head_possible
from minisgl.engine.graph import GraphRunner, graphs_possible
from minisgl.engine.graph_edges import short_products
from minisgl.engine.prefill_graph import PrefillGraphRunner
from minisgl.engine.prepare import (
    ForwardInput,
    make_decode_inputs,
    make_input_tuple,
    make_last_indices,
    make_positions,
    make_write_tuple,
)
from minisgl.engine.sample import (
    LogprobsOutput,
    PromptLogprobArgs,
    PromptLogprobsOutput,
    Sampler,
    prompt_logprobs,
)
from minisgl.engine.warmup import warm_up
from minisgl.env import ENV
from minisgl.kvcache.kv_scales import KVScales
from minisgl.kvcache.mha_pool import FP8_DTYPE, MHAKVCache
from minisgl.models import ModelConfig, create_model
from minisgl.models.weight import iter_safetensors, load_weights
from minisgl.utils.hf import find_model, load_hf_config, resolve_model_path
from minisgl.utils.logger import init_logger, set_log_rank
from minisgl.utils.misc import align_up, div_ceil
from minisgl.utils.torch_utils import CopyDone, create_stream, default_device, resolve_dtype

logger = init_logger(__name__)


@dataclass(frozen=True)
class QuantPlan:
    """How a CPU engine packs its weights (minisgl/models/quantize.py): the `quantization` value; with
    `keep_float` the float weights stay for prompts and large batches, or `batch_w8a8` W8A8 copies do."""

    quantization: str
    keep_float: bool = False
    batch_w8a8: bool = False


@dataclass
class ForwardOutput:
    next_tokens_gpu: torch.Tensor
    next_tokens_cpu: torch.Tensor
    copy_done: CopyDone
    # on the CPU; only when a request of the batch asks
    logprobs: LogprobsOutput | None = None
    prompt_logprobs: PromptLogprobsOutput | None = None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(config.device) if config.device else default_device()
        config.dtype = resolve_dtype(config.dtype, self.device)
        if config.enable_mixed_chunk is None:
            config.enable_mixed_chunk = self.device.type == "cpu"
        self.tp_info = config.tp_info
        set_tp_info(config.tp_info)
        set_log_rank(config.tp_info.rank)
        self.tp_cpu_group = self._init_distributed()
        self.stream = create_stream(self.device)
        if self.device.type == "cpu" and ENV.CPU_THREADS.value > 0:
            torch.set_num_threads(ENV.CPU_THREADS.value)

        self.model_dir = resolve_model_path(config.model_path)
        self.hf_config = load_hf_config(self.model_dir)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        self.max_seq_len = self._max_seq_len()
        self.model_config.max_position_embeddings = self.max_seq_len  # the rotary table needs no more
        self.kv_scales = KVScales(self.model_config.num_layers)
        quantization = self._quantization()
        self.model = self._build_model()
        if self.device.type == "cuda":
            # from here the host's work per step is tensors of a few hundred elements, where intra-op
            # threads only add wake-ups; and every rank's (and the server's tokenizer's) OpenMP pool
            # spinning on the same cores stalled a tp=2 step by 8-10 ms of host time (prepare_batch)
            torch.set_num_threads(ENV.CPU_THREADS.value or 1)

        mc = self.model_config
        self.page_size = config.page_size
        # auto: the model's dtype, as transformers keeps it; fp8 halves a bf16 pool's bytes again
        self.kv_dtype = config.kv_cache_dtype or config.dtype
        fp8 = self.kv_dtype == FP8_DTYPE
        if self.kv_scales.found and not fp8:
            logger.info_rank0(f"the checkpoint's KV scales are not used: the KV cache is {self.kv_dtype}")
        self.num_pages = self._num_pages()
        # the first slot past the pages handed out: CUDA-graph padding rows write their K/V there
        self.scratch_slot = self.num_pages * config.page_size
        graph_bs = config.cuda_graph_max_bs
        if graph_bs is None:
            graph_bs = min(256, config.max_running_req)
        use_graphs = graphs_possible(self.device) and graph_bs > 0
        self.kv_cache = MHAKVCache(
            mc.num_layers,
            # with graphs, one more page than the cache manager hands out: the padding rows write there
            self.num_pages + int(use_graphs),
            self.page_size,
            mc.local_kv_heads(self.tp_info.size),
            mc.head_dim,
            self.kv_dtype,
            self.device,
            k_scales=self.kv_scales.k if fp8 else None,
            v_scales=self.kv_scales.v if fp8 else None,
        )
        # one row per running request, plus a last row for the dummy requests that pad CUDA-graph batches
        # rows hold whole pages, so the width is rounded up to a page
        self.page_table = torch.zeros(
            (config.max_running_req + 1, align_up(self.max_seq_len, self.page_size)),
            dtype=torch.int32,
            device=self.device,
        )
        if use_graphs:
            self.page_table[config.max_running_req].fill_(self.scratch_slot)
        # token_pool[row, pos] is the token at position pos of the request in that row, kept on the device
        self.token_pool = torch.zeros_like(self.page_table)
        local_qo_heads = mc.num_qo_heads // self.tp_info.size
        self.attn_backend = create_attn_backend(
            config.attention_backend,
            self.kv_cache,
            self.page_table,
            self.device,
            local_qo_heads // self.kv_cache.num_kv_heads,
        )
        self.ctx = Context(self.page_size, self.kv_cache, self.page_table, self.attn_backend)
        set_global_ctx(self.ctx)
        self.sampler = Sampler(self.device, mc.vocab_size)
        short = short_products(self.model)  # whether the graphs' edges may be programmatic
        self.graph_runner = GraphRunner(
            self.device,
            min(graph_bs, config.max_running_req),
            config.cuda_graph_bs,
            self.attn_backend,
            self.model.forward,
            config.max_running_req,
            self.max_seq_len,
            mc.vocab_size,
            self.token_pool,
            slots_in_inputs=self.page_size == 1,  # the scheduler's cache manager gives them (prepare_batch)
            short_products=short,
        )
        self.prefill_graphs = PrefillGraphRunner(
            self.device,
            config.cuda_graph_max_prefill if use_graphs else 0,
            self.attn_backend,
            self.model.forward,
            config.max_running_req,
            scratch_row=use_graphs,
            short_products=short,
        )
        self.compiled_decode = CompiledDecode(
            self.model.forward, self.device, self.attn_backend, self.tp_info.size
        )
        # none while the quantization's calibration steps run (they run the engine's own steps)
        self.fused_head: FusedHead | None = None
        self._quantize(quantization)
        if self.graph_runner.enabled and fused_head_possible(self.model, self.device, self.tp_info.size):
            # the decode graphs stop at the final norm; the LM head runs after each replay, fused with the
            # sampling where the batch allows (engine/fused_head.py)
            self.fused_head = FusedHead(self.model, mc.vocab_size, self.graph_runner.max_bs, self.device)
            self.graph_runner.forward = self.model.hidden_states
        start = time.perf_counter()
        warm_up(self)
        logger.info_rank0(f"warm-up ran the first steps in {time.perf_counter() - start:.1f} s")
        # captured last: the model, the pool and the backend exist, and the warm-up compiles the kernels
        self.graph_runner.capture(self.stream)
        self.prefill_graphs.capture(self.stream, self.graph_runner.pool)
        logger.info_rank0(
            f"engine ready: {mc.architecture} on {self.device}, {config.dtype}, "
            f"{self.num_pages} KV pages of {self.page_size} ({self.kv_dtype}), max_seq_len {self.max_seq_len}"
        )

    def _init_distributed(self) -> object | None:
        info = self.config.tp_info
        if info.size == 1:
            return None
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            # ranks are spread evenly over the nodes; each takes the GPU of its place on its node
            local = info.rank % (info.size // self.config.nnodes)
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        # a rank that never shows up fails the rendezvous (and a forward collective) in minutes ...
        dist.init_process_group(
            backend,
            init_method=self.config.distributed_addr,
            rank=info.rank,
            world_size=info.size,
            timeout=timedelta(minutes=5),
        )
        # ... but the other ranks wait on this group for as long as rank 0 waits for requests
        return dist.new_group(backend="gloo", timeout=timedelta(days=365))

    def _max_seq_len(self) -> int:
        mc = self.model_config
        limit = self.config.max_seq_len_override or mc.max_position_embeddings
        if mc.sliding_window:
            # beyond the window the model attends differently; serving no more keeps every answer exact
            limit = min(limit, mc.sliding_window)
        return limit

    def _build_model(self) -> torch.nn.Module:
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.config.dtype)
        try:
            with torch.device(self.device):
                model = create_model(self.model_config)
        finally:
            torch.set_default_dtype(old)
        # an FP8 KV cache's scales travel with the weights: they are kept aside for the pool
        load_weights(model, self.kv_scales.take(iter_safetensors(self.model_dir)))
        fold = getattr(model, "fold_norms", None)
        if ENV.FOLD_NORMS.value and fold is not None and fold():
            logger.info("RMSNorm weights folded into the q|k|v and gate|up projections")
        return model.eval()

    def _quantization(self) -> QuantPlan | None:
        """What `_quantize` will do, or None for the float weights. Checked before anything is loaded, so
        that a refused value fails at once."""
        quantization = self.config.quantization
        if quantization == "none":
            return None
        if self.device.type != "cpu":
            if quantization is not None:
                raise ValueError(
                    f"quantization={quantization!r} runs on the CPU only; this engine runs on {self.device}"
                )
            return None
        if quantization is None:
            from minisgl.utils.cpu_probe import cpu_choice

            # the packed kernels take bf16 activations: a float32 model keeps its float32 results; the
            # timing runs only where its answer is needed
            if (
                not find_model(self.config.model_path).endswith(".gguf")
                or self.config.dtype != torch.bfloat16
                or self.tp_info.size > 1
            ):
                return None
            choice = cpu_choice()
            if not choice.packed_weights:
                return None
            # packed for the few-row decode steps where they are faster; prompts and larger batches take
            # W8A8 where it beats oneDNN's bf16 matmul here, the float weights elsewhere
            return QuantPlan(
                "gguf", keep_float=True, batch_w8a8=choice.w8a8_batches and ENV.CPU_W8A8_BATCHES.value
            )
        if quantization == "gguf" and self.tp_info.size > 1:
            raise ValueError(
                "quantization='gguf' runs with tp_size 1 only; use 'int8' or 'none' with tensor parallelism"
            )
        return QuantPlan(quantization)

    def _quantize(self, plan: QuantPlan | None) -> None:
        """Pack the weights as `plan` says, then (CPU) the float ones left in oneDNN's layout. Runs once the
        pool and the backend exist: W8A8 first runs the float model over its calibration text."""
        model = self.model
        if plan is not None:
            from minisgl.models import quant_cache
            from minisgl.models.quantize import apply_recipes, quant_recipes

            source = find_model(self.config.model_path)
            tp = (self.tp_info.rank, self.tp_info.size)
            key = f"{plan.quantization} batch_w8a8={plan.batch_w8a8}"
            path = quant_cache.cache_path(source, key, self.config.dtype, self.max_seq_len, tp)
            recipes = None if path is None else quant_cache.load(path)
            cached = recipes is not None
            if recipes is None:
                peaks = None
                if plan.quantization == "w8a8" or plan.batch_w8a8:
                    from minisgl.engine.calibrate import input_peaks
                    from minisgl.models.smoothing import calibration_ids

                    start = time.perf_counter()
                    ids = calibration_ids(self.model_dir, self.model_config.vocab_size, self.max_seq_len - 2)
                    peaks = input_peaks(self, ids)
                    logger.info_rank0(
                        f"W8A8 smoothing calibrated on {len(ids)} tokens in {time.perf_counter() - start:.2f} s"
                    )
                recipes = quant_recipes(model, plan.quantization, source, peaks, plan.batch_w8a8)
                if path is not None:
                    quant_cache.save(path, recipes)
            summary = apply_recipes(model, recipes, plan.keep_float)
            kept = ", W8A8 for prompts and large batches" if plan.batch_w8a8 else ""
            if plan.keep_float and not plan.batch_w8a8:
                kept = ", float kept for large batches"
            where = f", built from {path}" if cached else ""
            logger.info_rank0(f"weights quantized ({plan.quantization}{kept}{where}): {summary}")
        if self.device.type == "cpu":
            from minisgl.models.onednn_pack import pack_model

            summary = pack_model(model)
            if summary:
                logger.info_rank0(summary)

    def _num_pages(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.num_page_override is not None:
            return cfg.num_page_override
        per_page = MHAKVCache.bytes_per_page(
            mc.num_layers, cfg.page_size, mc.local_kv_heads(self.tp_info.size), mc.head_dim, self.kv_dtype
        )
        wanted = div_ceil(cfg.max_running_req * self.max_seq_len, cfg.page_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_budget(free, total, cfg.memory_ratio, cfg.gpu_memory_utilization)
        else:
            budget = int(cfg.cpu_kv_budget_gib * (1 << 30))
        pages = min(wanted, max(budget, 0) // per_page)
        if self.tp_info.size > 1:
            import torch.distributed as dist

            # every rank holds the same pages, so the rank with the least memory decides
            least = torch.tensor([pages])
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.tp_cpu_group)
            pages = int(least.item())
        if pages < div_ceil(self.max_seq_len, cfg.page_size) // 8 and pages < wanted:
            logger.warning_rank0(f"only {pages} KV pages fit in memory; long prompts will be refused")
        if pages < 1:
            raise RuntimeError(
                "no memory is left for the KV cache; lower max_running_req, raise gpu_memory_utilization, or pass "
                "num_page_override"
            )
        return pages

    def prepare_batch(
        self, batch: Batch, eos_token_ids: Sequence[int] = (), slots: list[int] | None = None
    ) -> ForwardInput:
        """Everything the forward pass of `batch` reads, built on the host and queued to the device.

        The batch's KV pages must be allocated (the scheduler's cache manager) before this call; a decode
        step's with a slot a page may instead come as `slots` (`CacheManager.allocate_decode_slots`), the slot
        of each request's position, which this writes to the page table. `eos_token_ids` are the tokens a
        request below its min_tokens may not sample. The grammar masks of constrained rows come apart
        (`set_token_mask`): they need the tokens sampled just before.
        """
        self.graph_runner.pad_batch(batch)
        self.prefill_graphs.pad_batch(batch)
        if batch.is_decode:
            # a padding row's slot is the scratch slot, as everywhere in its row of the page table
            # a graph with a slot a page reads the slots from the step's inputs
            assert slots is not None or self.page_size > 1 or not self.graph_runner.can_use(batch), (
                "a decode step replaying a graph with a slot a page takes its slots with it"
            )
            inputs = make_decode_inputs(batch, self.device, slots, self.scratch_slot)
            batch.positions, input_mapping, write_mapping = inputs[:3]
            batch.packed_inputs = inputs.packed
            if inputs.out_loc is not None:
                rows, positions, new_slots = input_mapping[0], batch.positions, inputs.out_loc
                n = batch.size
                if batch.padded_size > n:  # the padding rows' slots are the scratch slot: nothing to write
                    rows, positions, new_slots = rows[:n], positions[:n], new_slots[:n]
                self.page_table[rows, positions] = new_slots.to(torch.int32)
                batch.out_loc = inputs.out_loc
            elif not self.graph_runner.can_use(batch):  # a graph gathers them itself
                batch.out_loc = self.page_table[input_mapping].to(torch.int64)
        else:
            batch.positions = make_positions(batch, self.device)
            input_mapping = make_input_tuple(batch, self.device, self.prefill_graphs.dummy_table_idx)
            write_mapping = make_write_tuple(batch, self.device)
            batch.out_loc = self.page_table[input_mapping].to(torch.int64)
        prompt_args = None
        if batch.is_prefill:
            batch.last_indices = make_last_indices(batch, self.device)
            prompt_args = self._prompt_logprob_args(batch)
        self.attn_backend.prepare_metadata(batch)
        # a decode step's write columns are the sampled tokens' positions (device_len): the noise counters
        steps = write_mapping[1] if batch.is_decode else None
        sample_args = self.sampler.prepare(batch, self.token_pool, eos_token_ids, steps)
        sample_args.prompt = prompt_args
        return ForwardInput(batch, sample_args, input_mapping, write_mapping)

    def set_token_mask(self, forward_input: ForwardInput, token_mask: torch.Tensor | None) -> None:
        """Queue the batch's grammar bitmask ([B, ceil(V/32)] int32 bits of the tokens each row may sample,
        constrained/grammar.py) to the device on the current stream, for its sampling.

        Beside CUDA the mask should be in pinned memory, so the copy is asynchronous; the caching host
        allocator keeps that memory until the copy has landed, so the caller may drop the host tensor.
        """
        if token_mask is not None:
            on_cuda = self.device.type == "cuda"
            forward_input.sample_args.token_mask = token_mask.to(self.device, non_blocking=on_cuda)

    def _prompt_logprob_args(self, batch: Batch) -> PromptLogprobArgs | None:
        """The positions of this prefill whose next token is a prompt token, for the requests that ask
        for prompt logprobs (their whole prompt is computed: the scheduler skips the prefix cache for them)."""
        asking = [
            r.sampling_params.prompt_logprobs
            for r in batch.reqs
            if r.sampling_params.prompt_logprobs is not None
        ]
        if not asking:
            return None
        indices: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        counts: list[int] = []
        offset = 0
        for r in batch.reqs:
            n = 0
            if r.sampling_params.prompt_logprobs is not None:
                # position p predicts token p + 1; the prompt's last position predicts the first output token
                n = max(0, min(r.device_len, r.prompt_len - 1) - r.cached_len)
                indices += range(offset, offset + n)
                rows += [r.table_idx] * n
                cols += range(r.cached_len + 1, r.cached_len + 1 + n)
            counts.append(n)
            offset += r.extend_len
        if not indices:
            return None
        batch.prompt_logit_indices = torch.tensor(indices, dtype=torch.int64).to(self.device)
        rows_t = torch.tensor(rows, dtype=torch.int64).to(self.device)
        cols_t = torch.tensor(cols, dtype=torch.int64).to(self.device)
        targets = self.token_pool[rows_t, cols_t].to(torch.int64)
        return PromptLogprobArgs(targets, counts, max(asking))

    @torch.inference_mode()
    def forward_batch(self, forward_input: ForwardInput) -> ForwardOutput:
        """Run one step: inputs gathered from the token pool, samples written back to it, on the device."""
        batch = forward_input.batch
        args = forward_input.sample_args
        if (
            self.fused_head is not None
            and self.graph_runner.can_use(batch)
            and self.fused_head.takes(batch.size, args)
        ):
            hidden = self._replay(batch)[: batch.size]
            return self._finish(forward_input, self.fused_head.sample(hidden, args), None)
        return self.sample_batch(forward_input, self.forward_model(forward_input))

    def _replay(self, batch: Batch) -> torch.Tensor:
        """A decode graph's replay: its output buffer (logits, or the final hidden rows where the LM head runs
        after it), which the next replay overwrites after this step's sampling in stream order. The context and
        rank set are this engine's (globals the layers read), as in forward_model."""
        set_global_ctx(self.ctx)
        set_tp_info(self.tp_info)
        with self.ctx.forward_batch(batch):
            return self.graph_runner.replay(batch)

    @torch.inference_mode()
    def forward_model(self, forward_input: ForwardInput) -> torch.Tensor:
        """The model's half of a step: the logits of the batch (the last token of each request first, then
        any prompt positions that asked for logprobs). `sample_batch` is the other half.

        A step is split in two only when its masks are not known yet at launch (constrained rows under
        overlap): the model needs no mask, so it runs while the host fills them.
        """
        batch = forward_input.batch
        if self.graph_runner.can_use(batch):  # the graph gathers its token ids itself
            out = self._replay(batch)
            return out if self.fused_head is None else self.fused_head.logits(out)
        # the layers find the context and the rank set through globals: this engine's, even if another
        # engine was built in the process after it
        set_global_ctx(self.ctx)
        set_tp_info(self.tp_info)
        batch.input_ids = self.token_pool[forward_input.input_mapping]
        with self.ctx.forward_batch(batch):
            if self.prefill_graphs.can_use(batch):
                return self.prefill_graphs.replay(batch)
            if self.compiled_decode.can_use(batch):
                return self.compiled_decode.run()
            return self.model.forward()

    @torch.inference_mode()
    def sample_batch(self, forward_input: ForwardInput, logits: torch.Tensor) -> ForwardOutput:
        """The sampling half of a step: the next tokens from `logits` (forward_model's), written back to the
        token pool on the device and copied to the host, with the logprobs the requests ask for."""
        batch, args = forward_input.batch, forward_input.sample_args
        if args.penalty is not None:
            args.penalty.gather(self.token_pool)
        return self._finish(forward_input, self.sampler.sample(logits[: batch.size], args), logits)

    def _finish(
        self, forward_input: ForwardInput, next_tokens: torch.Tensor, logits: torch.Tensor | None
    ) -> ForwardOutput:
        """A step's tokens written back to the token pool and copied to the host, with the logprobs the requests
        ask for from `logits` (None where no request asks: fused_head.plain_rows)."""
        batch, args = forward_input.batch, forward_input.sample_args
        if self.tp_info.size > 1:
            import torch.distributed as dist

            # every rank must continue with the same tokens; rank 0's are the answer
            dist.broadcast(next_tokens, src=0)
        # the sample is the next step's input: the CPU never has to know it to launch that step
        self.token_pool[forward_input.write_mapping] = next_tokens
        non_blocking = self.device.type == "cuda"
        logprobs = None
        if args.top_logprobs is not None:
            assert logits is not None
            logprobs = self.sampler.logprobs(logits[: batch.size], next_tokens, args.top_logprobs)
            logprobs = logprobs.to("cpu", non_blocking=non_blocking)
        prompt_out = None
        if args.prompt is not None:
            assert logits is not None
            # the prompt positions' logits follow the last tokens' ones
            first = logits.shape[0] - args.prompt.targets.shape[0]
            prompt_out = prompt_logprobs(logits[first:], args.prompt).to("cpu", non_blocking=non_blocking)
        next_cpu = next_tokens.to("cpu", non_blocking=non_blocking)
        return ForwardOutput(next_tokens, next_cpu, CopyDone(self.device), logprobs, prompt_out)

    def shutdown(self) -> None:
        set_global_ctx(None)
        # the CUDA graphs go first: graphs that captured NCCL kernels keep the communicator busy, and
        # destroying the process group under them never returns (with one rank there is none, and a full
        # collection here cost a CPU engine's shutdown 0.08 s for nothing)
        if hasattr(self, "graph_runner"):
            self.graph_runner.destroy()
            if hasattr(self, "prefill_graphs"):
                self.prefill_graphs.destroy()
            if self.tp_info.size > 1:
                gc.collect()
        if hasattr(self, "compiled_decode"):
            self.compiled_decode.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.tp_info.size > 1:
            _destroy_process_group()
        if hasattr(self, "kv_cache"):
            self.kv_cache.close()
        for name in (
            "model",
            "kv_cache",
            "page_table",
            "token_pool",
            "attn_backend",
            "ctx",
            "graph_runner",
            "prefill_graphs",
            "compiled_decode",
        ):
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


ACTIVATIONS_RESERVE = 2 << 30  # GPU memory kept out of the KV pool for activations and graphs


def kv_budget(free: int, total: int, memory_ratio: float, utilization: float | None) -> int:
    """Bytes the KV pool may take on a GPU with `free` of `total` bytes free once the weights are loaded: with
    `utilization` (vLLM's gpu_memory_utilization), that share of the whole memory less what is in use already;
    else `memory_ratio` of what is free; either less the activations' reserve."""
    if utilization is not None:
        return int(total * utilization) - (total - free) - ACTIVATIONS_RESERVE
    return int(free * memory_ratio) - ACTIVATIONS_RESERVE


def _destroy_process_group(timeout_s: float = 30.0) -> None:
    """destroy_process_group, given up on after `timeout_s`: with a peer rank already gone, NCCL's
    finalisation can wait forever, and a shutdown must end."""
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group is being left anyway
            logger.warning("destroying the process group failed: %s", e)
        done.set()

    threading.Thread(target=destroy, name="destroy-process-group", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("the process group did not shut down within %.0f s; leaving it", timeout_s)
