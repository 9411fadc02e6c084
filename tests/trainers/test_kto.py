"""KTO end to end: it trains against a frozen reference and moves the policy toward desirable outputs."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylign.cli.main import help_option, main
from raylign.config.base import ConfigError, describe_fields, parse_config
from raylign.config.commands import SFTConfig
from raylign.config.kto import KTOConfig
from raylign.data import RowError
from raylign.tasks.evaluate import greedy_chat_answers
from raylign.trainers.kto import KTOTrainer
from raylign.trainers.metrics import read_metrics
from raylign.trainers.sft import SFTTrainer

REPO = Path(__file__).resolve().parents[2]
DESIRABLE_LETTERS, UNDESIRABLE_LETTERS = "abcd", "efgh"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def letters_row(rng: random.Random, desirable: bool) -> dict:
    """A prompt naming two letters and a reply of three letters, all from the desirable set or all not."""
    prompt = "pick: " + " ".join(rng.choice(DESIRABLE_LETTERS + UNDESIRABLE_LETTERS) for _ in range(2))
    pool = DESIRABLE_LETTERS if desirable else UNDESIRABLE_LETTERS
    return {"prompt": prompt, "completion": " ".join(rng.choice(pool) for _ in range(3)), "label": desirable}


def is_desirable(reply: str) -> bool:
    letters = reply.split()
    return bool(letters) and all(letter in DESIRABLE_LETTERS for letter in letters)


def kto_config(model_dir, train_file, out, kto=None, **train) -> KTOConfig:
    return parse_config(
        KTOConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {"train": [str(train_file)], "max_length": 64},
            "kto": {"beta": 0.1, **(kto or {})},
            "optim": {"lr": 1e-3, "weight_decay": 0.0},
            "train": {
                "output_dir": str(out),
                "global_batch_size": 16,
                "micro_batch_size": 8,
                "logging": {"progress_bar": False},
                **train,
            },
        },
    )


@torch.no_grad()
def completion_logprob(model, tokenizer, prompt: str, completion: str) -> float:
    """log p(completion + end of turn | chat prompt), summed over the completion's tokens."""
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prefix_ids + reply_ids])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return sum(float(logprobs[len(prefix_ids) + k - 1, token]) for k, token in enumerate(reply_ids))


