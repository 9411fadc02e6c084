"""Code run inside the 2 spawned gloo ranks of ``test_sequence_parallel.py``.

Each rank runs its half of a packed row through ring attention and Ulysses attention (and through a
tiny HF model using each) and saves what it computed; the test compares against one process over the whole row.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZE = 2
# name -> (query heads, key/value heads, sample lengths of the packed row); the row's halves are
# cut at token 6 inside a sample in both cases.
ATTENTION_CASES = {
    "spanning_sample": (2, 2, [5, 4, 3]),
    "gqa": (4, 2, [3, 7, 2]),
    "one_kv_head": (4, 1, [4, 6, 2]),  # fewer key/value heads than ranks: Ulysses repeats them
}
MODES = ("ring", "ulysses")  # engine.sequence_parallel_mode
HEAD_DIM = 8
MODEL_SAMPLES = [5, 8, 4]  # 17 tokens: padded to 18, cut at 9 inside the second sample


def positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def attention_inputs(name: str) -> dict[str, torch.Tensor]:
    """Full-row query, key, value ``[1, H, T, D]`` and output weights ``[1, Hq, T, D]``, float32."""
    heads, kv_heads, lengths = ATTENTION_CASES[name]
    total = sum(lengths)
    generator = torch.Generator().manual_seed(len(name))
    return {
        "query": torch.randn(1, heads, total, HEAD_DIM, generator=generator),
        "key": torch.randn(1, kv_heads, total, HEAD_DIM, generator=generator),
        "value": torch.randn(1, kv_heads, total, HEAD_DIM, generator=generator),
        "weights": torch.randn(1, heads, total, HEAD_DIM, generator=generator),
    }


def model_inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    """A packed row of ``MODEL_SAMPLES``: ids, positions, a loss mask (0 at each sample's first token
    and at one more) and weights for a linear function of the logits."""
    total = sum(MODEL_SAMPLES)
    generator = torch.Generator().manual_seed(7)
    loss_mask = (torch.rand(1, total, generator=generator) > 0.2).long()
    starts = torch.tensor([0, *torch.tensor(MODEL_SAMPLES).cumsum(0)[:-1].tolist()])
    loss_mask[0, starts] = 0
    return {
        "input_ids": torch.randint(0, vocab_size, (1, total), generator=generator),
        "position_ids": positions(MODEL_SAMPLES),
        "loss_mask": loss_mask,
        "logit_weights": torch.randn(1, total, vocab_size, generator=generator),
    }


# RL micro-batch: packed rows of 11 tokens (padded to 12 and cut at 6), samples as (row, offset, prompt
# length, response length). The second sample's response is predicted from both halves of its row.
RL_ROW_TOKENS = 11
RL_SAMPLES = [(0, 0, 2, 2), (0, 4, 1, 6), (1, 0, 2, 4)]


def rl_inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``position_ids`` ``[2, 11]``, ``resp_index`` / ``mask`` ``[3, 6]`` as RL packs them
    (padding at positions restarting from 0), and weights for the log-probs and entropies."""
    generator = torch.Generator().manual_seed(11)
    rows = 1 + max(row for row, *_ in RL_SAMPLES)
    width = max(response for *_, response in RL_SAMPLES)
    input_ids = torch.randint(1, vocab_size, (rows, RL_ROW_TOKENS), generator=generator)
    position_ids = torch.zeros(rows, RL_ROW_TOKENS, dtype=torch.long)
    resp_index = torch.zeros(len(RL_SAMPLES), width, dtype=torch.long)
    mask = torch.zeros(len(RL_SAMPLES), width, dtype=torch.long)
    ends = [0] * rows
    for i, (row, offset, prompt, response) in enumerate(RL_SAMPLES):
        position_ids[row, offset : offset + prompt + response] = torch.arange(prompt + response)
        start = row * RL_ROW_TOKENS + offset + prompt
        resp_index[i, :response] = torch.arange(start, start + response)
        mask[i, :response] = 1
        ends[row] = max(ends[row], offset + prompt + response)
    for row, end in enumerate(ends):
        input_ids[row, end:] = 0
        position_ids[row, end:] = torch.arange(RL_ROW_TOKENS - end)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "resp_index": resp_index,
        "mask": mask,
        "logprob_weights": torch.randn(len(RL_SAMPLES), width, generator=generator),
        "entropy_weights": torch.randn(len(RL_SAMPLES), width, generator=generator),
    }


