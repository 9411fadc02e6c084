"""GRPO with a LoRA policy and the real vLLM engine: each sync sends the adapter only, vLLM serves it
as a LoRA adapter, and the adapter check compares what it does on both sides."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from raylign.config.rollout import SamplingConfig
from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import fp32_model, resolve, response_logprobs, rl_config_data

pytestmark = pytest.mark.slow

vllm_only = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100, 7, 300, 12]]
LOGPROB_TOL = 1e-4  # fp32 on both sides (see test_rl_vllm.py)


def _data(model_dir, prompt_file, out, engine: str = "vllm", **rollout) -> dict:
    data = rl_config_data(model_dir, prompt_file, out)
    data["model"]["lora"] = LORA
    data["optim"]["lr"] = 5e-2  # large: lora_B starts at zero, and the adapter must move the policy
    data["rollout"] = {"engine": engine, "dtype": "float32", **rollout}
    return data


def test_adapter_sync_is_the_default_for_a_lora_policy_with_vllm_and_refused_where_it_cannot_work(
    rl_model_dir, prompt_file, tmp_path
):
    assert resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path)).syncs_adapters
    assert not resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path, lora_sync="merged")).syncs_adapters
    assert not resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path, engine="hf")).syncs_adapters
    with pytest.raises(ValueError, match="lora_sync: adapter needs rollout.engine: vllm"):
        resolve(tmp_path, _data(rl_model_dir, prompt_file, tmp_path, engine="hf", lora_sync="adapter"))
    full = _data(rl_model_dir, prompt_file, tmp_path, lora_sync="adapter")
    del full["model"]["lora"]
    with pytest.raises(ValueError, match=r"lora_sync: adapter needs a LoRA policy \(model.lora.rank > 0\)"):
        resolve(tmp_path, full)
    full["rollout"]["lora_sync"] = "merged"  # unread without adapters: refused, not ignored
    with pytest.raises(ValueError, match=r"lora_sync: merged needs a LoRA policy \(model.lora.rank > 0\)"):
        resolve(tmp_path, full)
    big = _data(rl_model_dir, prompt_file, tmp_path)
    big["model"]["lora"] = {**LORA, "rank": 1024}
    with pytest.raises(ValueError, match="vLLM serves adapters up to rank 512"):
        resolve(tmp_path, big)


class ProbingTrainer(RLTrainer):
    """The real controller; before it stops its engines it asks the first one for greedy completions
    and for the adapters it holds."""

    probe: list | None = None
    adapters: list[int] | None = None

    def shutdown(self) -> None:
        import ray

        if getattr(self, "engines", None):
            sampling = SamplingConfig(n=1, temperature=0.0, max_new_tokens=8)
            self.probe = ray.get(self.engines[0].generate.remote(PROMPTS, sampling))
            self.adapters = ray.get(self.engines[0].adapters_loaded.remote())
        super().shutdown()


@vllm_only
def test_a_grpo_run_sends_only_the_adapter_and_the_engine_samples_from_the_trained_policy(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    data = _data(rl_model_dir, prompt_file, tmp_path / "out", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    trainer = ProbingTrainer(resolve(tmp_path, data))
    trainer.run()

    _assert_adapter_syncs(trainer, rl_model_dir)
    # The last adapter only; the run's export is the merged policy, and the engine samples from it.
    assert trainer.adapters == [2]
    merged, base = fp32_model(trainer.out / "final"), fp32_model(rl_model_dir)
    moved = 0.0
    with torch.no_grad():
        for c in trainer.probe:
            sampled = torch.tensor(c.response_logprobs)
            expected = response_logprobs(merged, c.prompt_token_ids, c.response_token_ids)
            torch.testing.assert_close(sampled, expected, atol=LOGPROB_TOL, rtol=0)
            moved = max(
                moved, float((response_logprobs(base, c.prompt_token_ids, c.response_token_ids) - sampled).abs().max())
            )
    assert moved > 1e-2  # training moved the policy away from its base


def _assert_adapter_syncs(trainer: RLTrainer, model_dir) -> None:
    """Each of the run's 2 syncs sent the adapter alone, and the engine's log-probs with it equal the policy's."""
    hf = fp32_model(model_dir).config
    head_dim = hf.hidden_size // hf.num_attention_heads
    dims = {  # (fan in, fan out) of each targeted projection
        "q_proj": (hf.hidden_size, hf.num_attention_heads * head_dim),
        "v_proj": (hf.hidden_size, hf.num_key_value_heads * head_dim),
        "up_proj": (hf.hidden_size, hf.intermediate_size),
        "down_proj": (hf.intermediate_size, hf.hidden_size),
    }
    adapter_bytes = hf.num_hidden_layers * sum(4 * LORA["rank"] * (i + o) for i, o in dims.values())
    records = read_metrics(trainer.out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["sync/num_bytes"] == adapter_bytes  # A and B of every targeted layer, fp32; nothing else
        assert r["sync/num_tensors"] == 2 * len(dims) * hf.num_hidden_layers
        assert r["sync/engine_version"] == r["step"]
        assert r["sync/probe_logprob_diff_max"] <= LOGPROB_TOL
        # Each step's update moved the policy; the engine's adapter moves its log-probs the same way.
        assert r["sync/adapter_shift_policy"] > 1e-3
        assert r["sync/adapter_shift_error"] < 1e-3
        # Step 2 sampled under the adapter synced after step 1; the trainer recomputed the log-probs.
        assert r["mismatch/logprob_max_abs_diff"] <= LOGPROB_TOL


@vllm_only
def test_a_qlora_grpo_run_serves_the_4bit_base_dequantised_so_the_engine_computes_as_the_policy(
    ray_session, rl_model_dir, prompt_file, tmp_path
):
    """A 4-bit policy base on 2 fsdp2 ranks (each holding the packed base whole): the engines start from
    its values dequantised (``engine_base`` in the output folder, written by the policy), not from the
    model folder's full-precision weights, and take the adapter alone at each sync."""
    from peft import PeftModel

    data = _data(rl_model_dir, prompt_file, tmp_path / "out", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    data["model"]["lora"] = {**LORA, "quantize_base": "nf4"}
    data["engine"] = {"backend": "fsdp2"}
    data["placement"] = {"policy_workers": 2}
    trainer = ProbingTrainer(resolve(tmp_path, data))
    trainer.run()

    _assert_adapter_syncs(trainer, rl_model_dir)
    assert trainer.adapters == [2]
    # What the engine served at the end: the dequantised base under the last adapter, applied here by PEFT.
    served = PeftModel.from_pretrained(fp32_model(trainer.out / "engine_base"), trainer.out / "final" / "adapter")
    served = served.merge_and_unload().eval()
    # The export merges the adapter into the full-precision original instead (what a user deploys).
    exported = fp32_model(trainer.out / "final")
    apart = 0.0
    with torch.no_grad():
        for c in trainer.probe:
            sampled = torch.tensor(c.response_logprobs)
            expected = response_logprobs(served, c.prompt_token_ids, c.response_token_ids)
            torch.testing.assert_close(sampled, expected, atol=LOGPROB_TOL, rtol=0)
            other = response_logprobs(exported, c.prompt_token_ids, c.response_token_ids)
            apart = max(apart, float((other - sampled).abs().max()))
    assert apart > 10 * LOGPROB_TOL  # the 4-bit base computes measurably apart from its original
