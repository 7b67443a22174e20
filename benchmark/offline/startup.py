"""Start-up: how long the default model takes to be ready, the first time and every time after.

Three figures, in one run, against a fresh conversion cache:
- first conversion: the default GGUF file (SmolLM2-135M-Instruct, Q4_1) dequantised into a
  Hugging Face folder of float32 safetensors;
- cached load: the same call again, which finds the converted folder and returns it;
- LLM() construction: the whole offline engine on the default model, its conversion cached
  (config, tokenizer, weights, quantization, KV pool); the imports are done before the clock starts. The
  first one quantizes the weights and caches the quantized layers in the same fresh folder
  (models/quant_cache.py), the later ones build them from there (with MINISGL_QUANT_CACHE=0 each quantizes).
    python benchmark/offline/startup.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="runs of the cached load and of LLM()")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    args = p.parse_args()
    if args.repeat < 2:
        p.error("--repeat must be at least 2")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from minisgl import LLM
    from minisgl.env import ENV
    from minisgl.models.gguf import convert_gguf, default_model_path

    model = default_model_path()
    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        folder = convert_gguf(model, cache_dir=cache_dir)
        first = time.perf_counter() - start

        cached = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            assert convert_gguf(model, cache_dir=cache_dir) == folder
            cached.append(time.perf_counter() - start)

        # LLM() finds the default model's conversion in ENV.CACHE_DIR
        ENV.CACHE_DIR.value = cache_dir
        build = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            llm = LLM()
            build.append(time.perf_counter() - start)
            llm.shutdown()

    print(f"default model: {model}")
    print(f"first conversion:    {first:8.2f} s")
    print(f"cached load:         {statistics.median(cached) * 1e6:8.1f} us (median of {args.repeat})")
    after = statistics.median(build[1:])
    print(f"LLM() construction:  {build[0]:8.2f} s the first time, {after:.2f} s after (median)")


if __name__ == "__main__":
    main()
