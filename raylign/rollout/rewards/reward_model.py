"""Rewards from a trained reward model: a one-label ``AutoModelForSequenceClassification`` folder.

:class:`RewardModelScorer` holds the model in the current process (``raylign serve-rm`` uses it
directly); :class:`RewardModelSource` runs the same scorer in a Ray actor, so the model lives on
its own CPUs or GPU beside the trainer and the rollout engines.

A sample is tokenised as :mod:`raylign.rollout.rewards.rendering` describes (chat template,
already-rendered RL prompts, or plain text). Decoder models (a linear ``score`` head) are read
at the last real token; other architectures pool as their own forward does. With ``normalize``
the score becomes ``(score - mean) / std``, using the statistics ``raylign rm`` stores in the
model's ``config.json`` as ``raylign_reward_mean`` and ``raylign_reward_std``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raylign.files import read_json_object
from raylign.rollout.rewards.base import (
    RewardError,
    RewardResult,
    RewardSource,
    describe_batch,
    describe_sample,
    is_finite_number,
)
from raylign.rollout.rewards.rendering import PROMPT_MESSAGES_KEY, assistant_turn, encode_sample

MEAN_KEY = "raylign_reward_mean"
STD_KEY = "raylign_reward_std"


def read_normalization(model_dir: str | Path) -> tuple[float, float]:
    """(mean, std) stored in ``config.json`` of ``model_dir``; ValueError naming the folder if absent or bad."""
    config_file = Path(model_dir) / "config.json"
    config = read_json_object(config_file)
    if MEAN_KEY not in config or STD_KEY not in config:
        raise ValueError(
            f"{config_file} has no {MEAN_KEY} / {STD_KEY} (raylign rm writes them after training); "
            "set normalize: false to use raw scores"
        )
    mean, std = config[MEAN_KEY], config[STD_KEY]
    # NaN is valid in Python's JSON, and a bool is an int.
    if not (is_finite_number(mean) and is_finite_number(std) and std > 0):
        raise ValueError(
            f"{config_file}: {MEAN_KEY} must be a finite number and {STD_KEY} a positive one, got {mean!r} and {std!r}"
        )
    return float(mean), float(std)


def _check_single_label(model_dir: Path) -> None:
    config = read_json_object(model_dir / "config.json")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 1)
    if labels != 1:
        raise ValueError(f"reward model {model_dir} has {labels} output labels; a reward model needs exactly 1")


def _load_sequence_classifier(folder: Path, dtype: str, device: Any) -> Any:
    """The model with its trained head; ValueError naming the folder if the head is missing."""
    from transformers import AutoModelForSequenceClassification

    from raylign.models.loading import torch_dtype

    model, info = AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch_dtype(dtype), output_loading_info=True
    )
    missing = sorted(info["missing_keys"])
    if missing:
        raise ValueError(
            f"reward model {folder} lacks trained weights for {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}; is it a plain language model rather than a trained reward model?"
        )
    return model.to(device).eval()


class RewardModelScorer:
    """A reward model held in this process. ``score_texts`` returns one float per (prompt, response)."""

    def __init__(
        self,
        model_path: str,
        batch_size: int = 16,
        normalize: bool = True,
        max_length: int | None = None,
        dtype: str = "float32",
    ):
        import torch

        from raylign.models.heads import HEAD_NAME
        from raylign.models.loading import load_tokenizer, resolve_model_path

        folder = resolve_model_path(model_path)
        _check_single_label(folder)
        self.normalization = read_normalization(folder) if normalize else None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(folder, padding_side="right")
        self.turn = assistant_turn(self.tokenizer)
        self.model = _load_sequence_classifier(folder, dtype, self.device)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # Decoder reward models (a linear 'score' head) are read at the last real token, found from
        # the attention mask; others (encoders) pool as their own forward does.
        self.last_token_head = isinstance(getattr(self.model, HEAD_NAME, None), torch.nn.Linear)
        self.batch_size = batch_size
        self.max_length = max_length

    def ready(self) -> bool:
        """True once loaded (lets a caller wait for a remote actor's start-up)."""
        return True

    def _encode(self, prompts: list[str], responses: list[str], prompt_messages: list[Any]) -> list[list[int]]:
        encoded = []
        for i, (prompt, response, messages) in enumerate(zip(prompts, responses, prompt_messages)):
            try:
                ids = encode_sample(self.tokenizer, self.turn, prompt, response, messages)
            except Exception as err:  # a template that rejects the conversation, malformed messages
                raise ValueError(f"{describe_sample(prompts, i)}: {type(err).__name__}: {err}") from None
            if self.max_length is not None and len(ids) > self.max_length:
                # An over-long sample keeps its end; an encoder's classifier also reads its first token
                # ([CLS]), which is kept in front of the end.
                ids = ids[-self.max_length :] if self.last_token_head else ids[:1] + ids[1 - self.max_length :]
            encoded.append(ids)
        return encoded

    def _raw_scores(self, batch: list[list[int]]) -> list[float]:
        import torch

        from raylign.models.heads import sequence_scores

        padded = self.tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        input_ids, attention_mask = padded["input_ids"].to(self.device), padded["attention_mask"].to(self.device)
        with torch.inference_mode():
            if self.last_token_head:
                scores = sequence_scores(self.model, input_ids, attention_mask)
            else:
                scores = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        return scores.float().cpu().tolist()

    def score_texts(
        self, prompts: list[str], responses: list[str], prompt_messages: list[Any] | None = None
    ) -> list[float]:
        """Reward of each (prompt, response): the model's score, normalised when configured.

        ``prompt_messages[i]``, when given and not None, is sample i's prompt as chat messages.
        """
        encoded = self._encode(prompts, responses, prompt_messages or [None] * len(prompts))
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            scores.extend(self._raw_scores(encoded[start : start + self.batch_size]))
        if self.normalization is not None:
            mean, std = self.normalization
            scores = [(s - mean) / std for s in scores]
        return scores


class LocalRewardModel(RewardSource):
    """A reward model in this process, as a reward source (used by ``raylign serve-rm``)."""

    def __init__(self, model_path: str, **scorer_kwargs: Any):
        self.description = f"reward model {model_path}"
        self.scorer = RewardModelScorer(model_path, **scorer_kwargs)

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        return RewardResult(rewards=self.scorer.score_texts(prompts, responses, _prompt_messages(metadata)))


class RewardModelSource(RewardSource):
    """A reward model in a Ray actor (needs ``ray.init`` done); ``num_gpus > 0`` puts it on a GPU."""

    def __init__(
        self,
        model_path: str,
        batch_size: int = 16,
        normalize: bool = True,
        max_length: int | None = None,
        dtype: str = "float32",
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        startup_timeout_s: float = 600.0,
        timeout_s: float = 60.0,
    ):
        import ray

        from raylign.cluster import StartupError, actor_env, wait_until_ready

        self.description = f"reward model {model_path}"
        self.timeout_s = timeout_s
        actor_class = ray.remote(RewardModelScorer).options(
            num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": actor_env()}
        )
        self._actor = actor_class.remote(
            model_path, batch_size=batch_size, normalize=normalize, max_length=max_length, dtype=dtype
        )
        try:
            wait_until_ready(
                {self.description: self._actor}, startup_timeout_s, ready={self.description: self._actor.ready.remote()}
            )
        except StartupError as err:  # the actor's constructor failed: bad folder, missing normalisation, ...
            self.close()
            raise ValueError(f"{self.description} could not be loaded in its Ray actor: {err.cause or err}") from None

    def _score(self, prompts: list[str], responses: list[str], labels: list[Any], metadata: list[dict]) -> RewardResult:
        from raylign.cluster import get_within

        if self._actor is None:
            raise RewardError(f"{self.description}: the source was closed")
        try:
            rewards = get_within(
                self._actor.score_texts.remote(prompts, responses, _prompt_messages(metadata)),
                self.timeout_s,
                f"{self.description} scoring {describe_batch(prompts)}",
                "this source's timeout_s",
                ["its Ray actor"],
            )
        except TimeoutError as err:
            raise RewardError(str(err)) from None
        except Exception as err:
            raise RewardError(f"{self.description} failed on {describe_batch(prompts)}: {_cause(err)}") from None
        return RewardResult(rewards=rewards)

    def close(self) -> None:
        import ray

        if getattr(self, "_actor", None) is not None:
            ray.kill(self._actor)
            self._actor = None


def _prompt_messages(metadata: list[dict]) -> list[Any]:
    return [m.get(PROMPT_MESSAGES_KEY) for m in metadata]


def _cause(err: BaseException) -> str:
    """The original error inside a Ray error, which wraps it in the remote traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    # An actor whose constructor failed carries only text; the traceback's last line is the error.
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
