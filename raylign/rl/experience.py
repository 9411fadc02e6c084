"""Experience: the completions of one RL step and everything computed for them.

Per-token quantities are response-aligned ``[batch, max_response_len]`` tensors with a
``mask``; the algorithm library works on exactly these. For the model forward passes the
samples of a micro-batch are packed into rows (several samples per row, position ids restarting
at each sample), and ``resp_index`` maps each response token to its position in the flattened
``[rows * row_length]`` batch.

Why several short rows rather than one long one: with ``sdpa`` or ``eager`` attention the cost
of a row grows with the square of its length, and a packed row attends over a block-diagonal
mask it still has to evaluate in full. Rows about as long as the longest sample cost close to a
padded batch while wasting almost no tokens on padding.

The controller and the workers exchange typed batches: :class:`Experience` for a whole step,
:class:`MicroBatch` for what one rank runs at a time. Both say explicitly, in ``behaviour``, where
the behaviour log-probs of the policy-gradient ratio come from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from raylign.data import balance_micro_batches, pack_rows

if TYPE_CHECKING:
    from raylign.config.rl import RLConfig


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    prompt_text: str
    response_text: str
    label: Any
    source: str
    finish_reason: str
    reward: float = 0.0
    reward_metrics: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0  # weight updates the engine had received when it generated this sample
    token_versions: list[int] | None = None  # per response token, where they differ (partial rollouts)
    # Agent episodes: 1 at the policy's tokens, 0 at the environment's (None: every response token is trained)
    loss_mask: list[int] | None = None
    # Agent episodes: (response position, reward) of each turn; ``reward`` is their sum
    turn_rewards: list[tuple[int, float]] | None = None
    episode: Any = None  # the raylign.agents.episode.Episode it came from, for the logs
    metadata: dict[str, Any] = field(default_factory=dict)  # the prompt row's other fields, for the rewards


# Where the behaviour log-probs of the ratio pi / pi_behaviour come from:
# * "this_policy": on-policy; the training forward's own log-probs, detached (ratio 1 at the update);
# * "trainer_recomputed": ``old_logprobs``, a policy forward pass over the samples before the update;
# * "engine": ``rollout_logprobs``, the engine's (its weights may be gone: rollout.max_staleness > 0).
Behaviour = Literal["this_policy", "trainer_recomputed", "engine"]
BEHAVIOURS: tuple[str, ...] = get_args(Behaviour)
# The per-token field each behaviour needs: its behaviour log-probs, or for "this_policy" the engine's
# log-probs that the training forward is compared with (the engine-vs-trainer mismatch).
BEHAVIOUR_NEEDS = {
    "this_policy": "rollout_logprobs",
    "trainer_recomputed": "old_logprobs",
    "engine": "rollout_logprobs",
}
# Response-aligned [batch, R] tensors that travel with the samples (besides ``mask``).
PER_TOKEN_FIELDS = ("advantages", "returns", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "versions")


def _check_per_token(owner: Any) -> None:
    """Every per-token field of ``owner`` that is set is ``[b, R]`` like its mask; ``versions`` is int64;
    the behaviour is known and has the field it reads. A ValueError names the field otherwise."""
    kind, mask = type(owner).__name__, owner.mask
    if mask.dim() != 2:
        raise ValueError(f"{kind}.mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    for name in PER_TOKEN_FIELDS:
        tensor = getattr(owner, name)
        if tensor is not None and tuple(tensor.shape) != tuple(mask.shape):
            raise ValueError(
                f"{kind}.{name} must be [batch, response_len] = {tuple(mask.shape)} like the mask, "
                f"got {tuple(tensor.shape)}"
            )
    if owner.versions is not None and owner.versions.dtype != torch.int64:
        raise ValueError(f"{kind}.versions must be int64 weight versions, got {owner.versions.dtype}")
    if owner.behaviour is None:
        return
    if owner.behaviour not in BEHAVIOURS:
        raise ValueError(f"{kind}.behaviour must be one of {BEHAVIOURS}, got {owner.behaviour!r}")
    if getattr(owner, BEHAVIOUR_NEEDS[owner.behaviour]) is None:
        raise ValueError(
            f"{kind}.behaviour {owner.behaviour!r} reads {BEHAVIOUR_NEEDS[owner.behaviour]}, which is not set"
        )


@dataclass
class Experience:
    """One RL step's samples as response-aligned ``[B, R]`` tensors (0 past each response), and the
    metrics of computing them. What the controller splits into :class:`MicroBatch` es."""

    mask: torch.Tensor  # 1 at response tokens
    advantages: torch.Tensor
    returns: torch.Tensor
    rollout_logprobs: torch.Tensor  # the engine's log-probs of the sampled tokens
    versions: torch.Tensor  # int64: the weight version that sampled each token
    behaviour: Behaviour
    old_logprobs: torch.Tensor | None = None  # the policy's before the update ("trainer_recomputed")
    ref_logprobs: torch.Tensor | None = None  # the reference policy's (a KL term)
    values: torch.Tensor | None = None  # the critic's (gae)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_per_token(self)

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The per-token tensors that are set, at sample rows ``indices`` (for :func:`pack_samples`)."""
        return {name: getattr(self, name)[indices] for name in PER_TOKEN_FIELDS if getattr(self, name) is not None}