def _chunk(tensor: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    return tensor.chunk(WORLD_SIZE, dim=dim)[rank].contiguous()


def run_attention_case(name: str, rank: int, mode: str) -> dict[str, torch.Tensor]:
    from raylign.models.ring_attention import ring_attention, sample_ids_from_position_ids
    from raylign.models.ulysses_attention import ulysses_attention

    full = attention_inputs(name)
    _, _, lengths = ATTENTION_CASES[name]
    q, k, v = (_chunk(full[n], rank, dim=2).requires_grad_() for n in ("query", "key", "value"))
    token_index = _chunk(torch.arange(sum(lengths)).unsqueeze(0), rank, dim=1)
    sample_ids = _chunk(sample_ids_from_position_ids(positions(lengths)), rank, dim=1)
    attention = {"ring": ring_attention, "ulysses": ulysses_attention}[mode]
    out = attention(q, k, v, token_index, sample_ids, group=dist.group.WORLD)
    (out * _chunk(full["weights"], rank, dim=2)).sum().backward()
    return {"out": out.detach(), "query_grad": q.grad, "key_grad": k.grad, "value_grad": v.grad}


def _summed_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the ranks (each rank holds its own chunk's share)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad
    model.zero_grad(set_to_none=True)
    return grads


def run_model_case(model_dir: str, rank: int, mode: str = "ring") -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from raylign.models.sequence_parallel import (
        SEQUENCE_ATTENTION,
        SequenceShard,
        sequence_shard,
        shard_packed_batch,
        sharded_target_logprobs,
    )

    attention = SEQUENCE_ATTENTION[mode]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
    full = model_inputs(model.config.vocab_size)
    chunk = shard_packed_batch(full, rank, WORLD_SIZE, pad_token_id=0)
    length = chunk["input_ids"].shape[1]
    # logits at padding get weight 0: the single-process reference has no padding
    weights = torch.nn.functional.pad(full["logit_weights"], (0, 0, 0, WORLD_SIZE * length - sum(MODEL_SAMPLES)))
    shard = SequenceShard(dist.group.WORLD, chunk["token_index"], chunk["sample_ids"])
    with sequence_shard(shard):
        logits = model(input_ids=chunk["input_ids"], position_ids=chunk["position_ids"], use_cache=False).logits
    (logits * _chunk(weights, rank, dim=1)).sum().backward()
    logit_grads = _summed_grads(model)
    target_logprobs = sharded_target_logprobs(model, chunk, dist.group.WORLD)
    (-target_logprobs.sum()).backward()
    return {
        "logits": logits.detach(),
        "logit_grads": logit_grads,
        "target_logprobs": target_logprobs.detach(),
        "target_mask": chunk["target_mask"],
        "loss_grads": _summed_grads(model),
    }


def run_rl_case(model_dir: str, rank: int) -> dict[str, object]:
    """RL's log-probs and entropies of response tokens, split over the ranks, and the gradient of a
    weighted sum of both: each rank's gradient, averaged over the ranks as data-parallel training does."""
    from transformers import AutoModelForCausalLM

    from raylign.models.sequence_parallel import RING_ATTENTION, sharded_selected_token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=RING_ATTENTION)
    full = rl_inputs(model.config.vocab_size)

    def run(entropy_grad: bool):
        return sharded_selected_token_logprobs(
            model,
            full["input_ids"],
            full["resp_index"],
            full["position_ids"],
            dist.group.WORLD,
            temperature=0.7,
            with_entropy=True,
            mask=full["mask"],
            entropy_grad=entropy_grad,
        )

    logprobs, entropy = run(entropy_grad=True)
    (logprobs * full["logprob_weights"] + entropy * full["entropy_weights"]).sum().backward()
    grads = {name: grad / WORLD_SIZE for name, grad in _summed_grads(model).items()}
    with torch.no_grad():  # the detached-entropy path
        _, entropy_no_grad = run(entropy_grad=False)
    return {
        "logprobs": logprobs.detach(),
        "entropy": entropy.detach(),
        "entropy_no_grad": entropy_no_grad,
        "grads": grads,
    }


def score_model(model_dir: str, attn_implementation: str) -> torch.nn.Module:
    """A one-label score model on the tiny backbone; its fresh head is the same in every process (seeded)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(5)
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32, attn_implementation=attn_implementation
    )


def run_critic_case(model_dir: str, rank: int) -> dict[str, object]:
    """A critic's values of the states before response tokens, split over the ranks, and the averaged
    gradient of a weighted sum of them."""
    from raylign.models.sequence_parallel import RING_ATTENTION, sharded_response_values

    model = score_model(model_dir, RING_ATTENTION)
    full = rl_inputs(model.config.vocab_size)
    values = sharded_response_values(
        model, full["input_ids"], full["resp_index"], full["position_ids"], dist.group.WORLD, full["mask"]
    )
    (values * full["logprob_weights"]).sum().backward()
    grads = {name: grad / WORLD_SIZE for name, grad in _summed_grads(model).items()}
    return {"values": values.detach(), "grads": grads}


def run_rank(rank: int, port: int, out_dir: str, model_dirs: dict[str, str]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )
    # The group is never destroyed: the rank ends through exit_process (see spawned_ranks.as_gloo_rank).
    results: dict[str, object] = {
        f"{name}_{mode}": run_attention_case(name, rank, mode) for name in ATTENTION_CASES for mode in MODES
    }
    for arch, model_dir in model_dirs.items():
        results[arch] = run_model_case(model_dir, rank)
        results[f"{arch}_ulysses"] = run_model_case(model_dir, rank, "ulysses")
        results[f"{arch}_rl"] = run_rl_case(model_dir, rank)
        results[f"{arch}_critic"] = run_critic_case(model_dir, rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
