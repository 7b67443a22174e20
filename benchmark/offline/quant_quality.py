"""Quality of each weight format against the float run: greedy agreement and perplexity.

    python benchmark/offline/quant_quality.py [--model FILE.gguf] [--out-dir DIR] [--json out.json]

The float run is the GGUF file dequantized to float32 (the default model ships only as Q4_1, so its
float weights are the Q4_1 values). The other GGUF types are made from those floats: Q8_0, Q4_0 with
`gguf.quants`, Q4_K with minisgl's packer (`minisgl/models/gguf_quant.py`); every tensor that is Q4_1 in
the file is requantized, the rest (the Q8_0 embedding, the norms) copied. Q4_K needs rows of whole
256-element blocks: where a row is not (SmolLM2's hidden size is 576), Q5_0 is written, as llama.cpp
does; minisgl loads Q5_0 as per-channel int8.

For each format, minisgl greedy-decodes 32 tokens of each prompt (bf16 activations, as the engine runs
on a CPU with bf16 units); agreement is counted against the float run at float32 and at bf16 (the
activations of the packed runs): the share of the 32 positions that match, and the mean length of the
common prefix. Perplexity is over a fixed English text
(benchmark/data/plain_english.txt): transformers' float32 model with each format's effective weights
(what the packed kernels multiply by, read back from them), so it isolates the weights' error; where
the engine rounds a layer's input to int8 (w8a8: per token, `minisgl.layers.quant.quantize_rows`; packed
weights on a CPU with VNNI: blocks of 32, `minisgl.kernel.cpu.qlinear`) the hook rounds it the same
way, so the figure includes the activations' error (w8a8's smoothing too). The w8a8 rows run twice: the
LM head W8A8 like the other layers (the engine's choice) and int8 weight-only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "plain_english.txt")
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Describe a cat to someone who has never seen one.",
    "What are the planets of the solar system?",
    "Summarise the plot of Romeo and Juliet.",
    "How do I boil an egg?",
    "Tell me a fun fact about octopuses.",
    "Why do leaves change colour in autumn?",
    "Write a haiku about winter.",
    "What is the difference between weather and climate?",
]


def requantize_gguf(src: str, dst: str, qtype_name: str) -> str:
    """A copy of `src` with every Q4_1 tensor requantized (from its float values) to `qtype_name`."""
    import gguf
    from gguf.quants import dequantize, quantize

    from minisgl.models.gguf_quant import quantize_q4_k

    if os.path.isfile(dst):
        return dst
    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(src)
    arch = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    writer = gguf.GGUFWriter(dst + ".tmp", arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            kind = qtype
            if qtype == gguf.GGMLQuantizationType.Q4_K and shape[1] % 256:
                # llama.cpp's own fallback for a row that is not whole 256-element blocks
                kind = gguf.GGMLQuantizationType.Q5_0
            blocks = quantize_q4_k(w) if kind == gguf.GGMLQuantizationType.Q4_K else quantize(w, kind)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".tmp", dst)
    return dst


def effective_weights(
    model: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor | None]]]:
    """Hugging Face names -> float32 weights of every linear layer, as minisgl multiplies by them; and
    for the layers (names without ".weight") whose activations minisgl rounds to int8, how: "row" (one
    scale a token, w8a8, with the layer's smoothing: 1 / s a channel, or None) or "block" (one a block
    of 32, the C kernel of packed weights)."""
    from minisgl.layers.linear import LinearColParallelMerged, QuantizableLinear
    from minisgl.layers.quant import W8A8Weight

    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out: dict[str, torch.Tensor] = {}
    quantized_inputs: dict[str, tuple[str, torch.Tensor | None]] = {}
    for name, m in model.named_modules():
        if not isinstance(m, QuantizableLinear):
            continue
        # the copy a prompt is multiplied by: a W8A8 copy for batches where there is one (auto)
        q = m.batch_qweight if m.batch_qweight is not None else m.qweight
        w = q.dequantize() if q is not None else m.weight.float()
        pieces = {f"{name}.weight": w}
        if isinstance(m, LinearColParallelMerged):
            parent, _, leaf = name.rpartition(".")
            pieces = {f"{parent}.{sub}.weight": p for sub, p in zip(parts[leaf], w.split(m.local_sizes))}
        out |= pieces
        if isinstance(q, W8A8Weight):
            inv = q.inv_smooth
            quantized_inputs |= {k.removesuffix(".weight"): ("row", inv) for k in pieces}
        elif getattr(q, "pack", None) is not None:
            quantized_inputs |= {k.removesuffix(".weight"): ("block", None) for k in pieces}
    return out, quantized_inputs


def perplexity(
    folder: str,
    weights: dict[str, torch.Tensor],
    quantized_inputs: dict[str, tuple[str, torch.Tensor | None]],
    ids: list[int],
) -> float:
    from transformers import AutoModelForCausalLM

    from minisgl.kernel.cpu.qlinear import BLOCK, q8_blocks_reference
    from minisgl.layers.quant import quantize_rows

    def round_rows(inv: torch.Tensor | None):  # noqa: ANN202 - a forward pre-hook
        def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            # the engine multiplies the codes of x / s by w * s; the same as these values times w
            x = args[0]
            q, scale = quantize_rows(x.reshape(-1, x.shape[-1]), inv)
            xq = q.float() * scale
            return ((xq if inv is None else xq / inv).reshape(x.shape), *args[1:])

        return hook

    def round_blocks(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        codes, d = q8_blocks_reference(x.reshape(-1, x.shape[-1]))
        xq = codes.reshape(*d.shape, BLOCK) * d[..., None]
        return (xq.reshape(x.shape).to(x.dtype), *args[1:])

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if name in quantized_inputs:
            kind, inv = quantized_inputs[name]
            module.register_forward_pre_hook(round_rows(inv) if kind == "row" else round_blocks)
    if model.config.tie_word_embeddings:
        # the tied head's packed copy is what scores tokens; the embedding lookup reads the float table
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    missing = set(weights) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(weights, strict=False)
    x = torch.tensor([ids])
    with torch.inference_mode():
        loss = model(x, labels=x).loss.item()
    return math.exp(loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Q4_1 GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--out-dir", default=os.path.expanduser("~/.cache/minisgl/quant-quality"))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated quantization values to run beside the two float references, of "
        "none, int8, w8a8, w8a8+int8head, gguf (the GGUF rows), auto (default: all)",
    )
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from minisgl import LLM, SamplingParams
    from minisgl.models import quantize
    from minisgl.models.gguf import default_model_path
    from minisgl.utils.hf import chat_template_ids, load_tokenizer

    src = args.model or default_model_path()
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.basename(src).split(".")[0]
    made = {
        q: requantize_gguf(src, os.path.join(args.out_dir, f"{stem}.{q}.gguf"), q)
        for q in ("Q8_0", "Q4_0", "Q4_K")
    }
    src_type = "Q4_1"
    runs = [
        ("float32 (reference)", src, "float32", "none"),
        ("bf16 weights", src, "bfloat16", "none"),
        ("int8 per channel", src, "bfloat16", "int8"),
        ("w8a8 (W8A8 LM head)", src, "bfloat16", "w8a8"),
        ("w8a8, int8 LM head", src, "bfloat16", "w8a8+int8head"),
        (f"{src_type} packed", src, "bfloat16", "gguf"),
        # the default: the file's packing for up to 4 rows, W8A8 for prompts and larger batches where the
        # CPU measures it faster (the float weights elsewhere: then this row's perplexity is not theirs)
        (f"auto ({src_type} + W8A8 for batches)", src, "bfloat16", "auto"),
        *[(f"{q} packed", path, "bfloat16", "gguf") for q, path in made.items()],
    ]
    if args.only is not None:
        keep = set(args.only.split(","))
        runs = runs[:2] + [r for r in runs[2:] if r[3] in keep]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    results = []
    refs: list[list[list[int]]] = []
    for label, path, dtype, quant in runs:
        start = time.perf_counter()
        # the engine's w8a8 makes the LM head W8A8 too; "+int8head" measures it int8 weight-only
        quantize.W8A8_HEAD = not quant.endswith("+int8head")
        llm = LLM(
            path, dtype=dtype, quantization=quant.removesuffix("+int8head"), max_running_req=len(PROMPTS)
        )
        prompts = [chat_template_ids(llm.tokenizer, [{"role": "user", "content": t}]) for t in PROMPTS]
        outs = [o["token_ids"] for o in llm.generate(prompts, params)]
        weights, quantized_inputs = effective_weights(llm.engine.model)
        folder = llm.engine.model_dir
        llm.shutdown()
        if len(refs) < 2:
            # the float run at float32, and at bf16 (the same weights, the activations of the packed runs)
            refs.append(outs)
        ids = list(load_tokenizer(folder).encode(open(TEXT).read()))
        row = {
            "format": label,
            "file": os.path.basename(path),
            "perplexity": perplexity(folder, weights, quantized_inputs, ids),
        }
        row["text_tokens"] = len(ids)
        for key, ref in zip(("float32", "bf16"), refs):
            same = [sum(a == b for a, b in zip(o, r)) / args.tokens for o, r in zip(outs, ref)]
            first_miss = [
                next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), args.tokens)
                for o, r in zip(outs, ref)
            ]
            row[f"agreement_{key}"] = float(np.mean(same))
            row[f"prefix_{key}"] = float(np.mean(first_miss))
        row.setdefault("agreement_bf16", 1.0)
        row.setdefault("prefix_bf16", float(args.tokens))
        results.append(row)
        print(
            f"{label:<22} agree {row['agreement_float32']:.3f} / {row['agreement_bf16']:.3f}  "
            f"ppl {row['perplexity']:.3f}  ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    print()
    print(
        f"| format | agreement with float32 ({args.tokens} tokens x {len(PROMPTS)} prompts) | mean common prefix | "
        f"agreement with bf16 float | mean common prefix | perplexity ({results[0]['text_tokens']} tokens) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['format']} | {100 * r['agreement_float32']:.1f}% | {r['prefix_float32']:.1f} | "
            f"{100 * r['agreement_bf16']:.1f}% | {r['prefix_bf16']:.1f} | {r['perplexity']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
