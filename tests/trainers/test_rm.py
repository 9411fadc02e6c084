"""Reward-model training end to end on a tiny model: it learns, evaluates, stores its score statistics and exports."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from raylign.cli.main import main
from raylign.config.base import parse_config
from raylign.config.rm import RMConfig
from raylign.data import RowError
from raylign.data.preference import build_pair_datasets, collate_pairs
from raylign.models import load_score_model
from raylign.trainers.metrics import read_metrics
from raylign.trainers.rm import MEAN_KEY, STD_KEY, RMTrainer, last_token_scores, score_head

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ends_with_a_pairs(num_rows: int, seed: int, with_margin: bool = False) -> list[dict]:
    """Random letter replies; the chosen one ends with 'a', the rejected one with another letter."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        n = rng.randint(2, 4)
        body = [rng.choice("abcdefgh") for _ in range(n)]
        rejected = [rng.choice("abcdefgh") for _ in range(n)] + [rng.choice("bcdefgh")]
        row = {
            "prompt": "letters: " + " ".join(rng.choice("bcdefgh") for _ in range(3)),
            "chosen": " ".join(body + ["a"]),
            "rejected": " ".join(rejected),
        }
        if with_margin:
            row["margin"] = round(rng.uniform(0, 2), 2)
        rows.append(row)
    return rows


def rm_config(model_dir, train_file, out, eval_file=None, rm=None, **train) -> RMConfig:
    data = {"train": [str(train_file)], "format": "chat", "max_length": 64}
    if eval_file is not None:
        data["eval"] = [str(eval_file)]
    return parse_config(
        RMConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": data,
            "rm": rm or {},
            "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0},
            "train": {
                "output_dir": str(out),
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "logging": {"progress_bar": False},
                **train,
            },
        },
    )


