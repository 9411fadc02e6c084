"""Process reward model end to end: it trains, saves a reloadable scorer and finds wrong steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from raylign.cli.main import help_option, main
from raylign.config.base import ConfigError, describe_fields, parse_config
from raylign.config.prm import PRMConfig
from raylign.data import RowError
from raylign.models.heads import token_scores
from raylign.models.tiny import build_tiny_model
from raylign.trainers.metrics import read_metrics
from raylign.trainers.prm import PRMTrainer, load_prm, score_steps

REPO = Path(__file__).resolve().parents[2]
SEP = "<|step|>"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic_step(value: int, wrong: bool, rng: random.Random) -> tuple[str, int]:
    """'a+b=c' or 'a-b=c' on single digits; a wrong step shows a result off by 1 or 2."""
    op = rng.choice([op for op in "+-" if (value < 9 if op == "+" else value > 0)])
    operand = rng.randint(1, 9 - value if op == "+" else value)
    result = value + operand if op == "+" else value - operand
    if wrong:
        result = rng.choice([r for r in range(result - 2, result + 3) if r != result and 0 <= r <= 9])
    return f"{value}{op}{operand}={result}", result


def arithmetic_chain(rng: random.Random, num_steps: int = 4) -> dict:
    """A chain whose first wrong step is uniform over the steps and 'none'; each step is labelled by its
    own correctness and the next step continues from the written result."""
    value, first_wrong = rng.randint(0, 9), rng.randint(0, num_steps)
    steps, labels = [], []
    for k in range(num_steps):
        wrong = k == first_wrong or (k > first_wrong and rng.random() < 0.3)
        step, value = arithmetic_step(value, wrong, rng)
        steps.append(step)
        labels.append(not wrong)
    return {"prompt": "check", "steps": steps, "labels": labels}


def first_wrong(correct: list[bool]) -> int | None:
    return next((k for k, ok in enumerate(correct) if not ok), None)


def prm_config(model_dir, train_file, out, data=None, prm=None, **train) -> PRMConfig:
    return parse_config(
        PRMConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {
                "train": [str(train_file)],
                "format": "plain",
                "max_length": 64,
                **(data or {}),
            },
            "prm": {"step_separator": SEP, **(prm or {})},
            "optim": {"lr": 2e-3, "weight_decay": 0.0},
            "train": {
                "output_dir": str(out),
                "global_batch_size": 16,
                "micro_batch_size": 8,
                "logging": {"progress_bar": False},
                **train,
            },
        },
    )


def test_prm_trains_and_saves_a_scorer_that_reloads(tmp_path, tiny_model_dir):
    rng = random.Random(0)
    train_file = write_jsonl(tmp_path / "train.jsonl", [arithmetic_chain(rng) for _ in range(16)])
    out = tmp_path / "run"
    # One global batch is the whole set, so every step sees the same data and the loss must fall.
    PRMTrainer(prm_config(tiny_model_dir, train_file, out, max_steps=8)).run()

    train = [r for r in read_metrics(out) if "train/loss" in r]
    losses = [r["train/loss"] for r in train]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    assert all(0 <= r["train/step_accuracy"] <= 1 for r in train)

    model, tokenizer = load_prm(out / "final")
    separator_id = tokenizer.convert_tokens_to_ids(SEP)
    assert tokenizer.encode(f"1{SEP}2", add_special_tokens=False).count(separator_id) == 1
    before = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    layer = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(model.get_parameter(layer), before.get_parameter(layer))
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)

    steps = ["3+4=7", "7-2=1"]
    scores = score_steps(model, tokenizer, "check", steps)
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)
    # The plain HF folder agrees: its pooled logits are read at the last token, the last separator.
    hf_model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out / "final")
    ids = hf_tokenizer("check\n3+4=7" + SEP + "7-2=1" + SEP, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected_last = torch.softmax(hf_model(input_ids=ids).logits[0], -1)[1].item()
    assert scores[1] == pytest.approx(expected_last, abs=1e-5)


class FirstLossByHand(PRMTrainer):
    """The real trainer; once set up, it works out by hand the soft cross-entropy of its first row at its
    step separators, from the initial model's two class scores there."""

    hand_first_loss: float

    def setup(self) -> None:
        super().setup()
        sample = self.train_samples[0]
        ids = torch.tensor([sample.input_ids])
        separator = self.tokenizer.convert_tokens_to_ids(SEP)
        at = (ids[0] == separator).nonzero().flatten()
        with torch.no_grad():
            log_p = torch.log_softmax(token_scores(self.engine.module, ids)[0, at].double(), -1)
        q = torch.tensor(sample.step_labels, dtype=torch.float64)
        assert len(at) == len(q) == 2
        self.hand_first_loss = float(-(q * log_p[:, 1] + (1 - q) * log_p[:, 0]).mean())


