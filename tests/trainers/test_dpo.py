"""DPO-family training end to end on a tiny model: closed-form first steps, learning, reference handling, export."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylign.algorithms import PREFERENCE_LOSSES
from raylign.cli.main import main
from raylign.config.base import ConfigError, parse_config
from raylign.config.dpo import REFERENCE_FREE_LOSSES, DPOConfig
from raylign.data import RowError
from raylign.models.tiny import build_tiny_model
from raylign.tasks.evaluate import greedy_chat_answers
from raylign.trainers.dpo import DPOTrainer
from raylign.trainers.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
LN2 = math.log(2.0)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def all_a_pairs(num_rows: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """The chosen reply is as many 'a' letters as the prompt has letters; the rejected one repeats the prompt's."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude)
    while len(rows) < num_rows:
        letters = [rng.choice("bcdefgh") for _ in range(rng.randint(2, 4))]
        prompt = "reply to: " + " ".join(letters)
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "chosen": " ".join("a" * len(letters)), "rejected": " ".join(letters)})
    return rows


def dpo_config(model_dir, train_file, out, dpo=None, eval_file=None, data=None, **train) -> DPOConfig:
    data_section = {
        "train": [str(train_file)],
        "format": "chat",
        "max_length": 64,
        **(data or {}),
    }
    if eval_file is not None:
        data_section["eval"] = [str(eval_file)]
    return parse_config(
        DPOConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": data_section,
            "dpo": dpo or {},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0},
            "train": {
                "output_dir": str(out),
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "logging": {"progress_bar": False},
                **train,
            },
        },
    )


def train_losses(out: Path) -> list[float]:
    return [r["train/loss"] for r in read_metrics(out) if "train/loss" in r]


@torch.no_grad()
def reply_logps(model_dir: Path, rows: list[dict], side: str) -> tuple[np.ndarray, np.ndarray]:
    """(sum, token count) of log p(reply + end-of-turn | prompt) under the model in ``model_dir``, one row at a time."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums, counts = [], []
    for row in rows:
        user = [{"role": "user", "content": row["prompt"]}]
        prompt = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True)
        whole = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": row[side]}], tokenize=True, return_dict=True
        )["input_ids"]
        end = len(whole) - 1 - whole[::-1].index(tokenizer.eos_token_id)  # the reply's <|im_end|>
        targets = torch.tensor(whole[len(prompt["input_ids"]) : end + 1])
        logits = model(input_ids=torch.tensor([whole])).logits[0, len(prompt["input_ids"]) - 1 : end]
        sums.append(float(torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum()))
        counts.append(len(targets))
    return np.array(sums), np.array(counts)


# --- a short run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("dpo_short")
    cfg = dpo_config(
        tiny_model_dir, write_jsonl(tmp / "train.jsonl", all_a_pairs(64, seed=0)), tmp / "run", max_steps=8
    )
    DPOTrainer(cfg).run()
    return tmp / "run"


def test_dpo_loss_starts_at_ln2_is_finite_and_falls(short_run):
    losses = train_losses(short_run)
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert losses[0] == pytest.approx(LN2, abs=1e-5)  # policy == reference at the first step
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_dpo_export_changes_the_weights_and_generates(short_run, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(short_run / "final")
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert changed, "training did not change any parameter"
    tok = AutoTokenizer.from_pretrained(short_run / "final")
    ids = tok("reply to: b c", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


# --- first steps in closed form -----------------------------------------------------------


@pytest.fixture(scope="module")
def eight_pairs(tmp_path_factory):
    """Exactly one global batch, so the first step's loss covers every row."""
    rows = all_a_pairs(8, seed=3)
    return rows, write_jsonl(tmp_path_factory.mktemp("eight") / "pairs.jsonl", rows)


def first_step(tiny_model_dir, train_file, out, dpo, data=None) -> tuple[float, DPOTrainer]:
    cfg = dpo_config(tiny_model_dir, train_file, out, dpo=dpo, data=data, max_steps=1, export=False)
    trainer = DPOTrainer(cfg)
    trainer.run()
    return train_losses(out)[0], trainer


@pytest.fixture(scope="module")
def other_reference_dir(tmp_path_factory) -> Path:
    """A reference model unlike the policy (other random weights, same tokenizer)."""
    return build_tiny_model(tmp_path_factory.mktemp("other_ref") / "model", hidden_size=64, num_layers=2, seed=7)


@pytest.mark.parametrize("packing", [True, False])
def test_precomputed_reference_gives_the_live_reference_first_step_loss(tmp_path, tiny_model_dir, eight_pairs, packing):
    _, train_file = eight_pairs
    data = {"packing": packing}
    live, live_trainer = first_step(tiny_model_dir, train_file, tmp_path / "live", {}, data)
    pre, pre_trainer = first_step(tiny_model_dir, train_file, tmp_path / "pre", {"precompute_reference": True}, data)
    assert live_trainer.reference is not None
    assert pre_trainer.reference is None  # freed after the first pass
    assert pre == pytest.approx(live, abs=1e-5)
    assert live == pytest.approx(LN2, abs=1e-5)  # policy == reference at the first step


