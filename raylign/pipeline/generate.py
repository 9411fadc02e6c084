"""``raylign generate``: n sampled responses per prompt of a dataset, written as JSONL.

Prompts are read and rendered exactly as ``raylign rl`` renders them (:func:`raylign.rl.prompts.load_prompts`:
chat template with the generation prompt, or ``prompt_template``), sent to the engines as token ids
in batches of ``batch_size``, and written one row per prompt (format in :mod:`raylign.pipeline`).
With ``sampling.seed`` set, the samples of prompt i (counted over all datasets, in order) are
seeded from ``seed + i * n`` (see :class:`~raylign.config.rollout.SamplingConfig`), so a seeded
run gives the same file whatever the batch size and number of engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from raylign.config.data import DatasetSpec
from raylign.config.pipeline import GENERATION_KEYS, GenerateConfig, PromptDataConfig
from raylign.config.rl import RLDataConfig
from raylign.data import read_rows
from raylign.pipeline.files import JsonlWriter
from raylign.pipeline.runtime import ray_runtime
from raylign.rl.prompts import Prompt, load_prompts
from raylign.rollout.base import Completion

log = logging.getLogger("raylign")


def prompt_loading_config(data: PromptDataConfig) -> RLDataConfig:
    """The RL prompt section that renders prompts the way ``data`` asks."""
    plain = {"prompt_template": data.prompt_template} if data.format == "plain" else {}  # chat reads no template
    return RLDataConfig(train=data.prompts, format=data.format, max_prompt_length=data.max_prompt_length, **plain)


def passthrough(row: dict[str, Any], spec: DatasetSpec, keys: list[str] | None) -> dict[str, Any]:
    """The row keys copied to the output: ``keys`` (absent ones as null), or every key but the prompt and label."""
    if keys is not None:
        return {key: row.get(key) for key in keys}
    skip = {spec.input_key, spec.label_key, *GENERATION_KEYS}
    return {key: value for key, value in row.items() if key not in skip}


def load_dataset_prompts(
    spec: DatasetSpec, data: PromptDataConfig, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[Prompt, dict[str, Any]]]:
    """Each rendered prompt of ``spec`` with the start of its output row: the prompt as written, its label, its
    data source as ``raylign rl`` names it (the row's ``data_source``, else the prompt file's name; ``raylign
    score`` passes it to reward functions as ``source``), and the passthrough keys."""
    prompts = load_prompts([spec], prompt_loading_config(data), tokenizer)
    wanted = {p.where.row for p in prompts}
    rows = {number: row for number, row in read_rows(spec.path, split=spec.split) if number in wanted}
    out = []
    for p in prompts:
        row = rows[p.where.row]
        head = {"prompt": row[spec.input_key], "prompt_text": p.text, "label": p.label, "data_source": p.source}
        out.append((p, {**head, **passthrough(row, spec, data.passthrough_keys)}))
    return out


def output_row(head: dict[str, Any], completions: Sequence[Completion]) -> dict[str, Any]:
    """A prompt's output row: ``head`` with its responses (in sample order) placed after the prompt."""
    row = {
        "prompt": head["prompt"],
        "prompt_text": head["prompt_text"],
        "responses": [c.text for c in completions],
        "finish_reasons": [c.finish_reason for c in completions],
    }
    row.update((k, v) for k, v in head.items() if k not in row)
    return row


def group_by_prompt(completions: Sequence[Completion], first_index: int, num_prompts: int) -> list[list[Completion]]:
    """Completions of prompts ``first_index ..`` grouped per prompt, samples in order."""
    groups: list[list[Completion]] = [[] for _ in range(num_prompts)]
    for c in sorted(completions, key=lambda c: (c.prompt_index, c.sample_index)):
        groups[c.prompt_index - first_index].append(c)
    return groups


def _generate_all(cfg: GenerateConfig, model_path: str, items: list[tuple[Prompt, dict[str, Any]]]) -> dict[str, float]:

    import ray

    from raylign.rl.placement import engine_node_cores, engine_threads
    from raylign.rollout.pool import RolloutPool, launch_engines, stop_engines
    from raylign.trainers.progress import Progress

    # Nothing computes beside the engines: with rollout.threads_per_engine auto they share the cores.
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    threads = engine_threads(cfg.rollout, engine_node_cores(cfg.ray.address), has_gpus)
    engines = launch_engines(
        model_path,
        cfg.rollout,
        env_vars={"OMP_NUM_THREADS": str(threads)},
        startup_timeout_s=cfg.ray.startup_timeout_s,
        timeout_setting="ray.startup_timeout_s",
    )
    counts: dict[str, float] = {"response_tokens": 0, "stopped": 0, "responses": 0}
    progress = Progress(len(items), "generate", enabled=cfg.progress_bar)
    try:
        pool = RolloutPool(engines, cfg.rollout.generate_timeout_s)
        with JsonlWriter(cfg.output_path) as writer:
            for start in range(0, len(items), cfg.batch_size):
                batch = items[start : start + cfg.batch_size]
                completions = pool.generate_blocking(
                    [p.token_ids for p, _ in batch], cfg.sampling, list(range(start, start + len(batch)))
                )
                for (_, head), group in zip(batch, group_by_prompt(completions, start, len(batch))):
                    writer.write(output_row(head, group))
                counts["responses"] += len(completions)
                counts["response_tokens"] += sum(len(c.response_token_ids) for c in completions)
                counts["stopped"] += sum(c.finish_reason == "stop" for c in completions)
                progress.advance_to(start + len(batch))
    finally:
        progress.close()
        stop_engines(engines)
    return counts


def run_generate(cfg: GenerateConfig) -> dict[str, float]:
    """Generate ``sampling.n`` responses for every prompt of ``data.prompts``; returns summary metrics."""
    from raylign.models import load_tokenizer, resolve_model_path

    model_path = str(resolve_model_path(cfg.model.path))
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path, padding_side="left")
    items = [item for spec in cfg.data.prompts for item in load_dataset_prompts(spec, cfg.data, tokenizer)]
    log.info(
        "generating %d responses for each of %d prompts with the %s engine",
        cfg.sampling.n,
        len(items),
        cfg.rollout.engine,
    )
    if items:  # room for the longest prompt and its completion
        longest = max((p for p, _ in items), key=lambda p: len(p.token_ids))
        room = cfg.rollout.with_room_for(len(longest.token_ids), cfg.sampling.max_new_tokens, str(longest.where))
        cfg = cfg.model_copy(update={"rollout": room})
    start = time.perf_counter()
    cpus = cfg.rollout.num_engines * cfg.rollout.num_cpus_per_engine
    with ray_runtime(cfg.ray, cpus):
        counts = _generate_all(cfg, model_path, items)
    elapsed = time.perf_counter() - start
    metrics = {
        "prompts": len(items),
        "responses": counts["responses"],
        "response_length/mean": counts["response_tokens"] / max(counts["responses"], 1),
        "finish_reason/stop_fraction": counts["stopped"] / max(counts["responses"], 1),
        "time/total_s": elapsed,
        "throughput/generated_tokens_per_s": counts["response_tokens"] / max(elapsed, 1e-9),
    }
    log.info(
        "wrote %d rows to %s (mean response length %.1f tokens, %.0f%% stopped before max_new_tokens)",
        len(items),
        cfg.output_path,
        metrics["response_length/mean"],
        100 * metrics["finish_reason/stop_fraction"],
    )
    return metrics
