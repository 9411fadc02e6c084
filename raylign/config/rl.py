"""raylign rl: online RL (PPO, GRPO, Dr.GRPO, REINFORCE++, RLOO, GSPO, DAPO) on Ray.

An algorithm is a choice of advantage estimator, policy loss, KL mode and loss aggregation
from the algorithm library; ``preset`` fills these with vetted defaults, and any field
set in the YAML file or on the command line overrides the preset.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raylign.config.agent import AgentConfig
from raylign.config.base import Section, check_registered, deep_merge, registered
from raylign.config.data import (
    RESPONSE_KEYS,
    DatasetSpec,
    check_prompt_template,
    dataset_list,
    refuse_keys_prompts_ignore,
    refuse_plain_settings_under_chat,
)
from raylign.config.engine import LORA_AUTOTP, EngineConfig, refuse_master_weights_off, refuse_quantized_layout
from raylign.config.model import ModelConfig
from raylign.config.optim import OptimConfig
from raylign.config.reward import RewardConfig
from raylign.config.rollout import MAX_ENGINE_LORA_RANK, RolloutConfig, SamplingConfig
from raylign.config.train import LoggingConfig

# The algorithm library's built-in names of the functions a field below selects (a test checks them
# against the registries); plugins may register more. Listed here so that a config loads without torch.
ADVANTAGE_ESTIMATORS = (
    "gae", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "grpo", "dr_grpo"
)  # fmt: skip
GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"}
# The AlgorithmConfig fields each built-in estimator reads (its registration's ``options``).
ESTIMATOR_OPTIONS = {
    "gae": ("gamma", "lam"),
    "reinforce": ("gamma",),
    "reinforce_plus_plus": ("gamma",),
    "reinforce_plus_plus_baseline": ("gamma",),
    "rloo": (),
    "grpo": ("normalize_std",),
    "dr_grpo": (),
}
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_normalizer")
KL_ESTIMATORS = ("k1", "k2", "k3")
PresetName = Literal["ppo", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "gspo", "dapo"]


def _either(names: list[str]) -> str:
    """``a, b or c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class AlgorithmConfig(Section):
    advantage: str = registered(
        "ADVANTAGE_ESTIMATORS", ADVANTAGE_ESTIMATORS, "grpo", "Advantage estimator (gae needs a critic)."
    )
    normalize_std: bool = Field(True, description="grpo: divide by the group's reward std (false: Dr.GRPO-style).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    policy_loss: str = registered(
        "POLICY_LOSSES",
        POLICY_LOSSES,
        "ppo",
        "ppo: token-level clipped surrogate; gspo: sequence-level ratio (geometric mean over tokens).",
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float | None = Field(None, gt=0, description="Upper clip (clip-higher); None = clip_eps_low.")
    dual_clip_c: float | None = Field(
        None, gt=1, description="policy_loss ppo: dual-clip bound for negative advantages; None off."
    )
    aggregation: str = registered(
        "LOSS_AGGREGATIONS", LOSS_AGGREGATIONS, "token_mean", "How token losses become the batch loss."
    )
    constant_normalizer: int | None = Field(
        None,
        gt=0,
        description="constant_normalizer aggregation: divide token sums by this many tokens (default max_new_tokens).",
    )
    kl_mode: Literal["none", "reward", "loss"] = Field(
        "loss", description="KL to the reference policy: none, a per-token reward penalty, or a loss term."
    )
    kl_estimator: str = registered(
        "KL_ESTIMATORS",
        KL_ESTIMATORS,
        "k3",
        "KL estimator (Schulman's k1/k2/k3); k3 is clamped at 10 per token (it grows as "
        "exp(-log_ratio)), k1 and k2 are not clamped.",
    )
    kl_coef: float = Field(
        0.001, ge=0, description="KL coefficient (reward penalty or loss weight); with kl_mode none, leave it out."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    vf_coef: float = Field(0.5, gt=0, description="Value-loss weight (PPO critic).")
    value_clip: float | None = Field(0.2, gt=0, description="Value clipping range; None disables.")
    off_policy: Literal["none", "truncated_is", "ratio_mask"] = Field(
        "none", description="Correction for rollout-engine vs trainer log-prob mismatch."
    )
    tis_cap: float = Field(2.0, gt=0, description="truncated_is: importance weights clamped at this C.")
    mask_low: float = Field(0.5, gt=0, description="ratio_mask: tokens whose ratio is below this are masked.")
    mask_high: float = Field(2.0, gt=0, description="ratio_mask: tokens whose ratio is above this are masked.")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal and refill (DAPO).")
    max_refill_rounds: int = Field(
        3,
        ge=0,
        description="Dynamic sampling: extra generation rounds per step (up to this many x prompts_per_step uniform "
        "groups dropped and replaced); once spent, uniform groups fill the step. 0: none is replaced.",
    )
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (tokens); 0 disables.")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO soft overlong penalty at max length.")
    normalize_rewards: bool = Field(
        False,
        description="Subtract the running mean of every reward seen so far and "
        "divide by its running std (Ziegler et al. 2019), before the penalties below; for "
        "reward models whose scale means nothing. Checkpointed with the run.",
    )
    length_penalty: Literal["none", "linear", "kimi"] = Field(
        "none",
        description="Added to the reward: linear: -coef x (tokens beyond length_penalty_free_tokens); kimi: "
        "Kimi k1.5's group-relative length reward, coef x (0.5 - (len - shortest) / (longest - shortest)) for a "
        "correct answer, only its negative part for a wrong one.",
    )
    length_penalty_coef: float = Field(0.001, gt=0, description="Weight of length_penalty (linear: per token).")
    length_penalty_free_tokens: int = Field(0, ge=0, description="linear length penalty: tokens that cost nothing.")
    correct_reward: float = Field(
        1.0, description="kimi length penalty: a reward at or above this is a correct answer."
    )
    reward_clip: float | None = Field(None, gt=0, description="Clip rewards to [-c, c]; None disables.")

    @field_validator("advantage", "policy_loss", "aggregation", "kl_estimator")
    @classmethod
    def _registered(cls, name: str, info: ValidationInfo) -> str:
        assert info.field_name is not None
        return check_registered(cls, info.field_name, name)

    @model_validator(mode="after")
    def _dual_clip_for_ppo_only(self) -> AlgorithmConfig:
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"algorithm.dual_clip_c bounds the token-level surrogate of policy_loss: ppo; policy_loss "
                f"{self.policy_loss!r} would ignore it: leave dual_clip_c unset"
            )
        return self

    @model_validator(mode="after")
    def _kl_coef_with_a_kl_term(self) -> AlgorithmConfig:
        if self.kl_mode == "none" and self.kl_coef > 0 and self.set_away_from_default(["kl_coef"]):
            raise ValueError(
                f"algorithm.kl_coef {self.kl_coef} weighs a KL term, but algorithm.kl_mode is none (as the dr_grpo, "
                "gspo and dapo presets set it), which would ignore it: set kl_mode to loss or reward"
            )
        return self

    @model_validator(mode="after")
    def _no_option_the_choices_ignore(self) -> AlgorithmConfig:
        """A field that only some choices of another field read (gamma, tis_cap), given a value while
        another is chosen (grpo, no off-policy correction), would do nothing: refused naming both."""
        estimator = f"advantage {self.advantage}"
        readers = {f: [name for name, fields in ESTIMATOR_OPTIONS.items() if f in fields] for f in ("gamma", "lam")}
        readers["normalize_std"] = ["grpo"]
        reads = self.estimator_options()
        critic = self.estimator_needs("needs_values")
        # field: (whether the current choices read it, the choices that would, the choice made)
        table = {
            **{f: (f in reads, f"advantage {_either(r)}", estimator) for f, r in readers.items()},
            "vf_coef": (critic, "advantage gae (a critic)", estimator),
            "value_clip": (critic, "advantage gae (a critic)", estimator),
            "tis_cap": (self.off_policy == "truncated_is", "off_policy truncated_is", f"off_policy {self.off_policy}"),
            "mask_low": (self.off_policy == "ratio_mask", "off_policy ratio_mask", f"off_policy {self.off_policy}"),
            "mask_high": (self.off_policy == "ratio_mask", "off_policy ratio_mask", f"off_policy {self.off_policy}"),
            "constant_normalizer": (
                self.aggregation == "constant_normalizer",
                "aggregation constant_normalizer",
                f"aggregation {self.aggregation}",
            ),
            "overlong_penalty": (self.overlong_buffer > 0, "overlong_buffer above 0", "overlong_buffer 0"),
            "length_penalty_coef": (
                self.length_penalty != "none",
                "length_penalty linear or kimi",
                f"length_penalty {self.length_penalty}",
            ),
            "length_penalty_free_tokens": (
                self.length_penalty == "linear",
                "length_penalty linear",
                f"length_penalty {self.length_penalty}",
            ),
            "correct_reward": (
                self.length_penalty == "kimi",
                "length_penalty kimi",
                f"length_penalty {self.length_penalty}",
            ),
            "max_refill_rounds": (self.dynamic_sampling, "dynamic_sampling true", "dynamic_sampling false"),
        }
        for field in self.set_away_from_default([f for f, (read, _, _) in table.items() if not read]):
            _, read_by, chosen = table[field]
            raise ValueError(
                f"algorithm.{field} {getattr(self, field)} is read only with algorithm.{read_by}; with "
                f"algorithm.{chosen} it would do nothing: leave it unset, or choose what reads it"
            )
        return self

    def estimator_options(self) -> tuple[str, ...]:
        """The fields of this section the advantage estimator reads (its registration's ``options``)."""
        if self.advantage in ESTIMATOR_OPTIONS:
            return ESTIMATOR_OPTIONS[self.advantage]
        from raylign.algorithms import ADVANTAGE_ESTIMATORS as registry

        return tuple(registry.metadata(self.advantage).get("options", ()))

    def estimator_needs(self, what: str) -> bool:
        """Whether the advantage estimator's registration says it needs ``what`` (``needs_groups``,
        ``needs_values``); built-in names are answered without importing the algorithm library."""
        if self.advantage in ADVANTAGE_ESTIMATORS:
            return {"needs_groups": self.advantage in GROUP_ESTIMATORS, "needs_values": self.advantage == "gae"}[what]
        from raylign.algorithms import ADVANTAGE_ESTIMATORS as registry

        return bool(registry.metadata(self.advantage).get(what))