@dataclass
class MicroBatch:
    """What a worker runs in one forward pass: samples packed into rows (see :func:`pack_samples`)
    and, for an update, their per-token tensors cut to the micro-batch's response width ``R``.

    ``input_ids`` / ``position_ids`` are ``[rows, L]``; ``resp_index``, ``mask`` and the per-token
    tensors ``[b, R]``. ``behaviour`` is None for the forward passes that only compute log-probs
    or values. A plain dataclass of CPU tensors, so it pickles through Ray as it is.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    resp_index: torch.Tensor
    mask: torch.Tensor
    behaviour: Behaviour | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.position_ids.shape != self.input_ids.shape:
            raise ValueError(
                f"MicroBatch.position_ids must be shaped like input_ids {tuple(self.input_ids.shape)}, "
                f"got {tuple(self.position_ids.shape)}"
            )
        if self.resp_index.shape != self.mask.shape:
            raise ValueError(
                f"MicroBatch.resp_index must be [batch, response_len] = {tuple(self.mask.shape)} "
                f"like the mask, got {tuple(self.resp_index.shape)}"
            )
        _check_per_token(self)

    def to(self, device: torch.device | str) -> MicroBatch:
        """This batch with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def behaviour_logprobs(self, logprobs: torch.Tensor) -> torch.Tensor:
        """The behaviour log-probs of the ratio; ``logprobs`` are the training forward's own."""
        if self.behaviour == "this_policy":
            return logprobs.detach()
        if self.behaviour == "trainer_recomputed":
            return self.old_logprobs
        if self.behaviour == "engine":
            return self.rollout_logprobs
        raise ValueError("this MicroBatch is for a forward pass only (behaviour None); an update needs one")


def behaviour_for(cfg: RLConfig) -> Behaviour:
    """Where a run's behaviour log-probs come from, fixed by its config.

    With ``rollout.max_staleness`` above 0 the weights that generated a step's samples may be gone
    when it trains: the engine's log-probs are the behaviour policy, and with an off-policy
    correction the trainer recomputes the policy before the update as the proximal policy of
    the ratio (decoupled PPO). Several updates per rollout batch (epochs, mini-batches) move the
    policy before the later ones, and an off-policy correction compares the trainer with the
    engine: both need the policy's log-probs before the first update. Else the policy has not
    moved since generation and the training forward's own are the behaviour's.
    """
    t, a = cfg.train, cfg.algorithm
    if cfg.rollout.max_staleness > 0 and a.off_policy == "none":
        return "engine"
    if t.ppo_epochs > 1 or t.mini_batches > 1 or a.off_policy != "none":
        return "trainer_recomputed"
    return "this_policy"


def response_tensor(rows: list[list[float]], width: int | None = None) -> torch.Tensor:
    """Right-padded ``[batch, width]`` float tensor of ragged rows."""
    width = width if width is not None else max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def response_mask(samples: list[Sample], width: int | None = None) -> torch.Tensor:
    """``[batch, width]``: 1 at the response tokens that are trained (an episode's policy tokens)."""
    return response_tensor(
        [[1.0] * len(s.response_ids) if s.loss_mask is None else [float(m) for m in s.loss_mask] for s in samples],
        width,
    )


