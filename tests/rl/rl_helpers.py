"""Shared pieces of the RL tests: run configs, hand-made samples, plain fp32 references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from raylign.config.base import resolve_config
from raylign.config.rl import RLConfig
from raylign.rl.experience import Behaviour, MicroBatch, Sample
from raylign.rl.presets import PRESETS

# A response scores 1 when it starts with a lowercase letter: about a third of the random
# tiny model's samples do, so groups of 4 usually hold both rewards and the policy gets a
# gradient. exact_match against the label (never hit by a random model) rides along at no cost.
REWARD_SOURCES = [{"kind": "format", "format_regex": "[a-z].*"}, {"kind": "exact_match"}]
# The phases a step logs the seconds of, one after another: disjoint intervals inside time/step_s.
TIMING_PARTS = ("time/generate_s", "time/reward_s", "time/experience_s", "time/train_s", "time/sync_s")


def rl_config_data(model_dir: Path, prompt_file: Path, output_dir: Path, preset: str = "grpo") -> dict[str, Any]:
    """What a user would write in the YAML file for a 2-step run of ``preset`` on the tiny model."""
    data = {
        "preset": preset,
        "model": {"path": str(model_dir), "dtype": "float32"},
        "reward": {"sources": [dict(source) for source in REWARD_SOURCES]},
        "rollout": {"engine": "hf", "dtype": "float32"},
        "sampling": {"max_new_tokens": 16, "temperature": 1.0, "seed": 7},
        "data": {"train": [{"path": str(prompt_file)}]},
        "optim": {"lr": 1e-3},
        "train": {
            "output_dir": str(output_dir),
            "max_steps": 2,
            "prompts_per_step": 4,
            "log_samples": 2,
            "logging": {"progress_bar": False, "tensorboard": False},
        },
    }
    if PRESETS[preset]["algorithm"].get("advantage") == "gae":  # a critic, trained at the policy's rate
        data["critic"] = {"optim": {"lr": 1e-3}}
    return data


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def resolve(tmp_path: Path, data: dict[str, Any], overrides: dict[str, Any] | None = None) -> RLConfig:
    """The config ``raylign rl --config <file> --a.b value`` would run."""
    return resolve_config(RLConfig, write_yaml(tmp_path / "run.yaml", data), overrides)


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return data


def make_sample(prompt_ids: list[int], response_ids: list[int]) -> Sample:
    return Sample(prompt_ids, response_ids, [0.0] * len(response_ids), "", "", None, "test", "length")


def fp32_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def perturbed_fp32_model(model_dir: Path, seed: int = 21) -> torch.nn.Module:
    """The model with seeded noise on every weight: an engine's weights changed behind the trainer's back."""
    model = fp32_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def response_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """``log_softmax(logits)[token]`` of each response token from one unpacked forward (keeps the graph)."""
    logits = model(torch.tensor([prompt_ids + response_ids])).logits[0]
    start = len(prompt_ids) - 1
    rows = torch.log_softmax(logits[start : start + len(response_ids)].float(), dim=-1)
    return rows.gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)


def state_dict_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in fp32_model(model_dir).state_dict().items()}


def worker_config(
    model_dir: Path,
    prompt_file: Path,
    output_dir: Path,
    backend: str,
    workers: int,
    *,
    zero_stage: int = 2,
    optim: dict[str, Any] | None = None,
    algorithm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The config dump the controller hands its policy workers, for a policy on ``workers`` ranks."""
    data = rl_config_data(model_dir, prompt_file, output_dir)
    data["engine"] = {"backend": backend, "zero_stage": zero_stage, "dist_timeout_s": 120}
    data["placement"] = {"policy_workers": workers}
    data["rollout"].update(bucket_mb=0.05, sync_timeout_s=60)  # several buckets even for the tiny model
    data["optim"] = {"lr": 1e-3, **(optim or {})}
    data["algorithm"] = {"kl_mode": "none", "kl_coef": 0.0, **(algorithm or {})}
    tmp = output_dir.parent
    tmp.mkdir(parents=True, exist_ok=True)
    return resolve(tmp, data).model_dump(mode="json")


def shard_for_ranks(
    samples: list[Sample],
    per_token: dict[str, torch.Tensor],
    world: int,
    max_tokens: int,
    behaviour: Behaviour = "trainer_recomputed",
    plan: list[list[list[int]]] | None = None,
) -> list[list[MicroBatch]]:
    """Packed micro-batches per rank, split as the controller splits a mini-batch (or as ``plan`` says:
    sample positions per micro-batch per rank)."""
    from raylign.rl.experience import micro_batches_for_ranks, pack_samples

    plan = plan if plan is not None else micro_batches_for_ranks(samples, world, max_tokens)
    return [
        [
            pack_samples([samples[i] for i in micro], {k: v[micro] for k, v in per_token.items()}, behaviour=behaviour)
            for micro in rank_plan
        ]
        for rank_plan in plan
    ]