class CriticConfig(Section):
    path: str | None = Field(None, description="Critic initialisation (defaults to the policy model).")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-6), description="Critic optimizer.")


class RLDataConfig(Section):
    train: list[DatasetSpec] = Field(
        ...,
        min_length=1,
        description="Prompt datasets (input_key: prompt text or "
        "messages; label_key: the reference answer given to reward functions).",
    )
    eval: list[DatasetSpec] = Field(default_factory=list, description="Evaluation prompt datasets.")
    format: Literal["chat", "plain"] = Field("chat", description="chat: apply the chat template to the prompt.")
    prompt_template: str = Field("{input}", description="Plain format: how the prompt text is written.")
    max_prompt_length: int = Field(512, ge=1, description="Longer prompts are an error naming the row.")
    source_key: str = Field("data_source", description="Row key naming its data source (eval is reported per source).")
    seed: int = Field(0, ge=0, description="Shuffling and mixing seed.")

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _single_dataset_shorthand(cls, value: Any) -> Any:
        return dataset_list(value)

    @field_validator("prompt_template")
    @classmethod
    def _template_has_only_input(cls, value: str) -> str:
        return check_prompt_template(value)

    @model_validator(mode="after")
    def _prompt_keys_only(self) -> RLDataConfig:
        """A prompt row's conversation is read from input_key: the keys of training responses would be
        accepted and ignored."""
        reads = "a prompt's text or conversation is read from input_key (keys: input_key, label_key, system_key, "
        for field, specs in (("train", self.train), ("eval", self.eval)):
            refuse_keys_prompts_ignore(specs, RESPONSE_KEYS, field, reads + "max_samples, split, weight)")
        refuse_plain_settings_under_chat(self, ["prompt_template"])
        return self

    @model_validator(mode="after")
    def _weights_on_every_train_dataset_or_none(self) -> RLDataConfig:
        weighted = [spec.weight is not None for spec in self.train]
        if any(weighted) and not all(weighted):
            raise ValueError("set a weight on every train dataset or on none (none: each contributes all its rows)")
        return self


