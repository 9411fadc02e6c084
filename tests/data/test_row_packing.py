"""Row packing for the offline trainers: the row layout, and losses equal to those of padded batches.

Every trainer that packs (SFT, KD, DPO, KTO, PRM) computes its per-sample terms from a batch of
several rows, each holding samples back to back and right padding; they must equal the terms of
the same samples in a padded batch, one sample per row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from raylign.config.kd import KDSection
from raylign.config.model import ModelConfig
from raylign.data import collate_packed, collate_padded
from raylign.data.kto import KTOSample, collate_kto
from raylign.data.preference import PairSample, collate_pairs
from raylign.data.prm import PRMSample, collate_prm
from raylign.models import load_score_model, token_logprobs, token_scores
from raylign.trainers.dpo import sequence_logps
from raylign.trainers.kd import KDTrainer
from raylign.trainers.kto import completion_logps
from raylign.trainers.prm import NUM_CLASSES, PRMTrainer
from raylign.trainers.sft import SFTTrainer

LENGTHS = [7, 12, 4, 9, 3]
PAD_ID = 0
ATOL = 1e-5


@dataclass
class Seq:
    input_ids: list[int]
    loss_mask: list[int]


def _ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(length)]


@pytest.fixture(scope="module")
def sequences() -> list[Seq]:
    rng = random.Random(0)
    return [Seq(_ids(n, rng), [0, 0] + [1] * (n - 2)) for n in LENGTHS]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _spans(batch: dict[str, torch.Tensor]) -> list[slice]:
    return [slice(a, a + n) for a, n in zip(batch["seq_starts"].tolist(), batch["seq_lens"].tolist(), strict=True)]


# --- layout ---------------------------------------------------------------------------------


def test_rows_are_as_long_as_the_longest_sample_by_default(sequences):
    # Capacity 12: 12 -> A (full), 9 -> B (3 left), 7 -> C (5 left), 4 -> C (1 left), 3 -> B (full).
    # Rows by first sample: C = [0, 2] (11 tokens + 1 pad), A = [1], B = [3, 4].
    batch = collate_packed(sequences, PAD_ID)
    assert batch["input_ids"].shape == (3, 12)
    assert batch["seq_starts"].tolist() == [0, 12, 7, 24, 33]
    assert batch["input_ids"][0].tolist() == sequences[0].input_ids + sequences[2].input_ids + [PAD_ID]
    assert batch["position_ids"][0].tolist() == list(range(7)) + list(range(4)) + [0]
    assert batch["loss_mask"][0, 11] == 0


def test_a_row_budget_above_the_longest_sample_fills_fewer_longer_rows(sequences):
    # Capacity 20: 12 -> A (8 left), 9 -> B (11 left), 7 -> A (1 left), 4 -> B (7 left), 3 -> B (4 left).
    # Rows: A = [0, 1] (19 tokens), B = [2, 3, 4] (16 tokens + 3 pad); length 19.
    batch = collate_packed(sequences, PAD_ID, row_tokens=20)
    assert batch["input_ids"].shape == (2, 19)
    assert batch["seq_starts"].tolist() == [0, 7, 19, 23, 32]
    assert batch["loss_mask"][1, 16:].tolist() == [0, 0, 0]
    assert batch["loss_mask"].sum() == sum(n - 2 for n in LENGTHS)


# --- SFT and KD ------------------------------------------------------------------------------


def _per_sample_mean_nll(logprobs: torch.Tensor, loss_mask: torch.Tensor, rows: list) -> list[float]:
    flat_logprobs, flat_mask = logprobs.flatten(), loss_mask.flatten().float()
    return [float(-(flat_logprobs[r] * flat_mask[r]).sum() / flat_mask[r].sum()) for r in rows]


def test_sft_per_sample_losses_of_packed_rows_equal_padded_ones(lm, sequences):
    packed, padded = collate_packed(sequences, PAD_ID), collate_padded(sequences, PAD_ID)
    width = padded["input_ids"].shape[1]
    with torch.no_grad():
        packed_lp = token_logprobs(lm, packed["input_ids"], position_ids=packed["position_ids"])
        padded_lp = token_logprobs(lm, padded["input_ids"], attention_mask=padded["attention_mask"])
        sft = SFTTrainer.__new__(SFTTrainer)
        packed_sum, padded_sum = sft.compute_loss(lm, packed)[0], sft.compute_loss(lm, padded)[0]
    padded_rows = [slice(i * width, i * width + n) for i, n in enumerate(LENGTHS)]
    expected = _per_sample_mean_nll(padded_lp, padded["loss_mask"], padded_rows)
    assert _per_sample_mean_nll(packed_lp, packed["loss_mask"], _spans(packed)) == pytest.approx(expected, abs=ATOL)
    targets = sum(n - 2 for n in LENGTHS)
    assert sft.batch_units(packed) == sft.batch_units(padded) == targets
    assert float(packed_sum) / targets == pytest.approx(float(padded_sum) / targets, abs=ATOL)  # per-token mean


def test_kd_loss_of_packed_rows_equals_the_sum_of_each_sample_alone(lm, tiny_model_dir, sequences):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    kd = KDTrainer.__new__(KDTrainer)
    kd.cfg, kd.teacher, kd.vocab_size = SimpleNamespace(kd=KDSection(nll_coef=0.5)), teacher, 512
    with torch.no_grad():
        packed_loss, packed_stats = kd.compute_loss(lm, collate_packed(sequences, PAD_ID))
        alone = [kd.compute_loss(lm, collate_padded([s], PAD_ID)) for s in sequences]
    # The divergence and the NLL are sums over target tokens, so each sample adds its own share;
    # compared per target token.
    targets = sum(n - 2 for n in LENGTHS)
    assert float(packed_loss) / targets == pytest.approx(sum(float(loss) for loss, _ in alone) / targets, abs=ATOL)
    for name in ("divergence", "nll"):
        assert packed_stats[name] / targets == pytest.approx(sum(s[name] for _, s in alone) / targets, abs=ATOL)


# --- DPO and KTO -----------------------------------------------------------------------------


def test_dpo_sequence_logprobs_of_packed_rows_equal_padded_ones(lm):
    rng = random.Random(1)
    pairs = [
        PairSample(_ids(p, rng), _ids(c, rng), [1] * c, _ids(r, rng), [1] * r, "mem", i)
        for i, (p, c, r) in enumerate([(3, 5, 2), (6, 1, 4), (2, 3, 8)])
    ]
    packed = collate_pairs(pairs, PAD_ID, packed=True)
    assert packed["input_ids"].shape[0] > 1
    with torch.no_grad():
        got = sequence_logps(lm, packed)
        expected = sequence_logps(lm, collate_pairs(pairs, PAD_ID, packed=False))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_kto_completion_logprobs_of_packed_rows_equal_padded_ones(lm, sequences):
    samples = [KTOSample(s.input_ids, s.loss_mask, i % 2 == 0, "mem", i) for i, s in enumerate(sequences)]
    packed = collate_kto(samples, PAD_ID, packing=True, with_kl_pairs=True, max_length=64)
    padded = collate_kto(samples, PAD_ID, packing=False, with_kl_pairs=True, max_length=64)
    with torch.no_grad():
        for prefix in ("", "kl_"):
            got, expected = completion_logps(lm, packed, prefix), completion_logps(lm, padded, prefix)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# --- PRM -------------------------------------------------------------------------------------


def test_prm_per_step_losses_of_packed_rows_equal_padded_ones(tiny_model_dir, sequences):
    model = load_score_model(ModelConfig(path=str(tiny_model_dir), dtype="float32"), num_labels=NUM_CLASSES).eval()
    samples = []
    for i, s in enumerate(sequences):
        steps = [0] * len(s.input_ids)
        steps[2::3] = [1] * len(steps[2::3])  # a step ends at tokens 2, 5, 8, 11
        samples.append(PRMSample(s.input_ids, steps, [float(k % 2) for k in range(sum(steps))], "mem", i))
    batches = [collate_prm(samples, PAD_ID, packing, soft_labels=False) for packing in (True, False)]
    step_losses = []
    with torch.no_grad():
        for batch in batches:
            logits = token_scores(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
            per_token = F.cross_entropy(logits.flatten(0, 1), batch["step_labels"].flatten(), reduction="none")
            at_steps = batch["loss_mask"].flatten().bool()
            width = logits.shape[1]
            spans = (
                _spans(batch)
                if "seq_starts" in batch
                else [slice(i * width, i * width + n) for i, n in enumerate(LENGTHS)]
            )
            step_losses.append([per_token[s][at_steps[s]].tolist() for s in spans])
        prm = PRMTrainer.__new__(PRMTrainer)
        totals = [float(prm.compute_loss(model, batch)[0]) for batch in batches]
    packed_steps, padded_steps = step_losses
    assert [len(s) for s in packed_steps] == [2, 4, 1, 3, 1]
    for got, expected in zip(packed_steps, padded_steps, strict=True):
        assert got == pytest.approx(expected, abs=ATOL)
    assert totals[0] == pytest.approx(totals[1], abs=ATOL)
