"""Reward sources for online RL: which ones, their settings, and the weights that combine them.

The combined reward of a sample is ``sum_i weight_i * reward_i`` over the listed sources; each
source's own reward is also reported as a metric, so a source with weight 0 is monitored only.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raylign.config.base import Section

RewardKind = Literal["function", "reward_model", "http", "math", "exact_match", "format"]

# Fields that only some kinds read; setting one for another kind is a mistake worth reporting.
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "function": ("path", "function_name", "num_workers", "timeout_s"),
    "reward_model": (
        "model_path",
        "batch_size",
        "normalize",
        "max_length",
        "dtype",
        "num_cpus",
        "num_gpus",
        "timeout_s",
    ),
    "http": ("url", "api_key", "api_key_env", "timeout_s", "max_retries", "backoff_s", "batch_size"),
    "math": (),
    "exact_match": ("case_sensitive",),
    "format": ("format_regex",),
}
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {"function": ("path",), "reward_model": ("model_path",), "http": ("url",)}
COMMON_FIELDS = ("kind", "name", "weight")

DEFAULT_FORMAT_REGEX = r"\s*<think>.*?</think>\s*\S.*"


class RewardSourceConfig(Section):
    """One reward source. ``kind`` picks it; the fields listed for that kind configure it."""

    kind: RewardKind = Field(
        ...,
        description="function: a Python file's reward_func; reward_model: a sequence-classification model folder; "
        "http: a remote scorer (raylign serve-rm); math: math-verify answer check against the label; "
        "exact_match: response equals the label; format: response matches format_regex.",
    )
    name: str | None = Field(
        None,
        min_length=1,
        pattern=r"^[^/]+$",
        description="Metric name of this source, without '/' (its metrics are logged as name/metric); defaults to "
        "the kind (kind_2, ... when repeated).",
    )
    weight: float = Field(1.0, description="Factor of this source in the combined reward; 0 only reports it.")

    # function
    path: str | None = Field(None, description="[function] Python file that defines the reward function.")
    function_name: str = Field("reward_func", min_length=1, description="[function] Name of the function in the file.")
    num_workers: int = Field(
        1, ge=1, le=256, description="[function] Worker processes; the batch is split into this many chunks."
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="[function] Seconds one call on a chunk may take. [http] Seconds one request (one attempt) "
        "may take in all: connecting, sending and reading the whole answer, however slowly it arrives. "
        "[reward_model] Seconds the model may take to score one batch handed to the source.",
    )

    # reward_model
    model_path: str | None = Field(
        None, description="[reward_model] Folder of an AutoModelForSequenceClassification model (one label)."
    )
    batch_size: int = Field(
        16, ge=1, le=65536, description="[reward_model] Samples per forward pass. [http] Samples per request."
    )
    normalize: bool = Field(
        True,
        description="[reward_model] Return (score - mean) / std with raylign_reward_mean / raylign_reward_std "
        "from the model's config.json (written by raylign rm).",
    )
    max_length: int | None = Field(
        None,
        ge=8,
        description="[reward_model] Keep at most this many tokens: the end of the text (and an encoder classifier's "
        "first token, e.g. [CLS]); None keeps all.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="[reward_model] Parameter dtype.")
    num_cpus: float = Field(1.0, ge=0, description="[reward_model] CPUs reserved for the Ray actor.")
    num_gpus: float = Field(0.0, ge=0, description="[reward_model] GPUs for the Ray actor (>0 runs it on CUDA).")

    # http
    url: str | None = Field(
        None, description="[http] Address of the /score endpoint, e.g. http://127.0.0.1:8000/score."
    )
    api_key: str | None = Field(None, description="[http] Sent as 'Authorization: Bearer <key>'.")
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="[http] Environment variable holding the API key (keeps it out of config files); "
        "used when api_key is not set.",
    )
    max_retries: int = Field(
        3,
        ge=0,
        le=100,
        description="[http] Retries after a timeout, a failed connection, a 408, 429, 500, 502, 503 or 504 "
        "answer, or a malformed or wrong-length answer; other error answers (e.g. 422: a batch the "
        "server cannot score) fail at once.",
    )
    backoff_s: float = Field(
        1.0, ge=0, le=3600, description="[http] Wait before retry k (k = 1, 2, ...) is backoff_s * 2**(k-1) seconds."
    )

    # exact_match
    case_sensitive: bool = Field(True, description="[exact_match] Compare letter case too.")

    # format
    format_regex: str = Field(
        DEFAULT_FORMAT_REGEX,
        description="[format] Regex the whole response must match (DOTALL: '.' matches newlines); "
        "default: a <think>...</think> block, then a non-empty answer.",
    )

    @field_validator("format_regex")
    @classmethod
    def _regex_compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        return value

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value

    @model_validator(mode="after")
    def _fields_match_kind(self) -> RewardSourceConfig:
        missing = [f for f in REQUIRED_FIELDS.get(self.kind, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"kind '{self.kind}' needs {', '.join(missing)}")
        allowed = set(COMMON_FIELDS) | set(KIND_FIELDS[self.kind])
        foreign = sorted(self.set_away_from_default(set(self.model_fields_set) - allowed))
        if foreign:
            raise ValueError(
                f"{', '.join(foreign)} not used by kind '{self.kind}' (its fields: "
                f"{', '.join(KIND_FIELDS[self.kind]) or 'none besides name and weight'})"
            )
        return self

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the value of the variable ``api_key_env`` names (which must then be set)."""
        if self.api_key is not None or self.api_key_env is None:
            return self.api_key
        value = os.environ.get(self.api_key_env)
        if not value:
            raise ValueError(f"api_key_env names {self.api_key_env}, but that environment variable is not set")
        return value


class RewardConfig(Section):
    """Reward sources combined as ``sum_i weight_i * reward_i``."""

    sources: list[RewardSourceConfig] = Field(
        ..., min_length=1, description="The reward sources; each one's reward is also logged under its name."
    )
    non_finite: Literal["error", "drop"] = Field(
        "error",
        description="A reward that is NaN or infinite, from any source: the run stops with an error naming "
        "the sample (error), or the sample's prompt group is dropped, counted in reward/non_finite_groups, and "
        "another prompt's group takes its place (drop). Never trained on. In raylign score, drop leaves the row "
        "out of the output and counts it in non_finite_rows.",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> RewardConfig:
        names = [s.name for s in self.sources if s.name is not None]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"source names must be unique; repeated: {', '.join(repeated)}")
        return self

    def source_names(self) -> list[str]:
        """Each source's metric name: its ``name``, else its kind, numbered from the second of a kind on."""
        taken = {s.name for s in self.sources if s.name is not None}
        names: list[str] = []
        for source in self.sources:
            if source.name is not None:
                names.append(source.name)
                continue
            candidate: str = source.kind
            k = 1
            while candidate in taken:
                k += 1
                candidate = f"{source.kind}_{k}"
            taken.add(candidate)
            names.append(candidate)
        return names