class PlacementConfig(Section):
    policy_workers: int = Field(1, ge=1, description="Data-parallel policy ranks (Ray actors).")
    critic_workers: int = Field(1, ge=1, description="Data-parallel critic ranks (PPO).")
    reference_workers: int = Field(1, ge=1, description="Reference-model ranks.")
    shard_reference: bool = Field(
        True,
        description="With engine.backend fsdp2 and more than one reference worker: the reference ranks form a "
        "process group and each holds a shard of the frozen model in its stored dtype, gathered a layer at a time "
        "as it runs, like the policy (no optimizer, no fp32 copy). false: every reference worker holds a whole "
        "replica (the only mode with the local and deepspeed backends).",
    )
    reference_with_policy: bool | Literal["auto"] = Field(
        "auto",
        description="The reference model lives in the policy's worker processes, one replica per policy rank "
        "(with engine.backend fsdp2 and placement.shard_reference, sharded over the policy's ranks), and no "
        "reference workers start: a run then starts one process fewer per reference rank. auto: so when the "
        "reference would compute in the experience phase anyway (no early reference: train.early_reference), "
        "with one reference worker, no placement.colocate and no tensor or sequence parallel policy; "
        "otherwise reference workers of its own.",
    )
    colocate: bool = Field(
        False,
        description="Hybrid engine: each policy rank runs its rollout engine in its own "
        "process and device; weights are handed over in memory, trainers offload and engines "
        "sleep by phase. rollout.num_engines is then the number of policy workers.",
    )
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        description="Ray CPU slots reserved per training worker (placement only: see threads_per_worker).",
    )
    threads_per_worker: int | Literal["auto"] = Field(
        "auto",
        description="Torch compute threads of a training worker. auto: the phases take turns, so each phase's "
        "workers share the cores of their node that nothing else keeps busy meanwhile (with rollout.max_staleness "
        ">= 1 the engines generate beside training and keep rollout.num_engines x rollout.num_cpus_per_engine of "
        "them), at least 1 each; on GPUs one per placement.cpus_per_worker. A number pins it for every phase.",
    )

    ray_address: str | None = Field(None, description="Join this Ray cluster; None starts a local Ray.")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of a local Ray (default: enough for the run).")
    startup_timeout_s: float = Field(
        600.0,
        ge=1.0,
        le=86_400.0,
        description="Longest wait (1 s - 1 day) for the "
        "model workers, rollout engines and reward actors to start (model loaded, "
        "process groups formed); past it the run stops naming what did not start.",
    )
    worker_call_timeout_s: float = Field(
        3600.0,
        ge=1.0,
        le=86_400.0,
        description="Longest wait (1 s - 1 day) for "
        "the model workers' answers to one call: a step's forward or training "
        "passes, a weight sync, a checkpoint save or export; past it the run "
        "stops naming the ranks that did not answer.",
    )

    @field_validator("threads_per_worker")
    @classmethod
    def _at_least_one_thread(cls, threads: int | str) -> int | str:
        if threads != "auto" and int(threads) < 1:
            raise ValueError(f"a worker computes on at least 1 thread (got {threads}); or auto")
        return threads


