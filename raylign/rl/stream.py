"""Feeding training steps from a stream of prompt groups, within a strict staleness bound.

The engines are kept busy with prompt groups (one request each, see
:class:`raylign.rollout.pool.GroupStream`); finished groups are scored as they arrive and
wait in a buffer; a training step takes ``prompts_per_step`` of them. Every sampled token
carries the version of the weights that sampled it (the number of weight updates the
engine had received). A group enters the step that updates policy version ``v`` only if

    v - min(token versions of the group) <= max_staleness

checked here, where groups enter a step, not by the length of a queue. A group that is too
old is dropped (and counted) or generated again, as configured. A group with a reward that is
NaN or infinite (``reward.non_finite: drop``) is dropped and counted, and another takes its place.

How many groups may be started: the ``q``-th group to be trained on (0-based) goes into step
``q // prompts_per_step``, so once ``t`` groups have been trained on (``t / prompts_per_step``
weight updates), a group started now can only be on time if
``q < t + (max_staleness + 1) * prompts_per_step``; no more are started than that, nor any past
the run's last step. (Counted
from the groups trained, not from the engines' version number, so the bound holds whatever
version the engines started at.) With ``max_staleness: 0`` this is the synchronous loop: one step's groups are started,
all of them finish, the step trains, the weights are synced, the next step's groups start.
A step takes the groups that have finished (a slow group never holds back the others), and
holds them in the order they were started; with ``max_staleness: 0`` it waits for all of its
groups, so with seeded sampling it holds the same samples whatever order they finish in.
``ordered`` (``rollout.reproducible``) makes every step do so: groups enter steps strictly in
the order they were started, and the controller lets every group in flight finish before a
weight update, so each group is sampled by the weights it was started under and a seeded run
repeats exactly, resumed or not, at the cost of some overlap.

A checkpoint does not wait for the groups in flight: it records which they are (their start
order and prompt position), and a run resumed from it starts them again first, under their own
start order (so seeded sampling draws the same tokens), before any new group. They are counted
(:attr:`StepGroups.restarted`) in the first step after the resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from raylign.data import ResumableSampler
from raylign.rl.experience import Sample, split_by_reward_variance
from raylign.rl.prompts import Prompt
from raylign.rollout.base import Completion
from raylign.rollout.pool import FinishedGroup, GroupStream

# With reward.non_finite: drop, more than this many steps' worth of groups dropped while gathering
# one step stop the run.
MAX_NON_FINITE_PER_STEP = 4


@dataclass
class Group:
    """The samples of one prompt, as they came back from an engine."""

    seq: int  # the order it was started in, over the whole run
    prompt_position: int  # index into the training prompts
    samples: list[Sample]
    started_version: int  # the engines' weight version when it was started
    finished_at: float = 0.0  # when its last sample finished (engine wall clock)
    submitted_at: float = 0.0  # when it was submitted (time.time())

    @property
    def oldest_version(self) -> int:
        return min(
            (v for s in self.samples for v in s.token_versions or [s.weight_version]), default=self.started_version
        )


def generation_seconds(groups: list[Group]) -> float:
    """Seconds during which at least one of ``groups`` was being generated: the union of their
    submitted-to-received intervals. Generation starts before the step waits for it (the next groups
    start as a step's weights are synced, and with rollout.max_staleness k up to k steps ahead), so the
    step's wait (time/generate_s) is shorter than this; in that union the engines may also generate
    other steps' groups."""
    seconds, covered_until = 0.0, -math.inf
    for start, end in sorted((group.submitted_at, group.finished_at) for group in groups):
        if end > covered_until:
            seconds += end - max(start, covered_until)
            covered_until = end
    return seconds


@dataclass
class StepGroups:
    """What :meth:`RolloutFeed.take_step` returns: the step's groups in start order, and counts."""

    groups: list[Group]
    dropped_stale: int = 0
    regenerated_stale: int = 0
    dropped_non_finite: int = 0  # groups with a NaN or infinite reward (reward.non_finite: drop)
    dropped_uniform: int = 0  # groups whose rewards were all equal (dynamic sampling)
    padded_uniform: int = 0  # uniform groups taken anyway, after the refill budget ran out
    in_flight: int = 0  # groups still generating when the step's batch was complete
    # groups in flight at the checkpoint this run resumed from, started again since the previous step
    restarted: int = 0

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


class RolloutFeed:
    """Keeps the engines busy with prompt groups and hands each training step its groups.

    ``positions`` yields training-prompt positions without end (the resumable sampler);
    ``to_samples(completions, prompt, position)`` turns one group's completions into samples and
    ``score(samples)`` sets their rewards. ``uniform(samples)`` tells whether a group's rewards
    are all equal (dynamic sampling drops those; None keeps every group).
    """

    def __init__(
        self,
        stream: GroupStream,
        prompts: list[Prompt],
        positions: Iterator[int],
        sampling: Any,
        per_step: int,
        max_staleness: int,
        stale: Literal["drop", "regenerate"],
        to_samples: Callable[[list, Prompt, int], list[Sample]],
        score: Callable[[list[Sample]], None],
        uniform: Callable[[list[Sample]], bool] | None = None,
        max_uniform_per_step: int = 0,
        ordered: bool = False,
        request: Callable[[Prompt], Any] | None = None,
        max_groups: int | None = None,
    ):
        """``request(prompt)`` is what the stream's ``submit`` gets for a prompt (default: its token ids;
        an :class:`~raylign.rl.episodes.EpisodeStream` takes the prompt itself). ``max_groups``: the
        groups the whole run trains on (max_steps x per_step); none is started that no step would take."""
        self.request = request or _token_ids
        self.stream, self.prompts, self.positions, self.sampling = stream, prompts, positions, sampling
        self.per_step, self.k, self.stale = per_step, max_staleness, stale
        self.to_samples, self.score, self.uniform = to_samples, score, uniform
        self.max_uniform_per_step = max_uniform_per_step
        self.ordered = ordered
        self.max_groups = max_groups
        self.ready: list[Group] = []
        self.started = 0  # groups started over the run
        self.discarded = 0  # of those, groups that will never be trained on
        self.trained = 0  # groups that went into a step
        self.requeued: list[int] = []  # prompt positions to start before new ones (stale, regenerate; resume)
        self.restarting: list[tuple[int, int]] = []  # (seq, position): in flight at the checkpoint resumed from
        self._restarted = 0  # of those, started again since the last step was taken

    # ---- starting groups -------------------------------------------------------------------

    def top_up(self, version: int) -> None:
        """Start groups while they can still be trained on within the bound (module docstring); first
        those in flight at the checkpoint this run resumed from (already counted in ``started``)."""
        while self.restarting:
            self._submit(*self.restarting.pop(0), version)
            self._restarted += 1
        while self._room() > 0:
            self._submit(self.started, self.requeued.pop(0) if self.requeued else next(self.positions), version)
            self.started += 1

    def _room(self) -> int:
        """How many more groups may be started (or taken back from those dropped) within the bound: the
        groups that can still be trained on in time, less those started and not discarded."""
        wanted = self.trained + (self.k + 1) * self.per_step
        if self.max_groups is not None:
            wanted = min(wanted, self.max_groups)
        return wanted - (self.started - self.discarded)

    def _submit(self, seq: int, position: int, version: int) -> None:
        """Start group ``seq`` (its start order numbers its requests, so seeds follow it) of ``position``."""
        self.stream.submit(self.request(self.prompts[position]), self.sampling, seq, (seq, position, version))

    # ---- taking a step ---------------------------------------------------------------------

    def take_step(self, version: int) -> StepGroups:
        """The next ``per_step`` groups that may update policy ``version``; waits for them as needed."""
        step = StepGroups([])
        uniform: list[Group] = []
        budget_spent = False
        while len(step.groups) < self.per_step:
            self.ready.sort(key=_seq)
            while self.ready and len(step.groups) < self.per_step and self._may_take(self.ready[0]):
                self._admit(self.ready.pop(0), version, step, uniform)
            if uniform and (budget_spent or len(uniform) > self.max_uniform_per_step):
                # The refill budget is spent: uniform groups count towards the step from now on (the
                # first dropped first), and none is replaced; the step still waits for the rest. Only as
                # many as the bound has room for: the replacements already started for them stay this
                # step's (with max_staleness 0 none may be left generating across the weight update).
                budget_spent = True
                take = uniform[: min(self.per_step - len(step.groups), max(self._room(), 0))]
                del uniform[: len(take)]
                step.groups += take
                step.padded_uniform += len(take)
                step.dropped_uniform -= len(take)
                self.discarded -= len(take)
            if len(step.groups) == self.per_step:
                break
            self.top_up(version)  # replaces the groups that were dropped
            self._receive(self.stream.finished(), version)
        step.groups.sort(key=_seq)
        self.trained += len(step.groups)
        step.in_flight = len(self.stream)
        step.restarted, self._restarted = self._restarted, 0
        return step

    def _may_take(self, group: Group) -> bool:
        """Ordered: only once every group started before it has come back."""
        return not self.ordered or group.seq < min((tag[0] for tag in self.stream.tags()), default=math.inf)

    def _receive(self, finished: list[FinishedGroup], version: int) -> None:
        for f in finished:
            seq, position, started_version = f.tag
            samples = self.to_samples(f.completions, self.prompts[position], position)
            self.score(samples)
            # When the engine finished it, not when this loop took it back (possibly a training phase later).
            finished_at = max((c.finished_at for c in f.completions if c.finished_at), default=f.finished_at)
            self.ready.append(Group(seq, position, samples, started_version, finished_at, f.submitted_at))

    def _admit(self, group: Group, version: int, step: StepGroups, uniform: list[Group]) -> None:
        if version - group.oldest_version > self.k:
            self.discarded += 1
            if self.stale == "regenerate":
                self.requeued.append(group.prompt_position)
                step.regenerated_stale += 1
            else:
                step.dropped_stale += 1
            return
        if not all(math.isfinite(s.reward) for s in group.samples):
            self.discarded += 1
            step.dropped_non_finite += 1
            if step.dropped_non_finite > MAX_NON_FINITE_PER_STEP * self.per_step:
                text = self.prompts[group.prompt_position].text
                raise RuntimeError(
                    f"reward: {step.dropped_non_finite} prompt groups had a NaN or infinite "
                    f"reward while gathering one step of {self.per_step} (the last for training prompt "
                    f"{group.prompt_position}, {text[:80]!r}); the reward source looks broken"
                )
            return
        if self.uniform is not None and self.uniform(group.samples):
            self.discarded += 1
            step.dropped_uniform += 1
            uniform.append(group)
            return
        step.groups.append(group)

    def drain(self, version: int) -> None:
        """Wait for every group in flight (into the buffer)."""
        self._receive(self.stream.drain(), version)

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly: the groups that came back and wait for a step, and which
        groups are in flight (``(seq, position)``; a resumed run starts them again, see :meth:`top_up`)."""
        in_flight = sorted((seq, position) for seq, position, _ in self.stream.tags())
        return {
            "ready": list(self.ready),
            "in_flight": [*self.restarting, *in_flight],  # restarting: resumed, not started again yet
            "started": self.started,
            "discarded": self.discarded,
            "trained": self.trained,
            "requeued": list(self.requeued),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before the first :meth:`top_up`; the groups that were in flight are started again there."""
        self.ready, self.requeued = list(state["ready"]), list(state["requeued"])
        self.started, self.discarded, self.trained = state["started"], state["discarded"], state["trained"]
        # A checkpoint written before in-flight groups were recorded had drained them: none.
        self.restarting = [(int(seq), int(position)) for seq, position in state.get("in_flight", [])]


class PromptPositions:
    """Training-prompt positions without end, batch after batch of the resumable sampler; the
    rest of the batch last drawn is :meth:`buffered` (a checkpoint keeps it)."""

    def __init__(self, sampler: ResumableSampler):
        self.sampler = sampler
        self._batches = iter(())
        self._rest: list[int] = []

    def __iter__(self) -> PromptPositions:
        return self

    def __next__(self) -> int:
        if not self._rest:
            batch = next(self._batches, None)
            if batch is None:
                self._batches = iter(self.sampler)
                batch = next(self._batches)
            self._rest = list(batch)
        return self._rest.pop(0)

    def state_dict(self) -> dict[str, Any]:
        return {"rest": list(self._rest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the sampler's own state is restored: the rest of the batch drawn before the checkpoint."""
        self._rest = list(state["rest"])


def sample_from(c: Completion, prompt: Prompt) -> Sample:
    """The sample an engine's completion ``c`` of ``prompt`` makes."""
    return Sample(
        c.prompt_token_ids,
        c.response_token_ids,
        c.response_logprobs,
        prompt.text,
        c.text,
        prompt.label,
        prompt.source,
        c.finish_reason,
        weight_version=c.weight_version,
        token_versions=list(c.token_versions),
        metadata=prompt.metadata,
    )


def uniform_rewards(samples: list[Sample]) -> bool:
    """Whether a group's rewards are all equal (its group advantages would all be 0)."""
    kept, _ = split_by_reward_variance(samples, len(samples))
    return not kept


def _token_ids(prompt: Prompt) -> list[int]:
    return prompt.token_ids


def _seq(group: Group) -> int:
    return group.seq
