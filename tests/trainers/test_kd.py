"""Distillation end to end: the reported divergence is the textbook one, and training shrinks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylign.cli.main import help_option, main
from raylign.config.base import describe_fields, parse_config
from raylign.config.commands import SFTConfig
from raylign.config.kd import KDConfig
from raylign.models.tiny import build_tiny_model
from raylign.tasks.evaluate import greedy_chat_answers
from raylign.tasks.strings import make_string_rows
from raylign.trainers.kd import KDTrainer
from raylign.trainers.metrics import read_metrics
from raylign.trainers.sft import SFTTrainer

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """A random model of another seed and size with the same (deterministically built) tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("student") / "model", hidden_size=32, num_layers=1, seed=1)


def kd_config(student, teacher, train_file, out, kd=None, **train) -> KDConfig:
    return parse_config(
        KDConfig,
        {
            "model": {"path": str(student), "dtype": "float32"},
            "teacher": {"path": str(teacher), "dtype": "float32"},
            "data": {"train": [str(train_file)], "max_length": 64},
            "kd": kd or {},
            "optim": {"lr": 3e-3, "weight_decay": 0.0},
            "train": {
                "output_dir": str(out),
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "logging": {"progress_bar": False},
                **train,
            },
        },
    )


# ---- an independent reference: full softmaxes at the reply tokens of chat-formatted rows ----


