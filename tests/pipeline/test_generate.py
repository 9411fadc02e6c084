"""raylign generate: n responses per prompt, the file format, labels and passthrough keys.

Greedy responses are checked against a plain argmax loop over an fp32 forward of the
chat-rendered prompt, written here independently of the engines.
"""

from __future__ import annotations

import pytest
import torch

from raylign.config.base import ConfigError, parse_config
from raylign.config.pipeline import GenerateConfig
from raylign.config.rl import RLDataConfig
from raylign.data import RowError
from raylign.models.loading import load_tokenizer
from raylign.pipeline.generate import run_generate
from raylign.rl.prompts import load_prompts

from .helpers import read_jsonl, write_jsonl

CONVERSATION = [{"role": "system", "content": "answer"}, {"role": "user", "content": "copy: d e"}]
PROMPT_ROWS = [
    {"prompt": "reverse: a b c", "label": "c b a", "id": 1},
    {"prompt": CONVERSATION, "label": "d e", "id": 2},
    {"prompt": "copy: f", "id": 3, "data_source": "copying"},
]
# ChatML of the tiny tokenizer, written out by hand.
PROMPT_TEXTS = [
    "<|im_start|>user\nreverse: a b c<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nanswer<|im_end|>\n<|im_start|>user\ncopy: d e<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\ncopy: f<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW_TOKENS = 6


def generate_config(tmp_path, model_dir, engine: str, **overrides) -> GenerateConfig:
    data = {"prompts": [str(write_jsonl(tmp_path / "prompts.jsonl", PROMPT_ROWS))], **overrides.pop("data", {})}
    return parse_config(
        GenerateConfig,
        {
            "model": {"path": str(model_dir)},
            "data": data,
            "rollout": {"engine": engine, "dtype": "float32", "kv_cache_memory_bytes": 32 << 20, "max_model_len": 128},
            "sampling": {"n": 3, "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS},
            "output_path": str(tmp_path / "out" / "generations.jsonl"),
            "batch_size": 2,  # two requests: the second starts at prompt 2
            "progress_bar": False,
            **overrides,
        },
    )


def greedy_reference(model_dir, prompt_text: str) -> tuple[str, str]:
    """(text, finish reason) of argmax decoding, one full forward per token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            token = int(model(torch.tensor([ids + generated])).logits[0, -1].argmax())
            generated.append(token)
            if token == tokenizer.eos_token_id:
                return tokenizer.decode(generated, skip_special_tokens=True), "stop"
    return tokenizer.decode(generated, skip_special_tokens=True), "length"


def check_greedy_file(path, model_dir, n: int) -> None:
    rows = read_jsonl(path)
    keys = ["prompt", "prompt_text", "responses", "finish_reasons", "label", "data_source", "id"]
    assert [list(row) for row in rows] == [keys] * 3
    assert [row["data_source"] for row in rows] == ["prompts", "prompts", "copying"]  # the file's name, else the row's
    assert [row["prompt"] for row in rows] == [r["prompt"] for r in PROMPT_ROWS]
    assert [row["prompt_text"] for row in rows] == PROMPT_TEXTS
    assert [row["label"] for row in rows] == ["c b a", "d e", None]
    assert [row["id"] for row in rows] == [1, 2, 3]
    for row, prompt_text in zip(rows, PROMPT_TEXTS):
        text, reason = greedy_reference(model_dir, prompt_text)
        assert row["responses"] == [text] * n
        assert row["finish_reasons"] == [reason] * n


def test_hf_generate_writes_n_greedy_responses_per_prompt_with_labels(tmp_path, model_dir, ray_session):
    cfg = generate_config(tmp_path, model_dir, "hf")
    metrics = run_generate(cfg)
    check_greedy_file(cfg.output_path, model_dir, n=3)
    assert metrics["prompts"] == 3 and metrics["responses"] == 9


@pytest.mark.slow
def test_hf_generate_plain_template_sampling_and_chosen_passthrough_keys(tmp_path, model_dir, ray_session):
    rows = [
        {"prompt": "reverse: a b", "answer": "b a", "id": 7, "extra": "x"},
        {"prompt": "copy: c d", "answer": "c d", "id": 8, "extra": "y"},
        {"prompt": "copy: e", "answer": "e", "id": 9, "extra": "z"},
    ]
    spec = {"path": str(write_jsonl(tmp_path / "plain.jsonl", rows)), "label_key": "answer", "max_samples": 2}
    cfg = generate_config(
        tmp_path,
        model_dir,
        "hf",
        data={"prompts": [spec], "format": "plain", "prompt_template": "Q: {input}\nA:", "passthrough_keys": ["id"]},
        sampling={"n": 4, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": 1},
    )
    run_generate(cfg)
    out = read_jsonl(cfg.output_path)
    assert [row["prompt_text"] for row in out] == ["Q: reverse: a b\nA:", "Q: copy: c d\nA:"]
    assert [row["label"] for row in out] == ["b a", "c d"]
    keys = ["data_source", "finish_reasons", "id", "label", "prompt", "prompt_text", "responses"]
    assert [sorted(row) for row in out] == [keys] * 2
    assert [len(row["responses"]) for row in out] == [4, 4]
    assert all(reason in ("stop", "length") for row in out for reason in row["finish_reasons"])


@pytest.mark.slow
def test_vllm_generate_writes_n_greedy_responses_per_prompt_with_labels(tmp_path, model_dir, ray_session):
    cfg = generate_config(
        tmp_path, model_dir, "vllm", sampling={"n": 2, "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}
    )
    run_generate(cfg)
    check_greedy_file(cfg.output_path, model_dir, n=2)


def test_bad_prompt_row_names_file_row_and_key_before_any_engine_starts(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "ok", "label": "a"}, {"question": "no prompt key"}])
    cfg = parse_config(
        GenerateConfig,
        {
            "model": {"path": str(model_dir)},
            "data": {"prompts": [str(path)]},
            "output_path": str(tmp_path / "out.jsonl"),
        },
    )
    with pytest.raises(RowError, match=r"prompts\.jsonl, row 2, key 'prompt': missing key"):
        run_generate(cfg)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_max_model_len_without_room_for_the_longest_prompt_names_its_row_before_any_engine_starts(
    tmp_path, model_dir, caplog
):
    # vLLM refused it mid-run without naming a row; the hf engine generated past it.
    rows = [{"prompt": "copy: a"}, {"prompt": "copy: " + " ".join("abcdefgh" * 8)}]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)

    def config(max_model_len: int) -> GenerateConfig:
        return parse_config(
            GenerateConfig,
            {
                "model": {"path": str(model_dir)},
                "data": {"prompts": [str(path)]},
                "rollout": {"engine": "hf", "max_model_len": max_model_len},
                "sampling": {"max_new_tokens": 8},
                "output_path": str(tmp_path / "out.jsonl"),
            },
        )

    with pytest.raises(ValueError, match=r"prompts\.jsonl, row 2: the prompt has \d+ tokens, which leaves no room"):
        run_generate(config(32))
    assert not (tmp_path / "out.jsonl").exists()
    # Room for the prompt but not for all its new tokens: said once, before generating.
    data = RLDataConfig(train=[{"path": str(path)}])
    longest = max(len(p.token_ids) for p in load_prompts(data.train, data, load_tokenizer(str(model_dir))))
    cfg = config(longest + 4)
    with caplog.at_level("WARNING", logger="raylign"):
        assert cfg.rollout.with_room_for(longest, 8, "prompts.jsonl, row 2") is cfg.rollout
    assert f"the longest prompt ({longest} tokens, prompts.jsonl, row 2) plus 8 new tokens" in caplog.text


def test_keys_of_training_data_are_refused_for_prompt_datasets(tmp_path, model_dir):
    # A mixing weight was accepted and every row read once regardless.
    base = {"model": {"path": str(model_dir)}, "output_path": str(tmp_path / "out.jsonl")}
    spec = {"path": "p.jsonl", "weight": 5.0, "output_key": "answer"}
    with pytest.raises(ConfigError, match=r"prompts\.0: weight, output_key are for training data"):
        parse_config(GenerateConfig, {**base, "data": {"prompts": [spec]}})
    spec = {"path": "p.jsonl", "system_key": "instructions", "max_samples": 3}
    assert parse_config(GenerateConfig, {**base, "data": {"prompts": [spec]}}).data.prompts[0].max_samples == 3
