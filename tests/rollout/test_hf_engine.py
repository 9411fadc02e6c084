"""The transformers engine honours the rollout interface (run in this process)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from raylign.config.rollout import RolloutConfig, SamplingConfig
from raylign.rollout.hf_engine import HFEngine, RowSampler

from .rollout_helpers import keep_mask, load_fp32, perturb_, pick_stop_string, prefix_until_stop, reference_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [100, 7, 300]]
# fp32 on both sides; generate's cached decoding and one full forward differ only by
# summation order, ~1e-6 on these magnitudes.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tied_model_dir):
    return HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32"))


@pytest.fixture(scope="module")
def reference_model(tied_model_dir):
    return load_fp32(tied_model_dir)


def generate(engine, prompts, **sampling):
    return asyncio.run(engine.generate(prompts, SamplingConfig(**sampling)))


def test_n_samples_per_prompt_in_prompt_then_sample_order(engine):
    out = generate(engine, PROMPTS, n=3, temperature=1.0, max_new_tokens=5, seed=7)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(3)]
    assert all(c.prompt_token_ids == PROMPTS[c.prompt_index] for c in out)
    for p in range(3):
        samples = {tuple(c.response_token_ids) for c in out if c.prompt_index == p}
        assert len(samples) > 1, "temperature-1 samples of one prompt should differ"


def test_max_new_tokens_bounds_every_response(engine, tokenizer_eos):
    out = generate(engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=4, seed=1)
    for c in out:
        assert 1 <= len(c.response_token_ids) <= 4
        ended_by_eos = c.response_token_ids[-1] == tokenizer_eos
        assert c.finish_reason == ("stop" if ended_by_eos else "length")
        if c.finish_reason == "length":
            assert len(c.response_token_ids) == 4


def test_stop_string_ends_the_response_after_the_completing_token(engine, tied_model_dir):
    free = generate(engine, [PROMPTS[0]], temperature=1.0, max_new_tokens=24, seed=3)[0]
    stop = pick_stop_string(engine.tokenizer, free.response_token_ids)
    expected_tokens, expected_text = prefix_until_stop(engine.tokenizer, free.response_token_ids, stop)
    stopped = generate(engine, [PROMPTS[0]], temperature=1.0, max_new_tokens=24, seed=3, stop=[stop])[0]
    assert stopped.response_token_ids == expected_tokens
    assert stopped.text == expected_text
    assert stopped.finish_reason == "stop"
    assert len(stopped.response_logprobs) == len(expected_tokens)


def test_greedy_logprobs_equal_a_separate_fp32_forward(engine, reference_model):
    out = generate(engine, PROMPTS, temperature=0.0, max_new_tokens=8)
    for c in out:
        expected = reference_logprobs(reference_model, c.prompt_token_ids, c.response_token_ids)
        assert c.response_logprobs == pytest.approx(expected, abs=LOGPROB_TOL)
        # greedy picks the argmax, whose log-prob is the largest in the row
        assert all(lp > -20 for lp in c.response_logprobs)


def test_sampled_logprobs_are_those_of_the_filtered_tempered_distribution(engine, reference_model):
    settings = dict(temperature=0.7, top_k=20, top_p=0.9)
    out = generate(engine, PROMPTS, n=2, max_new_tokens=6, seed=11, **settings)
    for c in out:
        expected = reference_logprobs(reference_model, c.prompt_token_ids, c.response_token_ids, **settings)
        assert c.response_logprobs == pytest.approx(expected, abs=LOGPROB_TOL)


def test_seeded_samples_do_not_depend_on_which_prompts_share_the_call(engine):
    together = generate(engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=5, seed=5)
    alone = asyncio.run(
        engine.generate(
            [PROMPTS[2]], SamplingConfig(n=2, temperature=1.0, max_new_tokens=5, seed=5), prompt_indices=[2]
        )
    )
    assert [c.response_token_ids for c in alone] == [c.response_token_ids for c in together if c.prompt_index == 2]


def test_bad_prompts_name_the_prompt(engine):
    with pytest.raises(ValueError, match="prompt 1: empty"):
        generate(engine, [[5], []])
    with pytest.raises(ValueError, match="prompt 0: token ids \\[99999\\]"):
        generate(engine, [[5, 99999]])
    with pytest.raises(TypeError, match="never tokenised"):
        generate(engine, "hello")
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"prompt index -1: must be an integer >= 0"):
        asyncio.run(engine.generate([[5], [6]], sampling, prompt_indices=[0, -1]))
    with pytest.raises(ValueError, match=r"prompt index -3: must be an integer >= 0"):
        asyncio.run(engine.generate_group([5], sampling, prompt_index=-3))


def test_max_model_len_ends_a_response_where_vllm_ends_it_and_refuses_a_prompt_without_room(engine, tied_model_dir):
    # It was ignored: responses ran to max_new_tokens past rollout.max_model_len, and a prompt longer than
    # it generated, where the vLLM engine ends the sequence there and refuses the prompt.
    bounded = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32", max_model_len=16))
    sampling = {"n": 4, "temperature": 1.0, "max_new_tokens": 30, "seed": 5}
    free = [c for c in generate(engine, [PROMPTS[0]], **sampling) if c.finish_reason == "length"]
    cut = generate(bounded, [PROMPTS[0]], **sampling)
    assert free, "a sample long enough to be cut"
    for whole in free:  # the same stream, ended at 16 - 5 tokens
        (short,) = [c for c in cut if c.sample_index == whole.sample_index]
        assert short.response_token_ids == whole.response_token_ids[:11]
        assert short.response_logprobs == pytest.approx(whole.response_logprobs[:11], abs=LOGPROB_TOL)
        assert short.finish_reason == "length"
    with pytest.raises(
        ValueError, match=r"prompt 1: 16 tokens leave no room for a response within rollout.max_model_len \(16"
    ):
        generate(bounded, [[5], list(range(4, 20))])


def test_in_process_weight_update_changes_logprobs_to_the_new_weights(tied_model_dir):
    engine = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32"))
    trainer = load_fp32(tied_model_dir)
    perturb_(trainer)
    asyncio.run(engine.update_weights(trainer.named_parameters()))  # tied: no lm_head.weight in this stream
    c = generate(engine, [PROMPTS[0]], temperature=0.0, max_new_tokens=6)[0]
    assert c.weight_version == 1
    expected = reference_logprobs(trainer, c.prompt_token_ids, c.response_token_ids)
    assert c.response_logprobs == pytest.approx(expected, abs=LOGPROB_TOL)


def test_weight_update_rejects_unknown_names(tied_model_dir):
    engine = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32"))
    with pytest.raises(KeyError, match="model.nonexistent.weight"):
        asyncio.run(engine.update_weights([("model.nonexistent.weight", torch.zeros(1))]))


@pytest.fixture(scope="module")
def tokenizer_eos(engine):
    return engine.tokenizer.eos_token_id


def test_unseeded_prompts_share_one_batched_call_with_exact_logprobs(engine, reference_model):
    settings = dict(temperature=0.7, top_k=20, top_p=0.9)
    out = generate(engine, PROMPTS, n=2, max_new_tokens=6, **settings)  # unseeded: one left-padded call
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(3) for j in range(2)]
    for c in out:
        assert c.prompt_token_ids == PROMPTS[c.prompt_index]
        expected = reference_logprobs(reference_model, c.prompt_token_ids, c.response_token_ids, **settings)
        assert c.response_logprobs == pytest.approx(expected, abs=LOGPROB_TOL)


def test_unseeded_calls_draw_fresh_samples(engine):
    # Regression: restoring the RNG after every unseeded call made each call repeat the same draws.
    first = generate(engine, PROMPTS, n=4, temperature=1.0, max_new_tokens=8)
    second = generate(engine, PROMPTS, n=4, temperature=1.0, max_new_tokens=8)
    assert [c.response_token_ids for c in first] != [c.response_token_ids for c in second]


def test_sleep_frees_nothing_on_the_cpu_and_generation_goes_on(tied_model_dir):
    # Sleep moves the weights to host memory on a GPU only (benchmarks/gpu_check.py's colocated check
    # measures that); on the CPU there is nothing to free and the engine keeps serving.
    engine = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32", enable_sleep_mode=True))
    assert not engine.sleeps()
    before = generate(engine, [PROMPTS[0]], temperature=0.0, max_new_tokens=4)[0]
    asyncio.run(engine.sleep(1))
    assert not engine.asleep
    asyncio.run(engine.wake_up(["kv_cache"]))
    assert generate(engine, [PROMPTS[0]], temperature=0.0, max_new_tokens=4)[0].response_token_ids == (
        before.response_token_ids
    )


def test_an_asleep_engine_refuses_to_generate_or_score_and_says_how_to_wake_it(engine):
    engine.asleep = True  # as sleep() leaves it on a GPU
    try:
        with pytest.raises(RuntimeError, match=r"asked to generate while asleep.*wake_up\(\['weights'\]\)"):
            generate(engine, [PROMPTS[0]], temperature=0.0, max_new_tokens=4)
        with pytest.raises(RuntimeError, match="asked to score while asleep"):
            asyncio.run(engine.score([5, 6, 7]))
    finally:
        engine.asleep = False


def test_unseeded_samples_repeat_with_the_engine_seed_and_change_with_it(tied_model_dir):
    def unseeded_samples(engine_seed, process_seed):
        torch.manual_seed(process_seed)  # whatever the process drew before, the engine's own seed decides
        engine = HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32", seed=engine_seed))
        return [c.response_token_ids for c in generate(engine, PROMPTS, n=4, temperature=1.0, max_new_tokens=8)]

    assert unseeded_samples(3, process_seed=1) == unseeded_samples(3, process_seed=2)
    assert unseeded_samples(3, process_seed=1) != unseeded_samples(4, process_seed=1)


def test_the_engine_samples_from_its_own_stream_and_leaves_the_process_stream_alone(tied_model_dir):
    # A colocated trainer shares the engine's process: its dropout and its own sampling must draw
    # what they would draw with no engine there, and the engine's samples must not depend on them.
    def build():
        return HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32", seed=3))

    def unseeded(engine):
        return [c.response_token_ids for c in generate(engine, PROMPTS, n=2, temperature=1.0, max_new_tokens=6)]

    torch.manual_seed(11)
    expected_process_draws = torch.rand(8)

    torch.manual_seed(11)
    alone = build()
    alone_samples = [unseeded(alone), unseeded(alone)]
    generate(alone, PROMPTS[:1], temperature=1.0, max_new_tokens=6, seed=5)  # a seeded request too
    assert torch.equal(torch.rand(8), expected_process_draws)

    beside_a_trainer = build()
    first = unseeded(beside_a_trainer)
    torch.rand(1000)  # the process draws between two rollouts
    assert [first, unseeded(beside_a_trainer)] == alone_samples


def test_unseeded_samples_depend_neither_on_the_batch_nor_on_arrival_order_nor_on_the_engine(tied_model_dir):
    # A pool's engines share rollout.seed and a streaming run's groups reach them in whatever order and
    # batches timing makes: each sample's stream comes from (rollout.seed, prompt index, earlier requests
    # for that index), so the same run gives the same samples.
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=6)

    def build():
        return HFEngine(str(tied_model_dir), RolloutConfig(engine="hf", dtype="float32", seed=9))

    together = asyncio.run(build().generate(PROMPTS, sampling))
    other_engine = build()
    one_by_one = []
    for index in reversed(range(len(PROMPTS))):  # alone in their batches, last first
        one_by_one += asyncio.run(other_engine.generate([PROMPTS[index]], sampling, prompt_indices=[index]))

    def by_sample(completions):
        return {(c.prompt_index, c.sample_index): c.response_token_ids for c in completions}

    assert by_sample(one_by_one) == by_sample(together)
    assert len({tuple(tokens) for tokens in by_sample(together).values()}) > 1


def test_the_row_sampler_draws_each_row_from_the_filtered_tempered_distribution():
    # One fixed row of logits, 20,000 rows each with its own seed: the picked tokens' frequencies match
    # softmax(filter_{k,p}(logits / T)) computed by a plain loop (keep_mask), within 5 standard errors;
    # filtered tokens are never picked; the kept log-prob is that of the picked token.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    settings = dict(temperature=0.8, top_k=6, top_p=0.95)
    rows = 20_000
    sampler = RowSampler(list(range(rows)), SamplingConfig(**settings))
    scores = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.repeat(rows, 1))
    picked = scores.argmax(dim=-1)
    assert torch.all(torch.isinf(scores).sum(dim=-1) == len(logits) - 1)  # one token left per row

    tempered = logits.double() / settings["temperature"]
    keep = torch.tensor(keep_mask(tempered, settings["top_k"], settings["top_p"]))
    expected = torch.softmax(tempered.masked_fill(~keep, float("-inf")), dim=-1)
    counts = torch.bincount(picked, minlength=len(logits)).double()
    assert torch.all(counts[~keep] == 0)
    standard_error = (expected * (1 - expected) / rows).sqrt()
    assert torch.all((counts / rows - expected).abs() <= 5 * standard_error + 1e-12), (counts / rows, expected)
    assert sampler.logprobs(1)[:, 0].double() == pytest.approx(expected.log()[picked], abs=1e-5)


def test_the_row_sampler_takes_each_step_from_the_rows_own_stream_across_chunks(monkeypatch):
    # Chunks of 3 steps, 7 steps: a row's uniform numbers are its generator's rand(3), rand(3), rand(1),
    # in order, and the token at each step is the first whose cumulative probability exceeds the step's
    # number (a plain loop). No more than one chunk is held at a time.
    monkeypatch.setattr(RowSampler, "CHUNK", 3)
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, -1.4, 0.7])
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    seeds, steps = [11, 12, 13, 14], 7
    sampler = RowSampler(seeds, SamplingConfig(temperature=1.0, max_new_tokens=steps))
    picked = []
    for _ in range(steps):
        assert sampler.uniforms is not None and sampler.uniforms.shape[1] <= 3
        picked.append(sampler(torch.zeros(len(seeds), 1, dtype=torch.long), logits.repeat(len(seeds), 1)).argmax(-1))
    for row, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        uniforms = torch.cat([torch.rand(n, generator=generator) for n in (3, 3, 1)]).tolist()
        expected = []
        for u in uniforms:
            cumulative, token = 0.0, 0
            while cumulative + probs[token] <= u:
                cumulative, token = cumulative + probs[token], token + 1
            expected.append(token)
        assert [int(step[row]) for step in picked] == expected, seed
