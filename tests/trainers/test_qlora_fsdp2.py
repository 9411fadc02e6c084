"""QLoRA on several processes: fsdp2 ranks each hold the 4-bit base whole (bitsandbytes computes with its
packed weights) and shard the adapters and the rest, and train exactly as one process holding all the
micro-batches; a run stopped after step 2 and resumed from its checkpoint (the adapters and optimizer
alone: the frozen base is read again) ends where the unbroken one does; so does a run whose packed rows
are split over the two ranks (sequence parallel); and so do deepspeed ranks under ZeRO-2 (each holding
the whole model, the adapters' optimizer state partitioned), unbroken and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylign.config.base import ConfigError, parse_config
from raylign.config.commands import SFTConfig
from raylign.models.tiny import build_tiny_model
from raylign.tasks.strings import make_string_rows
from raylign.trainers.metrics import read_metrics
from raylign.trainers.sft import SFTTrainer
from tests.spawned_ranks import import_worker, spawn_and_join

from .test_sft import write_jsonl

worker = import_worker(__file__, "qlora_fsdp2_worker")


@pytest.mark.slow
@pytest.mark.distributed
def test_qlora_on_two_fsdp2_ranks_trains_like_one_process_and_resumes(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4)
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 16, seed=0))
    # One process, the local backend: the same global batch as 4 micro-batches of its own.
    SFTTrainer(worker.sft_config(str(model_dir), str(train_file), tmp_path / "local", "local")).run()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        args = (str(model_dir), str(train_file), str(tmp_path))
        spawn_and_join(worker.run_rank, args, worker.WORLD_SIZE, 900, "QLoRA fsdp2 ranks")

    names = ("local", "fsdp2", "fsdp2_sp2", "deepspeed")
    runs = {n: [r for r in read_metrics(tmp_path / n) if "train/loss" in r] for n in names}
    assert any(r["train/grad_norm"] > 0.5 for r in runs["local"])  # clipping is in play
    for run in names[1:]:
        assert [r["step"] for r in runs["local"]] == [r["step"] for r in runs[run]] == [1, 2, 3]
        for a, b in zip(runs["local"], runs[run], strict=True):
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-5), (run, a, b)
            assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5, abs=1e-5), (run, a, b)
    for run in ("fsdp2", "deepspeed"):
        resumed = [r for r in read_metrics(tmp_path / f"{run}_resumed") if "train/loss" in r]
        assert resumed[-1]["step"] == 3
        assert resumed[-1]["train/loss"] == pytest.approx(runs[run][-1]["train/loss"], rel=1e-5, abs=1e-5)
    # The exports (the adapters merged into the full-precision base) agree, and training moved them.
    local = load_file(tmp_path / "local" / "final" / "model.safetensors")
    stored = load_file(model_dir / "model.safetensors")
    for run in ("fsdp2", "fsdp2_resumed", "fsdp2_sp2", "deepspeed", "deepspeed_resumed"):
        weights = load_file(tmp_path / run / "final" / "model.safetensors")
        assert weights.keys() == local.keys()
        for name, value in local.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=f"{run} {name}")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(local[key], stored[key])
    # The checkpoint keeps the adapters alone (and their AdamW moments): no base weight, packed or not.
    from torch.distributed.checkpoint import FileSystemReader

    stored_keys = FileSystemReader(tmp_path / "fsdp2" / "checkpoints" / "step_3" / "dcp").read_metadata()
    model_keys = [k for k in stored_keys.state_dict_metadata if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2  # lora_A and lora_B of the 7 projections of both layers
    assert all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    # DeepSpeed's checkpoint leaves the frozen weights out too: the adapters, and bitsandbytes' small
    # quantisation-state entries (.weight.absmax, .weight.quant_map, ...) that its layers' state dicts add.
    # The tied output head stays: DeepSpeed drops frozen parameters by name, and the tie has one, the embedding's.
    (states,) = (tmp_path / "deepspeed" / "checkpoints" / "step_3").rglob("mp_rank_00_model_states.pt")
    saved = torch.load(states, weights_only=False)["module"]
    assert sum(".lora_A." in k or ".lora_B." in k for k in saved) == 2 * 7 * 2
    others = [k for k in saved if ".lora_" not in k and ".base_layer.weight." not in k]
    assert others == ["base_model.model.lm_head.weight"], others
    # Each rank holds q_proj's 4-bit weight whole (64 x 64 weights, two to a byte) and half of its lora_A rows.
    for rank in range(worker.WORLD_SIZE):
        holdings = json.loads((tmp_path / f"holdings_rank{rank}.json").read_text())
        expected = {"packed_elements": 64 * 64 // 2, "packed_dtype": "torch.uint8"}
        assert holdings == {**expected, "adapter_sharded": True, "adapter_local_rows": 2}, (rank, holdings)


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"backend": "deepspeed", "zero_stage": 3}, "or deepspeed with engine.zero_stage 1 or 2 .* got zero_stage 3"),
        ({"backend": "fsdp2", "tensor_parallel_size": 2}, "does not split a 4-bit base's matrices yet; set engine"),
    ],
)
def test_a_4bit_base_under_zero_or_split_by_tensor_parallel_is_refused_by_name(engine, message):
    data = {"model": {"path": "m", "lora": {"rank": 4, "quantize_base": "nf4"}}, "data": {"train": ["t.jsonl"]}}
    with pytest.raises(ConfigError, match=message):
        parse_config(SFTConfig, {**data, "engine": engine})