def test_precomputed_and_live_losses_agree_with_a_different_reference_model(
    tmp_path, tiny_model_dir, eight_pairs, other_reference_dir
):
    _, train_file = eight_pairs
    ref = {"reference_path": str(other_reference_dir)}
    live, _ = first_step(tiny_model_dir, train_file, tmp_path / "live", ref)
    pre, _ = first_step(tiny_model_dir, train_file, tmp_path / "pre", {**ref, "precompute_reference": True})
    assert abs(live - LN2) > 1e-3  # the reference differs from the policy, so the log-ratios are not 0
    assert pre == pytest.approx(live, abs=1e-5)


def test_ipo_and_cdpo_first_steps_match_their_closed_forms(tmp_path, tiny_model_dir, eight_pairs):
    _, train_file = eight_pairs
    ipo, _ = first_step(tiny_model_dir, train_file, tmp_path / "ipo", {"loss": "ipo", "beta": 0.25})
    assert ipo == pytest.approx((0 - 1 / (2 * 0.25)) ** 2, abs=1e-5)  # (h - 1/(2 tau))^2 with h = 0
    cdpo, _ = first_step(tiny_model_dir, train_file, tmp_path / "cdpo", {"loss": "cdpo", "label_smoothing": 0.2})
    assert cdpo == pytest.approx(LN2, abs=1e-5)  # -(1-eps) log sigma(0) - eps log sigma(0)


def test_dpo_nll_first_step_adds_the_chosen_per_token_nll(tmp_path, tiny_model_dir, eight_pairs):
    rows, train_file = eight_pairs
    loss, _ = first_step(tiny_model_dir, train_file, tmp_path / "run", {"loss": "dpo_nll", "nll_coef": 0.5})
    sums, counts = reply_logps(tiny_model_dir, rows, "chosen")
    assert loss == pytest.approx(LN2 + 0.5 * float(np.mean(-sums / counts)), abs=1e-4)


def test_simpo_first_step_matches_an_independent_computation_without_a_reference(tmp_path, tiny_model_dir, eight_pairs):
    rows, train_file = eight_pairs
    loss, trainer = first_step(
        tiny_model_dir, train_file, tmp_path / "run", {"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.3}
    )
    assert trainer.reference is None
    (c_sum, c_n), (r_sum, r_n) = (reply_logps(tiny_model_dir, rows, side) for side in ("chosen", "rejected"))
    logits = torch.tensor(2.0 * (c_sum / c_n - r_sum / r_n) - 0.3)
    assert loss == pytest.approx(float(-F.logsigmoid(logits).mean()), abs=1e-4)


def test_orpo_first_step_matches_an_independent_computation_without_a_reference(tmp_path, tiny_model_dir, eight_pairs):
    rows, train_file = eight_pairs
    loss, trainer = first_step(tiny_model_dir, train_file, tmp_path / "run", {"loss": "orpo", "orpo_lambda": 0.5})
    assert trainer.reference is None
    (c_sum, c_n), (r_sum, r_n) = (reply_logps(tiny_model_dir, rows, side) for side in ("chosen", "rejected"))
    chosen, rejected = c_sum / c_n, r_sum / r_n
    log_odds = (chosen - np.log1p(-np.exp(chosen))) - (rejected - np.log1p(-np.exp(rejected)))
    expected = np.mean(-chosen) - 0.5 * np.mean(-np.logaddexp(0.0, -log_odds))
    assert loss == pytest.approx(float(expected), abs=1e-4)


def test_config_reference_free_losses_match_the_loss_registry():
    for name in ("dpo", "cdpo", "ipo", "dpo_nll", "simpo", "orpo"):
        uses_reference = PREFERENCE_LOSSES.metadata(name)["uses_reference"]
        assert uses_reference == (name not in REFERENCE_FREE_LOSSES), name


@pytest.mark.parametrize(
    "dpo, message",
    [
        ({"loss": "dpo", "simpo_gamma": 0.5}, "simpo_gamma does not apply to loss 'dpo'"),
        ({"loss": "orpo", "beta": 0.1}, "beta does not apply to loss 'orpo'"),
        ({"loss": "simpo", "precompute_reference": True}, "precompute_reference does not apply to loss 'simpo'"),
    ],
)
def test_options_of_another_loss_are_config_errors(tiny_model_dir, dpo, message):
    with pytest.raises(ConfigError, match=message):
        dpo_config(tiny_model_dir, "train.jsonl", "out", dpo=dpo)


# --- learning ---------------------------------------------------------------------------


def all_a_rate(replies: list[str]) -> float:
    """Share of replies made only of the letter 'a'."""
    return sum(bool(r.split()) and set(r.split()) == {"a"} for r in replies) / len(replies)


@pytest.mark.slow
def test_dpo_raises_the_held_out_margin_and_moves_greedy_replies_to_the_preferred_kind(tmp_path, tiny_model_dir):
    held_out = all_a_pairs(50, seed=1)
    train = all_a_pairs(600, seed=0, exclude={r["prompt"] for r in held_out})
    prompts = [r["prompt"] for r in held_out]
    base_rate = all_a_rate(greedy_chat_answers(tiny_model_dir, prompts, max_new_tokens=8))
    margin_before = (
        reply_logps(tiny_model_dir, held_out, "chosen")[0] - reply_logps(tiny_model_dir, held_out, "rejected")[0]
    )
    cfg = dpo_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", train),
        tmp_path / "run",
        dpo={"precompute_reference": True},
        max_steps=40,
        global_batch_size=16,
        micro_batch_size=16,
    )
    DPOTrainer(cfg).run()
    final = tmp_path / "run" / "final"
    margin_after = reply_logps(final, held_out, "chosen")[0] - reply_logps(final, held_out, "rejected")[0]
    assert margin_after.mean() > margin_before.mean() + 5.0, (margin_before.mean(), margin_after.mean())
    rate = all_a_rate(greedy_chat_answers(final, prompts, max_new_tokens=8))
    assert rate >= max(0.8, base_rate + 0.5), (base_rate, rate)