@torch.no_grad()
def hf_scores(model_dir: Path, rows: list[dict], side: str) -> np.ndarray:
    """Each row's ``side`` scored by the exported model alone: HF's pooled logit of the rendered chat."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = []
    for row in rows:
        chat = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row[side]}]
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        scores.append(float(model(input_ids=ids).logits[0, 0]))
    return np.array(scores)


# --- a short run, checked several ways -----------------------------------------------------


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("rm_short")
    train_rows = ends_with_a_pairs(64, seed=0, with_margin=True)
    eval_rows = ends_with_a_pairs(12, seed=1, with_margin=True)
    cfg = rm_config(
        tiny_model_dir,
        write_jsonl(tmp / "train.jsonl", train_rows),
        tmp / "run",
        eval_file=write_jsonl(tmp / "eval.jsonl", eval_rows),
        rm={"margin_key": "margin"},
        max_steps=8,
    )
    final_metrics = RMTrainer(cfg).run()
    return {"out": tmp / "run", "train": train_rows, "eval": eval_rows, "final": final_metrics}


def test_rm_loss_is_finite_and_falls(short_run):
    losses = [r["train/loss"] for r in read_metrics(short_run["out"]) if "train/loss" in r]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_rm_export_holds_the_trained_backbone_and_the_score_head(short_run, tiny_model_dir):
    final = short_run["out"] / "final"
    weights = load_file(final / "model.safetensors")
    assert weights["score.weight"].shape[0] == 1
    model, info = AutoModelForSequenceClassification.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in model.model.named_parameters() if not torch.equal(p, base.model.get_parameter(n))]
    assert changed, "training did not change the backbone"
    assert np.isfinite(hf_scores(final, short_run["eval"][:2], "chosen")).all()


def test_rm_eval_metrics_with_margins_match_the_exported_model(short_run):
    final, rows = short_run["out"] / "final", short_run["eval"]
    chosen, rejected = hf_scores(final, rows, "chosen"), hf_scores(final, rows, "rejected")
    margins = torch.tensor([r["margin"] for r in rows], dtype=torch.float64)
    expected_loss = float(-F.logsigmoid(torch.from_numpy(chosen - rejected) - margins).mean())
    metrics = short_run["final"]
    assert metrics["eval/loss"] == pytest.approx(expected_loss, abs=1e-4)
    assert metrics["eval/accuracy"] == pytest.approx(float(np.mean(chosen > rejected)))
    assert metrics["eval/reward_margin"] == pytest.approx(float(np.mean(chosen - rejected)), abs=1e-4)


def test_rm_stores_the_mean_and_std_of_its_scores_on_the_train_set(short_run):
    final, rows = short_run["out"] / "final", short_run["train"]
    scores = np.concatenate([hf_scores(final, rows, "chosen"), hf_scores(final, rows, "rejected")])
    config = json.loads((final / "config.json").read_text())
    assert config[MEAN_KEY] == pytest.approx(float(scores.mean()), abs=1e-4)
    assert config[STD_KEY] == pytest.approx(float(scores.std()), abs=1e-4)


def test_stored_statistics_use_the_keys_the_rl_reward_source_reads():
    from raylign.rollout.rewards import reward_model

    assert (
        (MEAN_KEY, STD_KEY)
        == (reward_model.MEAN_KEY, reward_model.STD_KEY)
        == ("raylign_reward_mean", "raylign_reward_std")
    )


# --- scoring layout -------------------------------------------------------------------


def test_last_token_scores_of_padded_and_packed_batches_equal_each_sequence_alone(tmp_path, tiny_model_dir):
    from raylign.config.data import DataConfig
    from raylign.config.model import ModelConfig
    from raylign.models import load_tokenizer

    rows = ends_with_a_pairs(3, seed=5)
    tokenizer = load_tokenizer(tiny_model_dir)
    data = DataConfig(train=[str(write_jsonl(tmp_path / "p.jsonl", rows))], max_length=64)
    pairs = build_pair_datasets(data, tokenizer).train
    model = load_score_model(ModelConfig(path=str(tiny_model_dir), dtype="float32")).eval()
    with torch.no_grad():
        alone = [
            float(model(input_ids=torch.tensor([p.prompt_ids + ids])).logits[0, 0])
            for side in ("chosen_ids", "rejected_ids")
            for p in pairs
            for ids in [getattr(p, side)]
        ]
        for packed in (False, True):
            batch = collate_pairs(pairs, tokenizer.pad_token_id, packed=packed)
            got = last_token_scores(model, score_head(model), batch)
            torch.testing.assert_close(got, torch.tensor(alone), rtol=0, atol=1e-5)


# --- learning ---------------------------------------------------------------------------


@pytest.mark.slow
def test_rm_learns_to_prefer_replies_ending_with_a_on_held_out_pairs(tmp_path, tiny_model_dir):
    train_rows, held_out = ends_with_a_pairs(600, seed=0), ends_with_a_pairs(100, seed=1)
    cfg = rm_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", train_rows),
        tmp_path / "run",
        max_steps=80,
        global_batch_size=16,
        micro_batch_size=16,
    )
    RMTrainer(cfg).run()
    final = tmp_path / "run" / "final"
    accuracy = float(np.mean(hf_scores(final, held_out, "chosen") > hf_scores(final, held_out, "rejected")))
    assert accuracy >= 0.9, accuracy


# --- bad input and the command line ------------------------------------------------------


@pytest.mark.parametrize(
    "bad_row, message",
    [
        (
            {"prompt": "p", "chosen": "same", "rejected": "same"},
            "row 3, key 'rejected': 'chosen' and 'rejected' are identical",
        ),
        ({"prompt": "p", "chosen": "x"}, "row 3, key 'rejected': missing key"),
    ],
)
def test_bad_pair_stops_the_run_naming_the_row(tmp_path, tiny_model_dir, bad_row, message):
    rows = ends_with_a_pairs(2, seed=0) + [bad_row]
    cfg = rm_config(tiny_model_dir, write_jsonl(tmp_path / "train.jsonl", rows), tmp_path / "run", max_steps=1)
    with pytest.raises(RowError, match=message):
        RMTrainer(cfg).run()


def test_missing_margin_key_is_an_error_naming_the_row(tmp_path, tiny_model_dir):
    rows = ends_with_a_pairs(3, seed=0, with_margin=True)
    del rows[1]["margin"]
    cfg = rm_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", rows),
        tmp_path / "run",
        rm={"margin_key": "margin"},
        max_steps=1,
    )
    with pytest.raises(RowError, match="row 2, key 'margin': missing key"):
        RMTrainer(cfg).run()


def test_rm_example_config_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(
        [
            "rm",
            "--config",
            "examples/rm_tiny.yaml",
            "--model.path",
            str(tiny_model_dir),
            "--train.output_dir",
            str(tmp_path / "run"),
            "--train.max_steps",
            "3",
            "--train.logging.progress_bar",
            "false",
        ]
    )
    assert code == 0
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_rm_help_describes_every_field(capsys):
    assert main(["rm", "--help"]) == 0
    text = capsys.readouterr().out
    for field in ("--rm.loss", "--rm.margin_key", "--rm.center_coef", "--data.train", "--train.output_dir"):
        assert field in text
    blocks = text.split("\n  --")[1:]
    assert all("\n        " in block for block in blocks), "a field has no description"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_fsdp2_run_stores_statistics_of_all_train_pairs(tmp_path, tiny_model_dir):
    # 17 pairs over 2 ranks in batches of 4: the ranks hold 9 and 8, so their batch counts differ
    train_rows, eval_rows = ends_with_a_pairs(17, seed=0), ends_with_a_pairs(8, seed=1)
    train_file, eval_file = write_jsonl(tmp_path / "t.jsonl", train_rows), write_jsonl(tmp_path / "e.jsonl", eval_rows)
    out = tmp_path / "run"
    code = main(
        [
            "rm",
            "--model.path",
            str(tiny_model_dir),
            "--model.dtype",
            "float32",
            "--data.train",
            str(train_file),
            "--data.eval",
            str(eval_file),
            "--data.max_length",
            "64",
            "--train.output_dir",
            str(out),
            "--train.max_steps",
            "2",
            "--train.global_batch_size",
            "8",
            "--train.micro_batch_size",
            "4",
            "--train.eval_batch_size",
            "4",
            "--train.logging.progress_bar",
            "false",
            "--engine.backend",
            "fsdp2",
            "--engine.num_processes",
            "2",
        ]
    )
    assert code == 0
    scores = np.concatenate([hf_scores(out / "final", train_rows, side) for side in ("chosen", "rejected")])
    config = json.loads((out / "final" / "config.json").read_text())
    assert config[MEAN_KEY] == pytest.approx(float(scores.mean()), abs=1e-4)
    assert config[STD_KEY] == pytest.approx(float(scores.std()), abs=1e-4)