def test_soft_labels_and_padded_batches_train(tmp_path, tiny_model_dir):
    rows = [{"prompt": "p", "steps": ["1+1=2", "2+2=5"], "labels": [0.9, 0.2]}] * 8
    out = tmp_path / "run"
    cfg = prm_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "soft.jsonl", rows),
        out,
        data={"packing": False},
        prm={"label_type": "soft"},
        max_steps=6,
        global_batch_size=8,
        micro_batch_size=4,
        export=False,
    )
    cfg.optim.lr = 1e-4
    trainer = FirstLossByHand(cfg)
    trainer.run()
    losses = [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]
    # Every row is the same: step 1's loss (before its update) is one row's, worked out by hand.
    assert losses[0] == pytest.approx(trainer.hand_first_loss, rel=1e-5)
    # Cross-entropy against soft targets is bounded below by their entropy, never by 0.
    entropy = -sum(q * torch.log(torch.tensor(q)) + (1 - q) * torch.log(torch.tensor(1 - q)) for q in (0.9, 0.2)) / 2
    assert all(loss >= float(entropy) - 1e-4 for loss in losses)
    assert losses[-1] < losses[0]


def test_a_row_with_more_steps_than_labels_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    rows = [
        {"prompt": "p", "steps": ["1+1=2"], "labels": [True]},
        {"prompt": "p", "steps": ["1+1=2", "2+2=4"], "labels": [True]},
    ]
    train_file = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(RowError, match=rf"{train_file}, row 2, key 'labels': 1 labels for 2 steps"):
        PRMTrainer(prm_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=1)).run()


def test_full_loss_is_rejected_for_a_prm(tmp_path):
    with pytest.raises(ConfigError, match="data.loss 'full' does not apply"):
        parse_config(PRMConfig, {"model": {"path": "m"}, "data": {"train": ["t.jsonl"], "loss": "full"}})


def test_help_describes_every_field(capsys):
    assert main(["prm", "--help"]) == 0
    text = capsys.readouterr().out
    for dotted, type_text, _, description in describe_fields(PRMConfig):
        if type_text != "section":
            assert description and f"{help_option(dotted)}  (" in text and description in text, dotted


def test_example_config_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        "prm",
        "--config",
        "examples/prm_tiny.yaml",
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
def test_prm_finds_the_first_wrong_step_of_held_out_chains(tmp_path):
    # A step is judged by four tokens at fixed offsets before its separator, and 8 heads find them
    # sooner than 4: held-out accuracy after 500 steps 0.80-0.975 over five seeds (4 heads: 0.6-0.9).
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=8)
    rng = random.Random(0)
    train = [arithmetic_chain(rng) for _ in range(4000)]
    held_out = [arithmetic_chain(rng) for _ in range(200)]
    out = tmp_path / "run"
    # Every chain is 29 tokens long, so padded batches hold no padding (and packed rows, as long as
    # the longest chain, would hold one chain each). Packed PRM batches are covered by the tests
    # above, tests/data/test_row_packing.py and tests/models/test_heads.py.
    cfg = prm_config(
        model_dir,
        write_jsonl(tmp_path / "train.jsonl", train),
        out,
        data={"packing": False},
        max_steps=500,
        global_batch_size=32,
        micro_batch_size=32,
        seed=0,
    )
    cfg.optim.warmup_steps = 20
    cfg.optim.min_lr_ratio = 0.1
    PRMTrainer(cfg).run()

    model, tokenizer = load_prm(out / "final")
    predicted = [
        first_wrong([s >= 0.5 for s in score_steps(model, tokenizer, r["prompt"], r["steps"])]) for r in held_out
    ]
    truth = [first_wrong(r["labels"]) for r in held_out]
    accuracy = sum(p == t for p, t in zip(predicted, truth)) / len(held_out)
    # Chance: the best constant guess of the first wrong step (index or None), from the training labels.
    outcomes = [first_wrong(r["labels"]) for r in train]
    chance = max(outcomes.count(o) for o in set(outcomes)) / len(outcomes)
    assert chance < 0.25
    assert accuracy >= max(0.5, 2.5 * chance), (accuracy, chance)


@pytest.mark.parametrize("spare_rows", [0, 16], ids=["rows_as_tokens", "spare_rows"])
def test_an_added_separator_starts_as_the_newline_embedding_even_in_a_spare_row(spare_rows):
    # Qwen2 checkpoints have more embedding rows than tokens: the added separator then takes a spare
    # row instead of a new one, and must start from the newline's embedding all the same.
    from transformers import AutoConfig

    from raylign.data.prm import add_step_separator
    from raylign.models.tiny import build_tiny_tokenizer
    from raylign.trainers.prm import fit_embeddings_to_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer) + spare_rows,
        num_labels=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    before = model.get_input_embeddings().weight.detach().clone()
    tokens = len(tokenizer)
    separator = add_step_separator(tokenizer, "<|step|>")
    assert separator == tokens  # a new token
    fit_embeddings_to_tokenizer(model, tokenizer, [separator])
    weight = model.get_input_embeddings().weight.detach()
    assert weight.shape[0] == max(tokens + 1, before.shape[0])
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert torch.equal(weight[separator], before[newline])
    assert torch.equal(weight[:tokens], before[:tokens])  # every other token's row as it was
