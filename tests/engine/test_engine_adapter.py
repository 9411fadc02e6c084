"""``TrainEngine.adapter_state_dict``: a LoRA model's adapter weights, gathered whole from the
shards of every backend, under the names PEFT saves them with (what a LoRA weight sync sends); and
``TrainEngine.iter_full_state`` of the same model, merged layer by layer as it streams (what a
merged-weight sync sends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from raylign.config.engine import EngineConfig
from raylign.config.optim import OptimConfig
from raylign.engine import create_engine
from tests.spawned_ranks import import_worker, spawn_and_join

worker = import_worker(__file__, "adapter_worker")


def test_the_local_engine_gives_the_adapter_as_peft_saves_it(tmp_path):
    model = worker.lora_model()
    model.save_pretrained(tmp_path / "peft")  # PEFT's own adapter folder: the names vLLM loads
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    engine = create_engine(worker.lora_model(), EngineConfig(backend="local"), OptimConfig(lr=1e-2), 2)
    weights, config = engine.adapter_state_dict()
    assert sorted(weights) == sorted(saved) and len(saved) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    for name, value in saved.items():
        assert torch.equal(weights[name], value), name
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 8
        and sorted(config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
    )
    assert config["peft_type"] == "LORA"


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_backends_gather_the_same_adapter_on_rank_0_or_every_rank(tmp_path):
    model = worker.lora_model()
    model.save_pretrained(tmp_path / "peft")
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        spawn_and_join(worker.run_rank, (str(tmp_path),), worker.WORLD_SIZE, 600, "adapter ranks")
    for name in worker.BACKENDS:
        # Rank 0's gather, and every rank's (what colocated engines load) as seen on rank 1.
        for suffix in ("", "_every_rank"):
            gathered = load_file(tmp_path / f"{name}{suffix}.safetensors")
            assert sorted(gathered) == sorted(saved), (name, suffix)
            for key, value in saved.items():
                assert torch.equal(gathered[key], value), (name, suffix, key)
        with safe_open(tmp_path / f"{name}.safetensors", "pt") as f:
            assert f.metadata()["r"] == "4"
    # The merged weights a full-weight sync streams equal PEFT's own merge of the same model, in the
    # base model's state-dict order, the tied head left out (it travels as the embedding).
    merged = worker.lora_model().merge_and_unload()
    tied = merged.config.tie_word_embeddings
    expected = {k: v for k, v in merged.state_dict().items() if not (tied and k == "lm_head.weight")}
    for name in worker.BACKENDS:
        for suffix in ("", "_every_rank"):
            streamed = torch.load(tmp_path / f"{name}_merged{suffix}.pt")
            assert streamed["names"] == list(expected), (name, suffix)
            for key, value in expected.items():
                # fp32; PEFT adds B @ A * scaling in the weight's dtype as the merge here does: float error only.
                torch.testing.assert_close(
                    streamed["tensors"][key], value, rtol=1e-6, atol=1e-6, msg=(name, suffix, key)
                )