def sample_rewards(samples: list[Sample], width: int, shaped: torch.Tensor) -> torch.Tensor:
    """The rewards the advantage estimators take: ``shaped`` ``[batch]`` outcome rewards; or, when a
    sample has turn rewards (agent episodes), ``[batch, width]`` per-token rewards, each turn's on its
    last policy token, and the shaping (``shaped - reward``) on the last one. Group estimators sum a
    row, so they see the shaped episode total; GAE and REINFORCE see each turn's reward where it came."""
    if all(s.turn_rewards is None for s in samples):
        return shaped
    out = torch.zeros(len(samples), max(width, 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        last = max((t for t, m in enumerate(mask) if m), default=-1)
        if last < 0:
            continue
        for position, reward in s.turn_rewards or [(last, s.reward)]:
            out[i, position] += reward
        out[i, last] += float(shaped[i]) - s.reward
    return out


def token_versions(samples: list[Sample], width: int | None = None) -> torch.Tensor:
    """``[batch, width]`` int64: the weight version that sampled each response token (0 past the end);
    ``Sample.token_versions`` where set, else the sample's ``weight_version`` on all its tokens."""
    width = width if width is not None else max((len(s.response_ids) for s in samples), default=0)
    out = torch.zeros(len(samples), max(width, 1), dtype=torch.int64)
    for i, s in enumerate(samples):
        versions = s.token_versions if s.token_versions is not None else [s.weight_version] * len(s.response_ids)
        if len(versions) != len(s.response_ids):
            raise ValueError(f"sample {i}: {len(versions)} token versions for {len(s.response_ids)} response tokens")
        out[i, : len(versions)] = torch.as_tensor(versions, dtype=torch.int64)
    return out


def pack_samples(
    samples: list[Sample],
    per_token: Mapping[str, torch.Tensor] | None = None,
    row_tokens: int = 0,
    behaviour: Behaviour | None = None,
) -> MicroBatch:
    """One packed micro-batch.

    ``input_ids``/``position_ids`` are ``[rows, L]``: samples placed first-fit into rows of
    ``row_tokens`` tokens (0, or anything below the longest sample: rows as long as the longest
    sample), right-padded with token 0 at positions restarting from 0. ``resp_index`` and
    ``mask`` are ``[b, R]``: ``resp_index`` holds each response token's position in the
    flattened ``[rows * L]`` batch. The given response-aligned tensors (named as the fields of
    :class:`MicroBatch`, one row per sample) are cut to width ``R``.
    """
    per_token = dict(per_token or {})
    unknown = sorted(set(per_token) - set(PER_TOKEN_FIELDS))
    if unknown:
        raise ValueError(f"unknown per-token tensors {unknown}; a MicroBatch carries {list(PER_TOKEN_FIELDS)}")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    layout = pack_rows(lengths, row_tokens)
    row_length = max(sum(lengths[i] for i in row) for row in layout)
    width = max(len(s.response_ids) for s in samples)
    input_ids = torch.zeros(len(layout), row_length, dtype=torch.long)
    position_ids = torch.zeros(len(layout), row_length, dtype=torch.long)
    resp_index = torch.zeros(len(samples), width, dtype=torch.long)
    for r, row in enumerate(layout):
        offset = 0
        for i in row:
            s = samples[i]
            input_ids[r, offset : offset + lengths[i]] = torch.tensor(s.prompt_ids + s.response_ids)
            position_ids[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
            start = r * row_length + offset + len(s.prompt_ids)
            resp_index[i, : len(s.response_ids)] = torch.arange(start, start + len(s.response_ids))
            offset += lengths[i]
        position_ids[r, offset:] = torch.arange(row_length - offset)
    cut = {name: tensor[:, :width].contiguous() for name, tensor in per_token.items()}
    return MicroBatch(input_ids, position_ids, resp_index, response_mask(samples, width), behaviour=behaviour, **cut)


def gather_responses(
    packed: torch.Tensor, resp_index: torch.Tensor, mask: torch.Tensor, shift: int = 0
) -> torch.Tensor:
    """Pick response positions out of a packed ``[rows, L]`` tensor: ``[b, R]``, 0 where masked.
    ``shift=-1`` reads the position before each token (a critic's value of the state; a response
    always follows at least one prompt token of its own row)."""
    index = (resp_index + shift).clamp(min=0)
    return packed.reshape(-1)[index] * mask.to(packed.dtype)


def token_balanced_shards(lengths: list[int], world_size: int) -> list[list[int]]:
    """Sample positions per data-parallel rank: as many samples on every rank (the first
    ``n % world_size`` ranks one more), their token counts balanced.

    Greedy, longest sample first: each goes to the rank with the fewest tokens so far among those
    with room for another sample (the lower rank on a tie). Each shard lists its positions in their
    original order. Which rank holds a sample does not change the update: every loss is normalised
    by the counts of the whole step (:func:`raylign.algorithms.compute_loss_scale`), and advantages
    are computed before the split.
    """
    base, extra = divmod(len(lengths), world_size)
    room = [base + (rank < extra) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        rank = min((r for r in range(world_size) if len(shards[r]) < room[r]), key=lambda r: (tokens[r], r))
        shards[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(shard) for shard in shards]


def micro_batches_for_ranks(samples: list[Sample], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Split sample positions into ``world_size`` token-balanced shards (:func:`token_balanced_shards`),
    then each shard into token-balanced micro-batches; every rank gets the same number of
    micro-batches (collectives need it): a shard with fewer samples than its peers need micro-batches
    is an error (the config's checks keep a step's shards even; :func:`own_micro_batches` is the plan
    that lets a rank come up short)."""
    plan, needed = own_micro_batches(samples, world_size, max_tokens)
    for rank, micro in enumerate(plan):
        if len(micro) < needed:
            raise ValueError(
                f"rank {rank} holds {len(micro)} samples, too few for the {needed} micro-batches its peers need"
            )
    return plan


def own_micro_batches(samples: list[Sample], world_size: int, max_tokens: int) -> tuple[list[list[list[int]]], int]:
    """Positions of ``samples`` per rank (token-balanced shards) and per micro-batch (token-balanced, at
    most ``max_tokens`` each), every rank with as many micro-batches as the rank that needs the most, or
    one per sample where it holds fewer samples than that; and that number."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    shards = token_balanced_shards(lengths, world_size)
    shard_lengths = [[lengths[i] for i in shard] for shard in shards]
    fewest = [balance_micro_batches(lens, max_tokens, min(1, len(lens))) for lens in shard_lengths]
    needed = max(len(plan) for plan in fewest)
    plans = [balance_micro_batches(lens, max_tokens, min(needed, len(lens))) for lens in shard_lengths]
    return [[[shard[j] for j in micro] for micro in plan] for shard, plan in zip(shards, plans)], needed


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward mean and std, response lengths, the truncated fraction and each reward source's mean."""
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    for key in samples[0].reward_metrics:
        metrics[f"reward/{key}"] = sum(s.reward_metrics[key] for s in samples) / len(samples)
    return metrics


def mismatch_metrics(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same tokens."""
    diff = (rollout_lp - trainer_lp) * mask
    counted = mask.sum().clamp(min=1)
    return {
        "mismatch/logprob_abs_diff": float(diff.abs().sum() / counted),
        "mismatch/logprob_max_abs_diff": float(diff.abs().max()),
        "mismatch/kl_k3": float(((torch.exp(-diff) - 1 + diff) * mask).sum() / counted),
    }


def split_by_reward_variance(samples: list[Sample], n: int) -> tuple[list[Sample], list[Sample]]:
    """Groups of ``n`` samples whose rewards differ (kept), and those whose rewards are all equal."""
    from raylign.algorithms import filter_zero_variance_groups

    result = filter_zero_variance_groups(torch.tensor([s.reward for s in samples]), group_size=n)
    keep = set(result.kept_groups.tolist())
    kept, dropped = [], []
    for g in range(len(samples) // n):
        group = samples[g * n : (g + 1) * n]
        (kept if g in keep else dropped).extend(group)
    return kept, dropped
