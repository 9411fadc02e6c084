"""What a policy update computes on a long-tailed batch, before and after skipping wasted work.

One micro-batch of GRPO-shaped samples, most responses short and a few long, through one
forward and backward of the policy-gradient loss on a random Qwen2-shaped model (fp32, one
thread), two ways:

* before: the output layer at every entry of the ``[b, R]`` response index (padding included),
  the entropy differentiated although ``entropy_coef`` is 0;
* after: the output layer at the real response tokens only, the entropy measured without a graph
  (and, between the two, the first change alone).

It prints output-layer rows, bytes autograd keeps for the backward pass, and seconds (median of
``--repeats``), beside this machine's fp32 matmul GFLOP/s measured in the same run and the
output layer's share of the arithmetic. Then the token counts per data-parallel rank of a step
split into contiguous shards against token-balanced ones (no timing). About 1-3 minutes.

    python benchmarks/policy_update_cost.py
    python benchmarks/policy_update_cost.py --hidden 512 --vocab 50000 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from raylign.algorithms import LossScale
from raylign.config.rl import AlgorithmConfig
from raylign.models import selected_token_logprobs
from raylign.rl.experience import Sample, micro_batches_for_ranks, pack_samples, response_tensor
from raylign.rl.worker import bind_policy_loss


def sample(prompt_len: int, response_len: int, rng: random.Random, vocab: int) -> Sample:
    ids = [rng.randrange(3, vocab) for _ in range(prompt_len + response_len)]
    return Sample(ids[:prompt_len], ids[prompt_len:], [0.0] * response_len, "", "", None, "bench", "stop")


def fp32_gflops(size: int = 512, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def update(model, batch, algorithm: AlgorithmConfig, masked: bool, entropy_grad: bool) -> tuple[int, int, float]:
    """One forward + backward of the policy-gradient loss; (output-layer rows, bytes saved for backward, seconds)."""
    rows: list[int] = []
    storages: dict[int, int] = {}
    kept = []

    def pack(tensor):
        kept.append(tensor)
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, _a, out: rows.append(out.numel() // out.shape[-1]))
    scale = LossScale(float(batch.mask.sum()), float(batch.mask.shape[0]))
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = selected_token_logprobs(
            model,
            batch.input_ids,
            batch.resp_index,
            position_ids=batch.position_ids,
            with_entropy=True,
            mask=batch.mask if masked else None,
            entropy_grad=entropy_grad,
        )
        logprobs = logprobs * batch.mask
        loss, _ = bind_policy_loss(algorithm)(
            logprobs, logprobs.detach(), batch.advantages, batch.mask, token_weights=None, scale=scale
        )
    loss.backward()
    seconds = time.perf_counter() - start
    hook.remove()
    model.zero_grad(set_to_none=True)
    return rows[0], sum(storages.values()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--short", type=int, default=24, help="samples with a short response")
    parser.add_argument("--long", type=int, default=2, help="samples with a long response")
    parser.add_argument("--short-len", type=int, default=16)
    parser.add_argument("--long-len", type=int, default=384)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.long_len + 8,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    rng = random.Random(0)
    lengths = [args.short_len] * args.short + [args.long_len] * args.long
    samples = [sample(args.prompt_len, n, rng, args.vocab) for n in lengths]
    mask = response_tensor([[1.0] * n for n in lengths])
    advantages = torch.randn(len(lengths), 1, generator=torch.Generator().manual_seed(0)) * mask
    batch = pack_samples(samples, {"advantages": advantages})
    algorithm = AlgorithmConfig(kl_mode="none", kl_coef=0.0, entropy_coef=0.0, aggregation="token_mean")

    gflops = fp32_gflops()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"fp32 matmul (512^3): {gflops:.1f} GFLOP/s")
    print(
        f"batch: {len(lengths)} samples, prompts of {args.prompt_len}, responses {args.short} x {args.short_len} "
        f"+ {args.long} x {args.long_len} tokens; response index {tuple(batch.mask.shape)} = "
        f"{batch.mask.numel()} entries, {int(batch.mask.sum())} real"
    )
    print(f"{'':22} {'head rows':>10} {'head GFLOP':>11} {'saved MiB':>10} {'seconds':>9}")
    variants = (("before", False, True), ("real tokens only", True, True), ("after (+ no entropy graph)", True, False))
    for name, masked, entropy_grad in variants:
        update(model, batch, algorithm, masked, entropy_grad)  # warm-up
        runs = [update(model, batch, algorithm, masked, entropy_grad) for _ in range(args.repeats)]
        rows, saved = runs[0][0], runs[0][1]
        head_gflop = 3 * 2 * rows * args.hidden * args.vocab / 1e9  # forward + two backward matmuls
        seconds = statistics.median(r[2] for r in runs)
        print(f"{name:22} {rows:>10} {head_gflop:>11.2f} {saved / 2**20:>10.1f} {seconds:>9.3f}")
    print(f"(the output layer's matmuls alone at {gflops:.0f} GFLOP/s: head GFLOP / {gflops:.0f} seconds)")

    # A GRPO step on 4 ranks: 16 prompts x 8 samples, prompt lengths long-tailed, consecutive groups.
    rng = random.Random(1)
    step = []
    for _ in range(16):
        prompt = int(rng.paretovariate(1.2) * 32)
        step += [sample(min(prompt, 1024), rng.randint(16, 256), rng, 100) for _ in range(8)]
    tokens = [len(s.prompt_ids) + len(s.response_ids) for s in step]
    contiguous = [tokens[r * 32 : (r + 1) * 32] for r in range(4)]
    balanced = [[tokens[i] for micro in rank for i in micro] for rank in micro_batches_for_ranks(step, 4, 10**6)]
    for name, shards in (("contiguous", contiguous), ("token-balanced", balanced)):
        totals = [sum(s) for s in shards]
        print(f"{name:>15} shards: tokens per rank {totals}, max / min {max(totals) / min(totals):.2f}")


if __name__ == "__main__":
    main()