# --- bad input, the command line, several ranks -------------------------------------------


@pytest.mark.parametrize(
    "bad_row, message",
    [
        (
            {"prompt": "p", "chosen": "same", "rejected": "same"},
            "row 2, key 'rejected': 'chosen' and 'rejected' are identical",
        ),
        ({"chosen": "x", "rejected": "y"}, "row 2, key 'prompt': missing key"),
    ],
)
def test_bad_pair_stops_the_run_naming_the_row(tmp_path, tiny_model_dir, bad_row, message):
    rows = all_a_pairs(1, seed=0) + [bad_row]
    cfg = dpo_config(tiny_model_dir, write_jsonl(tmp_path / "train.jsonl", rows), tmp_path / "run", max_steps=1)
    with pytest.raises(RowError, match=message):
        DPOTrainer(cfg).run()


def test_dpo_example_config_runs(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(REPO)
    code = main(
        [
            "dpo",
            "--config",
            "examples/dpo_tiny.yaml",
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
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_dpo_help_describes_every_field(capsys):
    assert main(["dpo", "--help"]) == 0
    text = capsys.readouterr().out
    for field in (
        "--dpo.loss",
        "--dpo.beta",
        "--dpo.label_smoothing",
        "--dpo.simpo_gamma",
        "--dpo.nll_coef",
        "--dpo.orpo_lambda",
        "--dpo.reference_path",
        "--dpo.precompute_reference",
    ):
        assert field in text
    blocks = text.split("\n  --")[1:]
    assert all("\n        " in block for block in blocks), "a field has no description"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("precompute", ["true", "false"], ids=["precomputed", "live-sharded"])
def test_two_ranks_make_a_single_processs_first_loss(
    precompute, tmp_path, tiny_model_dir, eight_pairs, other_reference_dir
):
    # precomputed: each rank computes the reference for half of the pairs and the ranks share them;
    # live: the reference is sharded over the two ranks like the policy (engine.load_frozen). Either
    # way the first step's loss equals a single process's with a whole live reference.
    _, train_file = eight_pairs
    ref = {"reference_path": str(other_reference_dir)}
    single, _ = first_step(tiny_model_dir, train_file, tmp_path / "single", ref)
    out = tmp_path / "run"
    code = main(
        [
            "dpo",
            "--model.path",
            str(tiny_model_dir),
            "--model.dtype",
            "float32",
            "--data.train",
            str(train_file),
            "--data.max_length",
            "64",
            "--dpo.reference_path",
            str(other_reference_dir),
            "--dpo.precompute_reference",
            precompute,
            "--train.output_dir",
            str(out),
            "--train.max_steps",
            "2",
            "--optim.lr",
            "1e-3",
            "--train.global_batch_size",
            "8",
            "--train.micro_batch_size",
            "2",
            "--train.eval_batch_size",
            "2",
            "--train.logging.progress_bar",
            "false",
            "--engine.backend",
            "fsdp2",
            "--engine.num_processes",
            "2",
        ]
    )
    assert code == 0
    losses = train_losses(out)
    assert losses[0] == pytest.approx(single, abs=1e-5)
    assert AutoModelForCausalLM.from_pretrained(out / "final") is not None


def test_a_diagnostic_names_the_file_rows_of_pairs_with_precomputed_reference_log_probs():
    from types import SimpleNamespace

    from raylign.data.preference import PairSample
    from raylign.trainers.dpo import ReferencedPair
    from raylign.trainers.loop import OfflineTrainer

    pairs = [PairSample([1], [2], [1], [3], [1], "data/pairs.jsonl", row) for row in (7, 9)]
    trainer = SimpleNamespace(train_samples=[ReferencedPair(p, -1.0, -2.0) for p in pairs])
    assert OfflineTrainer._describe(trainer, [0, 1]) == "data/pairs.jsonl rows 7, 9"
