"""Score models (a reward model, the RL critic) loaded shard by shard with fsdp2: 2 ranks, against loading
whole. From a saved score model every weight, head included, is the stored one; from a plain causal LM
the backbone is the stored one and the fresh head is the one :func:`init_score_head`'s distribution
gives from the run's seed, drawn alike on every rank."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.model import ModelConfig
from raylign.models import load_score_model
from raylign.models.tiny import build_tiny_model
from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "score_sharded_worker")

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score_sharded")
    causal = build_tiny_model(tmp / "lm", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, seed=3)
    torch.manual_seed(5)
    saved = load_score_model(ModelConfig(path=str(causal), dtype="float32"), num_labels=1)
    saved.save_pretrained(tmp / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp / "rm" / name).write_bytes((causal / name).read_bytes())
    folders = {"rm": str(tmp / "rm"), "lm": str(causal)}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(worker.run_rank, (folders, str(tmp)), worker.WORLD_SIZE, 300, "ranks")
    return folders, torch.load(tmp / "results.pt", weights_only=False)


def test_a_saved_score_model_loads_shard_by_shard_as_it_loads_whole(results):
    folders, runs = results
    stored = load_file(Path(folders["rm"]) / "model.safetensors")
    whole, sharded = runs[("rm", False)], runs[("rm", True)]
    assert set(sharded["weights"]) == set(stored) and "score.weight" in stored
    for name, value in stored.items():
        assert torch.equal(sharded["weights"][name], value), name
        assert torch.equal(whole["weights"][name], value), name
    assert sharded["loss"] == whole["loss"] and sharded["grad_norm"] == whole["grad_norm"]


def test_from_a_causal_lm_the_backbone_is_stored_and_the_head_is_drawn_from_the_seed(results):
    folders, runs = results
    stored = load_file(Path(folders["lm"]) / "model.safetensors")
    weights = runs[("lm", True)]["weights"]
    for name, value in weights.items():
        if name != "score.weight":
            assert torch.equal(value, stored[name]), name
    hidden = stored["model.norm.weight"].numel()
    expected = torch.empty(1, hidden).normal_(0.0, 1.0 / math.sqrt(hidden + 1), generator=torch.manual_seed(0))
    assert torch.equal(weights["score.weight"], expected)
    assert torch.equal(runs[("lm", False)]["weights"]["score.weight"], expected)  # loaded whole: the same head
    # The same weights, so the same first step as the model loaded whole (as for the saved score model).
    sharded, whole = runs[("lm", True)], runs[("lm", False)]
    assert math.isfinite(sharded["loss"]) and sharded["grad_norm"] > 0
    assert sharded["loss"] == whole["loss"] and sharded["grad_norm"] == whole["grad_norm"]