def preference_gap(model_dir: Path, rows: list[tuple[str, str, str]]) -> float:
    """Mean over held-out prompts of log p(desirable reply) - log p(undesirable reply)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gaps = [
        completion_logprob(model, tokenizer, p, good) - completion_logprob(model, tokenizer, p, bad)
        for p, good, bad in rows
    ]
    return sum(gaps) / len(gaps)


def test_kto_trains_against_the_reference_and_exports_a_generating_model(tmp_path, tiny_model_dir):
    rng = random.Random(0)
    rows = [letters_row(rng, desirable=i % 2 == 0) for i in range(16)]
    out = tmp_path / "run"
    KTOTrainer(kto_config(tiny_model_dir, write_jsonl(tmp_path / "train.jsonl", rows), out, max_steps=6)).run()

    train = [r for r in read_metrics(out) if "train/loss" in r]
    losses = [r["train/loss"] for r in train]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    # At step 1 the policy is the reference: every implied reward is 0 and each loss is 1 - sigma(0).
    assert losses[0] == pytest.approx(0.5, abs=1e-5)
    assert train[0]["train/desirable_fraction"] == pytest.approx(0.5)
    assert train[-1]["train/reward_signed"] > 0

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert changed, "training did not change any parameter"
    replies = greedy_chat_answers(out / "final", ["pick: a e"], max_new_tokens=4)
    assert len(replies) == 1


def test_without_the_kl_estimate_the_reference_point_is_zero(tmp_path, tiny_model_dir):
    rng = random.Random(1)
    rows = [letters_row(rng, desirable=i % 2 == 0) for i in range(8)]
    out = tmp_path / "run"
    cfg = kto_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", rows),
        out,
        kto={"estimate_kl": False},
        max_steps=2,
        global_batch_size=8,
        micro_batch_size=1,
        export=False,
    )
    cfg.data.packing = False
    KTOTrainer(cfg).run()
    assert all(r["train/kl"] == 0 for r in read_metrics(out) if "train/kl" in r)


def test_desirable_and_undesirable_weights_scale_their_examples_losses(tmp_path, tiny_model_dir):
    rng = random.Random(5)
    rows = [letters_row(rng, desirable=i < 2) for i in range(8)]  # 2 desirable, 6 undesirable
    out = tmp_path / "run"
    cfg = kto_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", rows),
        out,
        kto={"desirable_weight": 3.0, "undesirable_weight": 0.5},
        max_steps=1,
        global_batch_size=8,
        micro_batch_size=4,
        export=False,
    )
    KTOTrainer(cfg).run()
    first = next(r for r in read_metrics(out) if "train/loss" in r)
    # Policy = reference at step 1: every example's loss is its weight times 1 - sigma(0) = 1/2.
    assert first["train/loss"] == pytest.approx((2 * 3.0 * 0.5 + 6 * 0.5 * 0.5) / 8, abs=1e-6)


def test_kl_pairs_need_two_examples_per_micro_batch():
    with pytest.raises(ConfigError, match="train.micro_batch_size must be >= 2"):
        parse_config(
            KTOConfig,
            {
                "model": {"path": "m"},
                "data": {"train": ["t.jsonl"]},
                "train": {"global_batch_size": 4, "micro_batch_size": 1},
            },
        )


def test_an_evaluation_batch_of_one_example_takes_no_reference_point_from_itself(tmp_path, tiny_model_dir):
    # A last evaluation batch can hold one example, whose prompt has no other completion to pair with:
    # z0 is then 0 (as without the estimate), not that example's own implied reward max(0, r).
    rng = random.Random(2)
    rows = [letters_row(rng, desirable=True) for _ in range(16)]
    trainer = KTOTrainer(kto_config(tiny_model_dir, write_jsonl(tmp_path / "train.jsonl", rows), tmp_path / "run"))
    trainer.setup()
    model, batch = trainer.engine.module, trainer.collate(trainer.train_samples[:1])
    trainer._logps(model, batch).sum().backward()  # a step up the example's log-prob makes its r > 0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * parameter.grad)
    trainer.engine.eval()
    with torch.no_grad():
        _, metrics = trainer.compute_loss(model, batch)
    assert metrics["reward_signed"] > 1e-3  # r itself is positive: max(0, r) would not be 0
    assert metrics["kl"] == 0.0


def test_a_non_boolean_label_stops_the_run_naming_the_row(tmp_path, tiny_model_dir):
    rows = [{"prompt": "p", "completion": "a", "label": True}, {"prompt": "p", "completion": "b", "label": "bad"}]
    train_file = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(RowError, match=rf"{train_file}, row 2, key 'label': expected a boolean"):
        KTOTrainer(kto_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=1)).run()


def test_help_describes_every_field(capsys):
    assert main(["kto", "--help"]) == 0
    text = capsys.readouterr().out
    for dotted, type_text, _, description in describe_fields(KTOConfig):
        if type_text != "section":
            assert description and f"{help_option(dotted)}  (" in text and description in text, dotted


def test_example_config_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        "kto",
        "--config",
        "examples/kto_tiny.yaml",
        "--model.path",
        str(tiny_model_dir),
        "--train.output_dir",
        str(tmp_path / "run"),
        "--train.max_steps",
        "3",
        "--train.logging.progress_bar",
        "false",
    ]
    assert main(argv) == 0
    assert (tmp_path / "run" / "final" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_average_the_reference_point_like_one_rank_with_their_joint_batch(
    tmp_path, tiny_model_dir, monkeypatch
):
    rng = random.Random(4)
    first, second = ([letters_row(rng, i % 2 == 0) for i in range(8)] for _ in range(2))
    # Each optimizer step sees all 16 rows in order. The mismatched pair of every example (the previous
    # completion, cyclically) is the same whether the 16 run as one micro-batch or as two ranks' contiguous
    # micro-batches of 8 once the two halves end with the same completion.
    second[-1] = {**second[-1], "completion": first[-1]["completion"]}
    train_file = write_jsonl(tmp_path / "train.jsonl", first + second)
    common = [
        "kto",
        "--model.path",
        str(tiny_model_dir),
        "--model.dtype",
        "float32",
        "--data.train",
        str(train_file),
        "--data.shuffle",
        "false",
        "--data.max_length",
        "64",
        "--optim.lr",
        "1e-3",
        "--train.max_steps",
        "3",
        "--train.global_batch_size",
        "16",
        "--train.export",
        "false",
        "--train.logging.progress_bar",
        "false",
    ]
    # One rank with one micro-batch of 16 vs two ranks with 8 each: z0 is the mean over the same 16 pairs.
    assert main([*common, "--train.output_dir", str(tmp_path / "one"), "--train.micro_batch_size", "16"]) == 0
    # The launch through torchrun leaves nothing in the temporary directory (it used to leave a
    # torchelastic_* folder per run).
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    assert (
        main(
            [
                *common,
                "--train.output_dir",
                str(tmp_path / "two"),
                "--train.micro_batch_size",
                "8",
                "--engine.backend",
                "fsdp2",
                "--engine.num_processes",
                "2",
            ]
        )
        == 0
    )
    assert list(temporary.iterdir()) == []
    one = [r for r in read_metrics(tmp_path / "one") if "train/loss" in r]
    two = [r for r in read_metrics(tmp_path / "two") if "train/loss" in r]
    assert len(one) == len(two) == 3
    assert one[-1]["train/kl"] > 0
    for a, b in zip(one, two):
        assert b["train/kl"] == pytest.approx(a["train/kl"], rel=1e-3, abs=1e-6)
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)


def _sft_base(tmp_path: Path, model_dir: Path) -> Path:
    """A policy that answers with three letters, mostly undesirable ones (70% of its training replies)."""
    rng = random.Random(2)
    rows = [letters_row(rng, desirable=rng.random() < 0.3) for _ in range(1500)]
    cfg = parse_config(
        SFTConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {
                "train": [str(write_jsonl(tmp_path / "sft.jsonl", rows))],
                "max_length": 64,
            },
            "optim": {"lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1},
            "train": {
                "output_dir": str(tmp_path / "sft"),
                "max_steps": 80,
                "global_batch_size": 32,
                "micro_batch_size": 32,
                "logging": {"progress_bar": False},
            },
        },
    )
    SFTTrainer(cfg).run()
    return tmp_path / "sft" / "final"


@pytest.mark.slow
def test_kto_moves_the_policy_toward_desirable_replies(tmp_path, tiny_model_dir):
    base = _sft_base(tmp_path, tiny_model_dir)
    rng = random.Random(3)
    held_out = [letters_row(rng, True)["prompt"] for _ in range(60)]
    scored = [(p, letters_row(rng, True)["completion"], letters_row(rng, False)["completion"]) for p in held_out]
    base_rate = sum(map(is_desirable, greedy_chat_answers(base, held_out, max_new_tokens=8))) / len(held_out)
    base_gap = preference_gap(base, scored)

    rows = [letters_row(rng, desirable=i % 2 == 0) for i in range(800)]
    out = tmp_path / "kto"
    cfg = kto_config(base, write_jsonl(tmp_path / "kto.jsonl", rows), out, max_steps=60)
    cfg.optim.warmup_steps = 5
    KTOTrainer(cfg).run()

    rate = sum(map(is_desirable, greedy_chat_answers(out / "final", held_out, max_new_tokens=8))) / len(held_out)
    gap = preference_gap(out / "final", scored)
    assert gap > base_gap + 2.0, (base_gap, gap)
    assert rate >= base_rate + 0.5, (base_rate, rate)