class RLTrainConfig(Section):
    output_dir: str = Field("outputs/rl", description="Checkpoints, metrics, plots and the final policy.")
    max_steps: int = Field(100, ge=1, description="RL steps (each: generate, score, update, sync).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per step (rollout batch).")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per RL step (the rollout batch is split).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    micro_batch_tokens: int = Field(4096, ge=16, description="Token budget of a micro-batch (balanced packing).")
    pack_row_tokens: int = Field(
        0,
        ge=0,
        description="Tokens per packed row within a micro-batch; 0: one row per micro-batch where every model "
        "computes attention within each packed sample on its own (sdpa on Llama, Mistral, Qwen2, Qwen3 without a "
        "sliding window), else rows as long as the longest sample (a block mask costs the square of a row).",
    )
    early_reference: bool | Literal["auto"] = Field(
        "auto",
        description="The reference workers compute each prompt group's log-probs as soon as the group is scored, "
        "on one thread each, while other groups still generate, instead of all in the experience phase (the "
        "reference is frozen, so when they run changes nothing else). Not with placement.colocate, where the "
        "reference shares its device with the generating engine. auto: on, except on CPU in a synchronous run whose "
        "engines compute with every core (rollout.threads_per_engine: auto), where a pass beside them slowed "
        "generation more than it saved; true there leaves the reference ranks their cores.",
    )
    async_rollout: bool | None = Field(
        None, description="Replaced by rollout.max_staleness (async_rollout: true is rollout.max_staleness: 1)."
    )
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (and at start and end); 0 only start/end.")
    eval_n: int = Field(
        1,
        ge=1,
        description="Samples per eval prompt: pass@1 and pass@eval_n are logged (above 1 needs eval_temperature > 0).",
    )
    eval_temperature: float = Field(
        0.0, ge=0, le=10.0, description="Eval sampling temperature: 0 decodes greedily, else 0.01-10 (as sampling's)."
    )

    @field_validator("eval_temperature")
    @classmethod
    def _eval_greedy_or_at_least_a_hundredth(cls, value: float) -> float:
        return SamplingConfig.greedy_or_at_least_a_hundredth(value)

    eval_max_new_tokens: int | None = Field(
        None, ge=1, description="Most tokens per eval completion (default: sampling.max_new_tokens)."
    )
    eval_threshold: float = Field(1.0, description="An eval sample counts as correct when its reward >= this.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps; 0 only at the end.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
    log_samples: int = Field(4, ge=0, description="Completions per step written to <output_dir>/samples.jsonl.")
    max_skipped_steps: int = Field(
        3,
        ge=0,
        description="RL steps in a row whose updates may be skipped for a "
        "non-finite loss or gradient norm (counted in skipped_steps) before the run "
        "stops with a diagnostic; 0 stops at the first.",
    )
    resume: bool = Field(
        True,
        description="Continue from the newest complete checkpoint; false starts over, and this run's saves "
        "replace the checkpoints already there.",
    )
    export: bool = Field(True, description="Export the final policy to <output_dir>/final.")
    seed: int = Field(
        42,
        description="Seed of torch's random state in the controller and the workers: new weights (a critic's value "
        "head, LoRA adapters) and dropout. Sampling is seeded by sampling.seed or rollout.seed, the prompt order by "
        "data.seed.",
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metric sinks and console output.")


class RLConfig(Section):
    """raylign rl: online RL with rollouts from vLLM (or HF) and rewards from functions, models or servers."""

    plugins: list[str] = Field(
        default_factory=list,
        description="Python files (path/to/file.py) or modules (package.module) imported before "
        "the rest of the config is read, in the controller and in every training worker: the advantage "
        "estimators, policy losses, loss aggregations and KL estimators they register can then be named "
        "in algorithm. A file path is made absolute; on a cluster every node must be able to read it.",
    )
    preset: PresetName = Field(
        "grpo",
        description="Algorithm defaults: ppo, grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline, rloo, gspo, dapo.",
    )
    model: ModelConfig = Field(..., description="The policy.")
    reference: ModelConfig | None = Field(
        None,
        description="Frozen reference model (defaults to the policy's "
        "initial weights); used when the KL mode is not none. A LoRA policy without one is its own reference "
        "with its adapters turned off (no reference workers).",
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO critic (only with gae).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Estimator, losses, KL.")
    reward: RewardConfig | None = Field(
        None,
        description="Reward sources and their weights (required, unless agent.env or agent.client gives the rewards).",
    )
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Multi-turn agent episodes (agent.env).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation engines.")
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(n=4), description="Rollout sampling.")
    data: RLDataConfig = Field(..., description="Prompt datasets.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Training backend of policy and critic.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-6), description="Policy optimizer.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Ray actors and devices.")
    train: RLTrainConfig = Field(default_factory=RLTrainConfig, description="The RL loop.")

    @classmethod
    def preset_defaults(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A copy of the preset's settings (callers may edit it; the presets stay as they are)."""
        import copy

        from raylign.rl.presets import PRESETS

        name = data.get("preset", "grpo")
        if not isinstance(name, str):  # not a preset name: the field's own validation reports it
            return {}
        return copy.deepcopy(PRESETS.get(name, {}))

    @model_validator(mode="before")
    @classmethod
    def _plugins_then_preset(cls, data: Any) -> Any:
        """The plugins imported (so that the names they register validate below), then the preset's
        settings under what was given, however the config is built (file, command line,
        ``RLConfig.model_validate``): each field given wins over the preset, the preset over the schema."""
        if not isinstance(data, dict):
            return data
        plugins = data.get("plugins")
        if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):  # else the field's check says
            from raylign.user_code import import_plugins

            data = {**data, "plugins": import_plugins(plugins)}
        return deep_merge(cls.preset_defaults(data), data)

    @property
    def optimizer_steps(self) -> int:
        """Each trained model's optimizer steps in the whole run (what its learning-rate schedule spans)."""
        return self.train.max_steps * self.train.mini_batches * self.train.ppo_epochs

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.estimator_needs("needs_values")

    @property
    def uses_reference(self) -> bool:
        return self.algorithm.kl_mode != "none" and self.algorithm.kl_coef > 0

    @property
    def shards_reference(self) -> bool:
        """The ranks that hold the reference, its own workers' or the policy's that host it, shard one
        frozen model between them (placement.shard_reference)."""
        p = self.placement
        ranks = p.policy_workers if self.hosts_reference else p.reference_workers
        sharded = p.shard_reference and self.engine.backend == "fsdp2" and ranks > 1
        return self.uses_reference and not self.reference_is_base and sharded

    def reference_early(self, has_gpus: bool) -> bool:
        """Reference log-probs are computed per group as groups finish (train.early_reference; ``auto``
        is off on CPU where synchronous engines compute with every core: they keep none for it)."""
        if "reference" not in self.worker_roles or self.placement.colocate:
            return False
        if self.train.early_reference == "auto":
            return has_gpus or self.rollout.max_staleness > 0 or self.rollout.threads_per_engine != "auto"
        return self.train.early_reference

    @property
    def reference_is_base(self) -> bool:
        """A LoRA policy without a reference of its own is its own reference, with its adapters turned
        off: the frozen base it trains adapters on is exactly its initial policy."""
        return self.uses_reference and self.model.lora.rank > 0 and self.reference is None

    @property
    def hosts_reference(self) -> bool:
        """The policy's workers hold a reference model of their own (placement.reference_with_policy,
        ``auto`` resolved by :meth:`with_reference_placed`)."""
        return self.uses_reference and not self.reference_is_base and self.placement.reference_with_policy is True

    @property
    def reference_in_policy(self) -> bool:
        """The policy's workers compute the reference log-probs (its base, or a reference they host): the
        run has no reference workers."""
        return self.reference_is_base or self.hosts_reference

    def with_reference_placed(self, has_gpus: bool) -> RLConfig:
        """This config with placement.reference_with_policy ``auto`` decided: in the policy's processes when
        the reference would compute in the experience phase anyway, beside the policy's own passes."""
        p, e = self.placement, self.engine
        if p.reference_with_policy != "auto":
            return self
        hosted = (
            self.uses_reference
            and not self.reference_is_base
            and p.reference_workers == 1
            and not p.colocate
            and e.tensor_parallel_size == e.sequence_parallel_size == 1
            and not self.reference_early(has_gpus)
        )
        return self.model_copy(update={"placement": p.model_copy(update={"reference_with_policy": hosted})})

    @property
    def syncs_adapters(self) -> bool:
        """Weight syncs send a LoRA policy's adapter weights only, which vLLM serves as a LoRA adapter
        (rollout.lora_sync), instead of the merged full weights."""
        r = self.rollout
        return self.model.lora.rank > 0 and (r.lora_sync == "adapter" or (r.lora_sync == "auto" and r.engine == "vllm"))

    @property
    def worker_roles(self) -> dict[str, int]:
        """Model-worker roles of this run and their number of ranks: policy, reference, critic."""
        p = self.placement
        roles = {"policy": p.policy_workers, "reference": p.reference_workers, "critic": p.critic_workers}
        wanted = {
            "policy": True,
            "reference": self.uses_reference and not self.reference_in_policy,
            "critic": self.uses_critic,
        }
        return {role: workers for role, workers in roles.items() if wanted[role]}

    @property
    def ray_cpus_needed(self) -> float:
        """Ray CPU slots the run's actors reserve: model workers, rollout engines, reward-model actors.

        Colocated, the engines live in the policy workers, and each policy rank's bundle holds a
        worker of every role."""
        p, r = self.placement, self.rollout
        sources = self.reward.sources if self.reward is not None else []
        reward_models = sum(s.num_cpus for s in sources if s.kind == "reward_model")
        if p.colocate:
            return p.policy_workers * len(self.worker_roles) * p.cpus_per_worker + reward_models
        workers = sum(self.worker_roles.values())
        return workers * p.cpus_per_worker + r.num_engines * r.num_cpus_per_engine + reward_models

    @model_validator(mode="after")
    def _no_setting_another_would_ignore(self) -> RLConfig:
        """Settings that others would make do nothing, or bend, are refused naming both."""
        a, t, s, p = self.algorithm, self.train, self.sampling, self.placement
        if s.temperature == 0 and (a.estimator_needs("needs_groups") or a.dynamic_sampling):
            raise ValueError(
                f"sampling.temperature 0 samples one greedy answer {s.n} times: every group's rewards are equal, so "
                f"algorithm.advantage '{a.advantage}' gives no sample an advantage and nothing trains; sample at a "
                "temperature above 0"
            )
        if t.eval_n > 1 and t.eval_temperature == 0:
            raise ValueError(
                f"train.eval_n {t.eval_n} with train.eval_temperature 0 evaluates one greedy answer {t.eval_n} times "
                f"(pass@{t.eval_n} would equal pass@1): set eval_temperature above 0, or eval_n 1"
            )
        if self.engine.num_processes != 1:
            raise ValueError(
                f"engine.num_processes {self.engine.num_processes} is how the offline trainers start their ranks; "
                "raylign rl places its ranks with placement.policy_workers and placement.critic_workers"
            )
        if self.reference is not None and not self.uses_reference:
            raise ValueError(
                "reference is set but no KL term uses it (algorithm.kl_mode none or kl_coef 0): remove reference, "
                "or set algorithm.kl_mode to loss or reward with a kl_coef above 0"
            )
        filtered = ([f"sampling.top_p {s.top_p}"] if s.top_p < 1 else []) + (
            [f"sampling.top_k {s.top_k}"] if s.top_k >= 1 else []
        )
        if filtered and (self.rollout.max_staleness > 0 or a.off_policy != "none"):
            raise ValueError(
                f"{' and '.join(filtered)}: the engine's log-probs are those of the filtered distribution, and with "
                "rollout.max_staleness above 0 or an algorithm.off_policy correction they enter the loss beside the "
                "trainer's unfiltered ones, so the ratio is off even for equal weights; sample from the whole "
                "distribution (top_p 1, top_k -1)"
            )
        if p.colocate and self.train.early_reference is True:
            raise ValueError(
                "train.early_reference: true computes reference log-probs while the engines generate, but under "
                "placement.colocate the reference shares its device with the generating engine: use auto or false"
            )
        evals = t.set_away_from_default(["eval_every", "eval_n", "eval_temperature", "eval_max_new_tokens"])
        if evals and not self.data.eval:
            raise ValueError(
                f"{', '.join(f'train.{f}' for f in evals)}: there are no eval prompts to evaluate on; give "
                "data.eval (eval prompt datasets), or leave these unset"
            )
        if a.length_penalty == "kimi" and s.n < 2:
            raise ValueError(
                f"algorithm.length_penalty: kimi compares the lengths of a prompt's samples: with sampling.n {s.n} "
                "it is always 0; use linear, or sample at least 2 per prompt"
            )
        return self

    @model_validator(mode="after")
    def _possible(self) -> RLConfig:
        a, t, s, p = self.algorithm, self.train, self.sampling, self.placement
        refuse_quantized_layout(self.engine, self.model, "rl")
        refuse_master_weights_off(self.engine, self.optim)
        if self.uses_critic:
            refuse_master_weights_off(self.engine, self.critic.optim, "critic.optim.master_weights")
        for field in ("tensor_parallel_size", "sequence_parallel_size"):
            size = getattr(self.engine, field)
            if size == 1:
                continue
            if p.policy_workers % size:
                raise ValueError(f"engine.{field} ({size}) must divide placement.policy_workers ({p.policy_workers})")
            if field == "tensor_parallel_size" and self.engine.backend == "deepspeed" and self.model.lora.rank > 0:
                raise ValueError(LORA_AUTOTP)
            if self.uses_critic and p.critic_workers % size:
                raise ValueError(f"engine.{field} ({size}) must divide placement.critic_workers ({p.critic_workers})")
        copies = self.engine.tensor_parallel_size * self.engine.sequence_parallel_size  # ranks sharing a shard
        for role, workers in (("policy", p.policy_workers), ("critic", p.critic_workers if self.uses_critic else 0)):
            if workers % copies:  # each size alone divides (above), their product may not
                raise ValueError(
                    f"engine.tensor_parallel_size x engine.sequence_parallel_size ({copies}) must divide "
                    f"placement.{role}_workers ({workers})"
                )
        if self.reward is None and not self.agent.enabled:
            raise ValueError(
                "reward: required (the reward sources), unless agent.env or agent.client gives the rewards"
            )
        if self.rollout.lora_sync == "merged" and self.model.lora.rank == 0:
            raise ValueError("rollout.lora_sync: merged needs a LoRA policy (model.lora.rank > 0); remove it")
        if self.rollout.lora_sync == "adapter":
            if self.model.lora.rank == 0:
                raise ValueError("rollout.lora_sync: adapter needs a LoRA policy (model.lora.rank > 0)")
            if self.rollout.engine != "vllm":
                raise ValueError(
                    "rollout.lora_sync: adapter needs rollout.engine: vllm (the hf engine takes merged weights); "
                    "use rollout.lora_sync: merged"
                )
        if self.syncs_adapters and self.model.lora.rank > MAX_ENGINE_LORA_RANK:
            raise ValueError(
                f"model.lora.rank {self.model.lora.rank}: vLLM serves adapters up to rank {MAX_ENGINE_LORA_RANK}; "
                "use rollout.lora_sync: merged"
            )
        if a.estimator_needs("needs_groups") and s.n < 2:
            raise ValueError(
                f"algorithm.advantage '{a.advantage}' compares samples of a prompt: "
                f"sampling.n must be at least 2 (got {s.n})"
            )
        if self.critic.path is not None and not self.uses_critic:
            raise ValueError(
                f"critic.path is set but algorithm.advantage '{a.advantage}' uses no critic "
                "(only gae does); remove critic.path or use the ppo preset"
            )
        if self.critic.set_away_from_default(["optim"]) and not self.uses_critic:
            raise ValueError(
                f"critic.optim is set but algorithm.advantage '{a.advantage}' uses no critic "
                "(only gae does); remove critic.optim or use the ppo preset"
            )
        for field, optim in (("optim", self.optim), ("critic.optim", self.critic.optim if self.uses_critic else None)):
            if optim is not None and optim.warmup_steps > self.optimizer_steps:
                raise ValueError(
                    f"{field}.warmup_steps ({optim.warmup_steps}) exceeds the run's optimizer steps, "
                    f"train.max_steps x train.mini_batches x train.ppo_epochs = {self.optimizer_steps}"
                )
        samples = t.prompts_per_step * s.n
        if samples % t.mini_batches:
            raise ValueError(
                f"train.prompts_per_step x sampling.n ({samples}) must be divisible by "
                f"train.mini_batches ({t.mini_batches})"
            )
        if (samples // t.mini_batches) % p.policy_workers:
            raise ValueError(
                f"each mini-batch ({samples // t.mini_batches} samples) must split evenly over "
                f"placement.policy_workers ({p.policy_workers})"
            )
        # Every rank of a role must get the same number of samples, or a shard can be too small for the
        # number of micro-batches its peers need (see raylign.rl.experience.micro_batches_for_ranks).
        if self.uses_critic and (samples // t.mini_batches) % p.critic_workers:
            raise ValueError(
                f"each mini-batch ({samples // t.mini_batches} samples) must split evenly over "
                f"placement.critic_workers ({p.critic_workers})"
            )
        if "reference" in self.worker_roles and samples % p.reference_workers:
            raise ValueError(
                f"train.prompts_per_step x sampling.n ({samples}) must split evenly over "
                f"placement.reference_workers ({p.reference_workers})"
            )
        if a.overlong_buffer > 0 and self.agent.enabled:
            raise ValueError(
                f"algorithm.overlong_buffer ({a.overlong_buffer}) measures one response against "
                "sampling.max_new_tokens, but an agent episode's policy tokens span several turns, each with that "
                "limit: set algorithm.overlong_buffer 0 (the dapo preset sets 16)"
            )
        if a.overlong_buffer > s.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({a.overlong_buffer}) must not exceed "
                f"sampling.max_new_tokens ({s.max_new_tokens}): the penalty zone ends at the limit"
            )
        if self.agent.enabled and t.micro_batch_tokens < self.agent.max_total_tokens:
            raise ValueError(
                f"train.micro_batch_tokens ({t.micro_batch_tokens}) must hold a whole episode: at least "
                f"agent.max_total_tokens ({self.agent.max_total_tokens})"
            )
        longest = self.data.max_prompt_length + s.max_new_tokens
        if not self.agent.enabled and t.micro_batch_tokens < longest:
            raise ValueError(
                f"train.micro_batch_tokens ({t.micro_batch_tokens}) must hold the longest sample: "
                f"data.max_prompt_length + sampling.max_new_tokens = {longest}"
            )
        if p.ray_address is None and p.num_cpus is not None and p.num_cpus < self.ray_cpus_needed:
            raise ValueError(
                f"placement.num_cpus ({p.num_cpus}) is below the {self.ray_cpus_needed:g} CPU slots the "
                "run's actors reserve (training workers x placement.cpus_per_worker + rollout.num_engines "
                "x rollout.num_cpus_per_engine + reward-model actors); they would wait for CPUs forever"
            )
        if a.dynamic_sampling and s.n < 2:
            raise ValueError(
                "algorithm.dynamic_sampling drops groups whose rewards are all equal: sampling.n must "
                f"be at least 2 (got {s.n}), or every group is dropped"
            )
        if self.rollout.engine == "hf" and self.rollout.tensor_parallel_size != 1:
            raise ValueError("rollout.tensor_parallel_size must be 1 with the hf engine")
        if p.colocate and self.rollout.num_engines not in (1, p.policy_workers):
            raise ValueError(
                f"placement.colocate runs one rollout engine in each policy worker: rollout.num_engines "
                f"({self.rollout.num_engines}) must be 1 or placement.policy_workers ({p.policy_workers})"
            )
        several = {
            f"placement.{role}_workers": n for role, n in self.worker_roles.items() if n > 1 and role != "reference"
        }  # reference replicas are independent processes
        if self.engine.backend == "local" and several:
            names = ", ".join(f"{k}={v}" for k, v in several.items())
            raise ValueError(
                f"engine.backend 'local' trains in one process, but {names}: use engine.backend "
                "'fsdp2' or 'deepspeed' for data-parallel training ranks"
            )
        r = self.rollout
        if t.async_rollout is not None:
            raise ValueError(
                "train.async_rollout is replaced by rollout.max_staleness: use rollout.max_staleness: 1 "
                "for what async_rollout: true did (0, the default, is synchronous)"
            )
        if r.max_staleness > 0 and p.colocate:
            raise ValueError(
                f"rollout.max_staleness {r.max_staleness} overlaps generation with training: it needs "
                "engines apart from the trainers (placement.colocate: false)"
            )
        if r.max_staleness > 1 and a.off_policy == "none":
            raise ValueError(
                f"rollout.max_staleness {r.max_staleness}: samples up to {r.max_staleness} updates old "
                "make the engine's log-probs a poor stand-in for the policy of the PPO ratio; set "
                "algorithm.off_policy to truncated_is (decoupled PPO: the ratio against the policy "
                "recomputed by the trainer, the behaviour weights truncated) or ratio_mask"
            )
        if r.partial_rollouts and r.max_staleness == 0:
            raise ValueError(
                "rollout.partial_rollouts continues sequences under newer weights: it needs rollout.max_staleness >= 1"
            )
        # Read only by asynchronous runs: a synchronous step waits for all of its groups, each generated by the
        # weights being trained, so none is ever past the bound and the steps hold their groups in start order.
        async_only = {
            "stale_samples": f"rollout.stale_samples: {r.stale_samples} acts on groups past rollout.max_staleness, "
            "which a synchronous run (max_staleness 0) never has",
            "reproducible": "rollout.reproducible orders the groups of asynchronous runs; a synchronous run "
            "(max_staleness 0) already repeats exactly with sampling.seed",
        }
        for field in r.set_away_from_default(async_only) if r.max_staleness == 0 else []:
            raise ValueError(f"{async_only[field]}: remove it or set rollout.max_staleness >= 1")
        if p.reference_with_policy is True:
            e = self.engine
            conflicts = {
                "placement.colocate": p.colocate,
                "engine.tensor_parallel_size or engine.sequence_parallel_size above 1": (
                    e.tensor_parallel_size * e.sequence_parallel_size > 1
                ),
                "train.early_reference: true (the reference computes beside the engines)": (
                    self.train.early_reference is True
                ),
                "placement.reference_workers above 1 (the policy's ranks host it)": p.reference_workers > 1,
            }
            for why, present in conflicts.items():
                if present:
                    raise ValueError(
                        f"placement.reference_with_policy: true cannot host the reference with the policy "
                        f"under {why}; use false or auto"
                    )
        if p.colocate and max(self.worker_roles.values()) > p.policy_workers:
            raise ValueError(
                "placement.colocate puts rank r of every model beside policy rank r: "
                "placement.reference_workers and placement.critic_workers must not exceed "
                f"placement.policy_workers ({p.policy_workers})"
            )
        if p.colocate and self.rollout.tensor_parallel_size != 1:
            raise ValueError(
                "placement.colocate hands weights to the engine in the policy worker's process: "
                f"rollout.tensor_parallel_size must be 1 (got {self.rollout.tensor_parallel_size})"
            )
        if a.mask_low >= a.mask_high:
            raise ValueError(f"algorithm.mask_low ({a.mask_low}) must be below algorithm.mask_high ({a.mask_high})")
        return self
