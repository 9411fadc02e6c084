"""One policy update on packed RL micro-batches: rows of the longest sample against one row per micro-batch.

GSM-shaped samples (prompts of 80-140 tokens, responses of 90-256, a quarter of them at the 256
limit), split into micro-batches as ``raylign rl`` splits them (``train.micro_batch_tokens``), then
one forward and backward of the response log-probs (output layer at response tokens only, entropy
without a graph, as the policy's training pass), three ways, alternating, ``--repeats`` times:

* ``sdpa, rows``: transformers' sdpa, samples first-fit into rows as long as the longest sample,
  kept apart by a dense block-causal mask (raylign before ``raylign_sdpa``);
* ``raylign_sdpa, rows``: the same rows, each sample's attention computed on its own;
* ``raylign_sdpa, one row``: each micro-batch one row without padding (the default now).

It prints, per layout, the tokens that go through the model (padding included) and the median
seconds, beside the floor: 3 x 2 x (trunk weights x real tokens + output layer x response tokens)
FLOP at the matmul rate measured in the same run on the threads used. About 2-4 minutes on
SmolLM2-135M in bf16 on 2 cores with native bf16.

    python benchmarks/packed_rows.py                       # SmolLM2-135M-Instruct, dtype auto, all cores
    python benchmarks/packed_rows.py --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from child_runs import ALL_CORE_SIZES, DTYPE_HELP, MATMUL_SIZES

from raylign.config.model import ModelConfig
from raylign.hardware import cpu_flags, cpu_model, matmul_gflops, resolve_dtype
from raylign.models import load_causal_lm, selected_token_logprobs
from raylign.models.packed_attention import ONE_ROW, PER_SAMPLE_SDPA
from raylign.rl.experience import Sample, micro_batches_for_ranks, pack_samples

LAYOUTS = (("sdpa", 0), (PER_SAMPLE_SDPA, 0), (PER_SAMPLE_SDPA, ONE_ROW))


def gsm_shaped_samples(count: int, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt, response = rng.randrange(80, 141), rng.choice([256, 256, 90, 100, 120, 140, 160, 180])
        ids = [rng.randrange(3, vocab) for _ in range(prompt + response)]
        samples.append(Sample(ids[:prompt], ids[prompt:], [0.0] * response, "", "", None, "bench", "stop"))
    return samples


def update_seconds(model: torch.nn.Module, batches: list) -> float:
    start = time.perf_counter()
    for batch in batches:
        logprobs, _ = selected_token_logprobs(
            model,
            batch.input_ids,
            batch.resp_index,
            position_ids=batch.position_ids,
            with_entropy=True,
            mask=batch.mask,
            entropy_grad=False,
        )
        ((logprobs * batch.mask).sum() / batch.mask.sum()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model folder or smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help=DTYPE_HELP)
    parser.add_argument("--samples", type=int, default=16, help="samples in the step (4 prompts x 4)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.dtype, reason = resolve_dtype(args.dtype, "cpu")
    print(f"dtype {args.dtype} ({reason})")

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    # Measured on the threads the update runs on (several cores share caches and memory bandwidth, so
    # their rate is not the one-thread rate times the cores); threads pay off on larger products.
    sizes = MATMUL_SIZES if args.threads == 1 else ALL_CORE_SIZES
    rate = max(matmul_gflops(dtype, size=n, repeats=5, threads=args.threads) for n in sizes) * 1e9
    model = load_causal_lm(ModelConfig(path=args.model, dtype=args.dtype))
    model.train()
    samples = gsm_shaped_samples(args.samples, model.config.vocab_size, args.seed)
    plan = micro_batches_for_ranks(samples, 1, args.micro_batch_tokens)[0]
    head = model.get_output_embeddings().weight.numel()
    trunk = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    trunk -= 0 if model.config.tie_word_embeddings else head
    layouts = {}
    for kernel, rows in LAYOUTS:
        batches = [pack_samples([samples[i] for i in micro], row_tokens=rows) for micro in plan]
        tokens = sum(b.input_ids.numel() for b in batches)
        responses = sum(int(b.mask.sum()) for b in batches)
        layouts[(kernel, rows)] = (batches, tokens, responses, [])
    real = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for _ in range(args.repeats):
        for (kernel, _rows), (batches, _, _, seconds) in layouts.items():
            model.set_attn_implementation(kernel)
            seconds.append(update_seconds(model, batches))

    print(
        f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}, "
        f"{' '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16') if f in cpu_flags())}), "
        f"{torch.get_num_threads()} threads, matmul {rate / 1e9:.0f} GFLOP/s at {args.dtype} on them; "
        f"{len(samples)} samples, {real} real tokens, {len(plan)} micro-batches; "
        f"median of {args.repeats}, the first run included"
    )
    print(f"{'layout':24s} {'tokens':>8s} {'seconds':>8s} {'floor s':>8s} {'floor/measured':>15s}")
    for (kernel, rows), (_, tokens, responses, seconds) in layouts.items():
        flop = 3 * 2 * (trunk * real + head * responses)  # the real tokens only: padding is waste
        median = statistics.median(seconds)
        label = f"{kernel}, {'one row' if rows == ONE_ROW else 'rows'}"
        print(f"{label:24s} {tokens:8d} {median:8.2f} {flop / rate:8.2f} {flop / rate / median:15.2f}")


if __name__ == "__main__":
    main()