def _reply_positions_and_ids(tokenizer, row: dict) -> tuple[list[int], torch.Tensor]:
    """Ids of the rendered exchange and the positions whose logits predict reply tokens (reply + end of turn)."""
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
    )
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(row["completion"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    positions = list(range(len(prefix_ids) - 1, len(prefix_ids) + len(reply_ids) - 1))
    return positions, torch.tensor([prefix_ids + reply_ids + tokenizer("\n")["input_ids"]])


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def reference_divergence(kind: str, teacher_log: torch.Tensor, student_log: torch.Tensor, beta: float) -> torch.Tensor:
    if kind == "forward_kl":
        return _kl(teacher_log, student_log)
    if kind == "reverse_kl":
        return _kl(student_log, teacher_log)
    mixture = torch.log(beta * teacher_log.exp() + (1 - beta) * student_log.exp())
    return beta * _kl(teacher_log, mixture) + (1 - beta) * _kl(student_log, mixture)


@torch.no_grad()
def mean_divergence(teacher_dir, student_dir, rows, kind="forward_kl", temperature=1.0, beta=0.5) -> float:
    """Mean over all reply tokens of the rows of the divergence between the two next-token distributions."""
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    values = []
    for row in rows:
        positions, ids = _reply_positions_and_ids(tokenizer, row)
        t = torch.log_softmax(teacher(input_ids=ids).logits[0, positions] / temperature, -1)
        s = torch.log_softmax(student(input_ids=ids).logits[0, positions] / temperature, -1)
        values.append(reference_divergence(kind, t, s, beta))
    return float(torch.cat(values).mean())


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("forward_kl", {}),
        ("reverse_kl", {"temperature": 2.0}),
        ("generalized_jsd", {"beta": 0.3}),
    ],
)
def test_first_step_loss_is_the_divergence_over_reply_tokens(tmp_path, tiny_model_dir, student_dir, kind, options):
    rows = make_string_rows("copy", 8, seed=0)
    out = tmp_path / "run"
    cfg = kd_config(
        student_dir,
        tiny_model_dir,
        write_jsonl(tmp_path / "t.jsonl", rows),
        out,
        kd={"loss": kind, **options},
        max_steps=1,
        export=False,
    )
    KDTrainer(cfg).run()
    first = next(r for r in read_metrics(out) if "train/loss" in r)
    expected = mean_divergence(
        tiny_model_dir, student_dir, rows, kind, options.get("temperature", 1.0), options.get("beta", 0.5)
    )
    assert first["train/loss"] == pytest.approx(expected, rel=1e-4)
    assert first["train/divergence"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_fsdp2_ranks_with_a_sharded_teacher_the_first_loss_is_the_divergence(
    tmp_path, tiny_model_dir, student_dir
):
    """Each rank holds half of the teacher (engine.load_frozen) and half of the rows; the first step's
    loss is still the textbook divergence over all reply tokens."""
    rows = make_string_rows("copy", 8, seed=0)
    out = tmp_path / "run"
    cfg = kd_config(student_dir, tiny_model_dir, write_jsonl(tmp_path / "t.jsonl", rows), out, max_steps=1)
    config_file = tmp_path / "kd.yaml"
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    args = ["kd", "--config", str(config_file), "--train.export", "false", "--engine.backend", "fsdp2"]
    assert main([*args, "--engine.num_processes", "2"]) == 0
    first = next(r for r in read_metrics(out) if "train/loss" in r)
    assert first["train/loss"] == pytest.approx(mean_divergence(tiny_model_dir, student_dir, rows), rel=1e-4)


def test_kd_trains_the_student_and_exports_a_generating_model(tmp_path, tiny_model_dir, student_dir):
    rows = make_string_rows("copy", 8, seed=0)
    out = tmp_path / "run"
    cfg = kd_config(
        student_dir, tiny_model_dir, write_jsonl(tmp_path / "t.jsonl", rows), out, kd={"nll_coef": 0.1}, max_steps=6
    )
    KDTrainer(cfg).run()
    train = [r for r in read_metrics(out) if "train/loss" in r]
    losses = [r["train/loss"] for r in train]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    assert train[0]["train/loss"] == pytest.approx(train[0]["train/divergence"] + 0.1 * train[0]["train/nll"])

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    before = AutoModelForCausalLM.from_pretrained(student_dir)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert changed, "training did not change any parameter"
    assert len(greedy_chat_answers(out / "final", ["copy: a b"], max_new_tokens=4)) == 1


def test_a_teacher_with_another_tokenizer_is_refused_before_training(tmp_path, student_dir):
    teacher = build_tiny_model(tmp_path / "other", hidden_size=32, num_layers=1, vocab_size=300)
    rows = make_string_rows("copy", 8, seed=0)
    cfg = kd_config(student_dir, teacher, write_jsonl(tmp_path / "t.jsonl", rows), tmp_path / "run", max_steps=1)
    with pytest.raises(ValueError, match=r"teacher and student tokenizers differ.*student has \d+ tokens, teacher"):
        KDTrainer(cfg).run()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_help_describes_every_field(capsys):
    assert main(["kd", "--help"]) == 0
    text = capsys.readouterr().out
    for dotted, type_text, _, description in describe_fields(KDConfig):
        if type_text != "section":
            assert description and f"{help_option(dotted)}  (" in text and description in text, dotted


def test_example_config_runs(tmp_path, tiny_model_dir, student_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = [
        "kd",
        "--config",
        "examples/kd_tiny.yaml",
        "--model.path",
        str(student_dir),
        "--teacher.path",
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
def test_kd_lowers_the_student_teacher_divergence_on_held_out_rows(tmp_path, tiny_model_dir, student_dir):
    held_out = make_string_rows("reverse", 40, seed=1)
    train = make_string_rows("reverse", 600, seed=0, exclude={r["prompt"] for r in held_out})
    train_file = write_jsonl(tmp_path / "train.jsonl", train)
    # The teacher: the tiny model after a short SFT on the task, so its predictions are sharp.
    sft = parse_config(
        SFTConfig,
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "data": {"train": [str(train_file)], "max_length": 64},
            "optim": {"lr": 3e-3, "warmup_steps": 5},
            "train": {
                "output_dir": str(tmp_path / "teacher"),
                "max_steps": 60,
                "global_batch_size": 32,
                "micro_batch_size": 32,
                "logging": {"progress_bar": False},
            },
        },
    )
    SFTTrainer(sft).run()
    teacher = tmp_path / "teacher" / "final"
    before = mean_divergence(teacher, student_dir, held_out)

    out = tmp_path / "kd"
    KDTrainer(
        kd_config(student_dir, teacher, train_file, out, max_steps=60, global_batch_size=32, micro_batch_size=32)
    ).run()
    after = mean_divergence(teacher, out / "final", held_out)
    assert after < 0.5 * before, (before, after)
