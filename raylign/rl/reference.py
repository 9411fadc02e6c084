"""Reference log-probs of each prompt group computed as soon as it is scored, while other groups still generate.

The reference is frozen, so its log-probs of a sample do not depend on when they are computed: the
reference workers can take each finished group at once (on one thread per rank, beside the
engines that are still generating) instead of the whole batch after the last group came back,
which leaves the experience phase only the policy's and critic's passes. A group's pass is packed
and sharded over the reference ranks as a step's would be, and every rank runs the same number of
micro-batches, so a sharded reference's collective forward works too: a group can have fewer samples
than there are ranks, or a rank fewer samples than its peers need micro-batches, so a rank short of
samples runs a stand-in (the group's shortest sample) whose result it drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from raylign.rl.experience import Sample, own_micro_batches, pack_samples

if TYPE_CHECKING:
    from raylign.rl.group import PhaseResults


@dataclass
class _Pass:
    """One group's reference pass in flight: its samples, which rank and micro-batch holds each, the calls."""

    samples: list[Sample]
    plan: list[list[list[int]]]  # per rank, per micro-batch: positions in ``samples``
    real: list[int]  # per rank: its micro-batches of its own samples; those after them are stand-ins
    calls: list[Any]
    step: int  # the controller's step count when it started


class EarlyReference:
    """Starts the reference pass of each scored group (:meth:`submit`) and hands a step the log-probs
    of its samples (:meth:`collect`). ``group``: the reference :class:`~raylign.rl.group.WorkerGroup`.
    Passes of groups that never reach a step (dropped as stale, uniform or non-finite) are forgotten
    ``keep_steps`` steps after they started."""

    def __init__(
        self,
        group: Any,
        micro_batch_tokens: int,
        pack_row_tokens: int,
        keep_steps: int,
        threads: list[int] | None = None,
    ):
        """``threads``: torch threads of each rank for these passes (None: one each)."""
        self.group, self.micro_batch_tokens, self.rows = group, micro_batch_tokens, pack_row_tokens
        self.keep_steps = keep_steps
        self.threads = threads or [1] * len(group)
        self.answers: list[PhaseResults] = []  # what the ranks reported for each pass :meth:`collect` gathered
        self._passes: dict[int, _Pass] = {}  # id(sample) -> its pass (which holds the sample: ids stay unique)

    def submit(self, samples: list[Sample], step: int) -> None:
        plan, real = plan_with_stand_ins(samples, len(self.group), self.micro_batch_tokens)
        rows = self.rows
        per_rank = [[pack_samples([samples[i] for i in micro], row_tokens=rows) for micro in ranks] for ranks in plan]
        calls = self.group.submit_in_phase("compute_logprobs", per_rank, self.threads)
        started = _Pass(list(samples), plan, real, calls, step)
        for sample in samples:
            self._passes[id(sample)] = started
        self._passes = {k: p for k, p in self._passes.items() if p.step >= step - self.keep_steps}

    def collect(self, samples: list[Sample], width: int) -> torch.Tensor | None:
        """``[len(samples), width]`` reference log-probs, zero past each response, when every sample's
        group was submitted; None otherwise (the caller computes them all). Either way the passes of
        these samples are let go."""
        passes = [self._passes.pop(id(s), None) for s in samples]
        if any(p is None or not any(x is s for x in p.samples) for p, s in zip(passes, samples)):
            return None
        rows: dict[int, torch.Tensor] = {}
        self.answers = []
        for p in {id(p): p for p in passes if p is not None}.values():
            answers = self.group.phase_results("compute_logprobs", p.calls)
            self.answers.append(answers)
            for rank_plan, rank_results, real in zip(p.plan, answers.results, p.real):
                for micro, values in zip(rank_plan[:real], rank_results):
                    for row, i in enumerate(micro):
                        rows[id(p.samples[i])] = values[row]
        out = torch.zeros(len(samples), width)
        for i, sample in enumerate(samples):
            length = len(sample.response_ids)
            out[i, :length] = rows[id(sample)][:length]
        return out


def plan_with_stand_ins(samples: list[Sample], ranks: int, max_tokens: int) -> tuple[list[list[list[int]]], list[int]]:
    """Positions of ``samples`` per rank and micro-batch as a step's pass splits them
    (:func:`~raylign.rl.experience.own_micro_batches`), and per rank how many micro-batches hold its own
    samples. A rank with fewer samples than its peers need micro-batches runs, for each one it lacks, a
    stand-in: the shortest sample, computed again and dropped."""
    own, needed = own_micro_batches(samples, ranks, max_tokens)
    stand_in = min(range(len(samples)), key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].response_ids), i))
    return [micro + [[stand_in]] * (needed - len(micro)) for micro in own], [len(micro) for micro in own]
