"""DPO, reward models, process reward models and KTO with sequence parallelism: every micro-batch packed
into one row split over 2 gloo ranks trains exactly like whole sequences.

Two runs of each command on the same data and seed: ``engine.sequence_parallel_size`` 2 on 2 ranks
(both ranks share every micro-batch, one half of its row each, with ring attention between them; each
sequence's log-prob sum, or a reward model's score at its last token, is all-reduced from the halves),
and whole sequences: for DPO and the reward models on 2
data-parallel ranks, each holding half the batch; for KTO on one process holding the same micro-batches
(KTO's reference point is estimated within a micro-batch, so it depends on which examples share one).
The losses, the commands' own metrics (log-prob sums and margins; KTO's reference point and signed
rewards; the reward model's accuracy), gradient norms, the evaluation loss, the reward model's score
statistics stored at export, and the final weights agree. DPO runs with a live
reference model, which is split the same way; KTO with its reference point estimated from mismatched
pairs, which are packed and split too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.base import ConfigError, parse_config
from raylign.config.kto import KTOConfig
from raylign.trainers.kto import KTOTrainer
from raylign.trainers.metrics import read_metrics
from tests.spawned_ranks import import_worker, spawn_and_join

from .test_dpo import all_a_pairs, write_jsonl
from .test_kto import letters_row
from .test_prm import SEP, arithmetic_chain

worker = import_worker(__file__, "preference_sequence_parallel_worker")

CHECKED = {
    "dpo": ["loss", "grad_norm", "logps_chosen", "logps_rejected", "logps_margin"],
    "rm": ["loss", "grad_norm", "accuracy"],
    "prm": ["loss", "grad_norm", "step_accuracy"],
    "kto": ["loss", "grad_norm", "kl", "reward_signed"],
}


def uneven_pairs(num_rows: int, seed: int) -> list[dict]:
    """all_a_pairs with a longer rejected reply: with equal lengths every packed row is cut between two
    sequences, and a split that attended only within its own half would go unnoticed."""
    return [{**row, "rejected": row["rejected"] + " h h"} for row in all_a_pairs(num_rows, seed)]


def uneven_kto_rows(rng: random.Random, num_rows: int) -> list[dict]:
    """letters_row with completions of 1 to 4 letters, for the same reason."""
    rows = [letters_row(rng, i % 3 != 0) for i in range(num_rows)]
    return [{**row, "completion": " ".join(row["completion"].split()[: rng.randint(1, 3)] * 2)} for row in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> Path:
    tmp = tmp_path_factory.mktemp("preference_sp")
    pairs = write_jsonl(tmp / "pairs.jsonl", uneven_pairs(12, seed=5))
    rng = random.Random(7)
    kto_rows = write_jsonl(tmp / "kto.jsonl", uneven_kto_rows(rng, 24))
    chains = [arithmetic_chain(rng) for _ in range(24)]
    soft = [{**chain, "labels": [0.9 if ok else 0.2 for ok in chain["labels"]]} for chain in chains]
    chain_file = write_jsonl(tmp / "chains.jsonl", soft)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        args = (str(tiny_model_dir), str(pairs), str(kto_rows), str(chain_file), SEP, str(tmp))
        spawn_and_join(worker.run_rank, args, worker.WORLD_SIZE, 600, "DPO and KTO ranks")
    KTOTrainer(worker.kto_config(str(tiny_model_dir), str(kto_rows), tmp / "kto_sp1", 1)).run()
    return tmp


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("command", ["dpo", "rm", "prm", "kto"])
def test_rows_split_over_two_ranks_train_like_whole_sequences(runs, command):
    whole, split = ([r for r in read_metrics(runs / f"{command}_sp{n}") if "train/loss" in r] for n in (1, 2))
    assert [r["step"] for r in whole] == [r["step"] for r in split] == list(range(1, worker.STEPS + 1))
    for a, b in zip(whole, split, strict=True):
        for key in (f"train/{name}" for name in CHECKED[command]):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key, a[key], b[key])
    assert whole[0]["train/loss"] != whole[-1]["train/loss"]  # it trained
    if command in ("dpo", "rm"):
        (eval_whole,), (eval_split,) = (
            [r for r in read_metrics(runs / f"{command}_sp{n}") if "eval/loss" in r] for n in (1, 2)
        )
        assert eval_split["eval/loss"] == pytest.approx(eval_whole["eval/loss"], rel=1e-5, abs=1e-5)
    if command == "rm":
        stored = [json.loads((runs / f"rm_sp{n}" / "final" / "config.json").read_text()) for n in (1, 2)]
        for key in ("raylign_reward_mean", "raylign_reward_std"):
            assert stored[1][key] == pytest.approx(stored[0][key], rel=1e-5, abs=1e-6), key
    weights_whole = load_file(runs / f"{command}_sp1" / "final" / "model.safetensors")
    weights_split = load_file(runs / f"{command}_sp2" / "final" / "model.safetensors")
    for name, value in weights_whole.items():
        torch.testing.assert_close(weights_split[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_kto_with_sequence_parallelism_needs_packed_rows():
    config = {
        "model": {"path": "m"},
        "data": {"train": ["t.jsonl"], "packing": False},
        "engine": {"backend": "fsdp2", "sequence_parallel_size": 2},
    }
    with pytest.raises(ConfigError, match="data.packing must be true"):
        parse_config(KTOConfig, config)
