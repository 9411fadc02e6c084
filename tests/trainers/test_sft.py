"""SFT end to end on a tiny model: it learns, logs, checkpoints, resumes exactly and exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from raylign.config.base import parse_config
from raylign.config.commands import SFTConfig
from raylign.engine.distributed import peak_memory_bytes
from raylign.tasks.evaluate import greedy_chat_answers
from raylign.tasks.strings import exact_match, make_string_rows
from raylign.trainers.metrics import read_metrics
from raylign.trainers.sft import SFTTrainer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_config(model_dir, train_file, out, **train) -> SFTConfig:
    return parse_config(
        SFTConfig,
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {"train": [str(train_file)], "format": "chat", "max_length": 64},
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


@pytest.mark.slow
def test_sft_learns_to_reverse_letters(tmp_path, tiny_model_dir):
    held_out = make_string_rows("reverse", 100, seed=1, alphabet="abcdefgh", min_len=3, max_len=4)
    train = make_string_rows(
        "reverse", 2000, seed=0, alphabet="abcdefgh", min_len=3, max_len=4, exclude={r["prompt"] for r in held_out}
    )
    cfg = sft_config(
        tiny_model_dir,
        write_jsonl(tmp_path / "train.jsonl", train),
        tmp_path / "run",
        max_steps=300,
        global_batch_size=32,
        micro_batch_size=32,
        seed=0,
    )
    cfg.optim.min_lr_ratio = 0.1
    cfg.optim.warmup_steps = 10
    SFTTrainer(cfg).run()

    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert losses[-1] < 0.3 * losses[0], (losses[0], losses[-1])
    replies = greedy_chat_answers(tmp_path / "run" / "final", [r["prompt"] for r in held_out])
    accuracy = sum(exact_match(p, r["completion"]) for p, r in zip(replies, held_out)) / len(held_out)
    # Chance of guessing a 3-4 letter reversal over 8 letters is below 1/8**3 < 0.2%.
    assert accuracy >= 0.5, accuracy


def test_sft_logs_metrics_writes_config_and_exports_a_loadable_model(tmp_path, tiny_model_dir):
    rows = make_string_rows("copy", 64, seed=0)
    out = tmp_path / "run"
    cfg = sft_config(tiny_model_dir, write_jsonl(tmp_path / "train.jsonl", rows), out, max_steps=3)
    SFTTrainer(cfg).run()

    assert parse_config(SFTConfig, __import__("yaml").safe_load((out / "config.yaml").read_text())) == cfg
    records = read_metrics(out)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in train), key
    # lr 3e-3 with 2 warmup steps over 3: the first step at half of it, the second at all of it, and the
    # cosine's first point (progress 0 of the one step after warmup) still at all of it.
    assert [r["train/lr"] for r in train] == pytest.approx([1.5e-3, 3e-3, 3e-3], rel=1e-12)
    # The process's peak resident memory so far (this process ran the training): it never shrinks, and no
    # step's figure exceeds the peak measured now.
    peaks = [r["train/peak_memory_gib"] for r in train]
    assert peaks == sorted(peaks) and 0 < peaks[-1] * (1 << 30) <= peak_memory_bytes(torch.device("cpu"))
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before.get_parameter(n))]
    assert changed, "training did not change any parameter"
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok("copy: a b", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


KILL_SCRIPT = textwrap.dedent("""
    import os, sys, yaml
    from raylign.config.base import parse_config
    from raylign.config.commands import SFTConfig
    from raylign.trainers.sft import SFTTrainer

    class DiesAfterLoggingPastCheckpoint(SFTTrainer):
        # saves the checkpoint of step N, trains and logs step N + 1, then crashes

        def save_checkpoint(self):
            super().save_checkpoint()
            if self.step == int(sys.argv[2]):
                log = self.metrics.log

                def log_then_die(metrics, step):
                    log(metrics, step)
                    if step > int(sys.argv[2]):
                        os._exit(17)  # a hard crash: no cleanup, no final save

                self.metrics.log = log_then_die

    cfg = parse_config(SFTConfig, yaml.safe_load(open(sys.argv[1])))
    DiesAfterLoggingPastCheckpoint(cfg).run()
""")


def tensorboard_steps(out: Path, tag: str) -> list[int]:
    """The steps of one scalar as TensorBoard shows it (purged events hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]


def test_run_killed_after_checkpoint_resumes_to_identical_weights(tmp_path, tiny_model_dir):
    rows = make_string_rows("reverse", 96, seed=0)
    train_file = write_jsonl(tmp_path / "train.jsonl", rows)
    straight = sft_config(tiny_model_dir, train_file, tmp_path / "straight", max_steps=6, save_every=3)
    SFTTrainer(straight).run()

    crashed = sft_config(tiny_model_dir, train_file, tmp_path / "crashed", max_steps=6, save_every=3)
    cfg_file = tmp_path / "crashed.yaml"
    cfg_file.write_text(__import__("yaml").safe_dump(crashed.model_dump(mode="json")))
    script = tmp_path / "dies.py"
    script.write_text(KILL_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(cfg_file), "3"], env=env, capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert not (tmp_path / "crashed" / "final").exists()

    logged_before = [r["step"] for r in read_metrics(tmp_path / "crashed") if "train/loss" in r]
    assert logged_before == [1, 2, 3, 4]  # step 4 was logged, its checkpoint never written

    # TensorBoard reads event files in name order, and a name carries the second it was opened in:
    # a real resume comes seconds later, this one could come within the same second.
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    SFTTrainer(crashed).run()  # resume picks step_3 and continues to step 6
    records = read_metrics(tmp_path / "crashed")
    resumed_steps = [r["step"] for r in records if "train/loss" in r]
    assert resumed_steps == [1, 2, 3, 4, 5, 6]  # each step once: the first step 4 was superseded
    assert [r["step"] for r in records if any(k.startswith("data/") for k in r)] == [0]
    superseded = [
        json.loads(line) for line in (tmp_path / "crashed" / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in superseded] == [4]
    assert tensorboard_steps(tmp_path / "crashed", "train/loss") == [1, 2, 3, 4, 5, 6]

    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-7, msg=name)
    losses_a = [r["train/loss"] for r in read_metrics(tmp_path / "straight") if "train/loss" in r]
    losses_b = [r["train/loss"] for r in read_metrics(tmp_path / "crashed") if "train/loss" in r]
    assert losses_b == pytest.approx(losses_a, rel=1e-6)


class NaNOnSteps(SFTTrainer):
    """SFT whose loss is NaN on the chosen (1-based) steps: a batch that blows up."""

    def __init__(self, cfg, nan_steps):
        super().__init__(cfg)
        self.nan_steps, self.weights_after = set(nan_steps), {}

    def compute_loss(self, model, batch):
        loss, stats = super().compute_loss(model, batch)
        return (loss * float("nan") if model.training and self.step + 1 in self.nan_steps else loss), stats

    def train_step(self, global_indices):
        metrics = super().train_step(global_indices)
        self.weights_after[self.step + 1] = {k: v.clone() for k, v in self.engine.module.state_dict().items()}
        return metrics


def test_a_step_with_a_non_finite_loss_is_skipped_and_the_run_goes_on(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 64, seed=0))
    trainer = NaNOnSteps(sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=4), nan_steps=[2])
    trainer.run()
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run") if "train/loss" in r}
    assert [rows[s]["train/skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 0.0]
    assert [rows[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for name, value in trainer.weights_after[2].items():  # step 2 changed nothing
        assert torch.equal(value, trainer.weights_after[1][name]), name
    assert not torch.equal(trainer.weights_after[3]["lm_head.weight"], trainer.weights_after[2]["lm_head.weight"])


def test_non_finite_steps_in_a_row_stop_the_run_naming_the_step_and_the_rows(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 64, seed=0))
    cfg = sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=6, max_skipped_steps=1)
    trainer = NaNOnSteps(cfg, nan_steps=[2, 3, 4])
    with pytest.raises(FloatingPointError) as err:
        trainer.run()
    message = str(err.value)
    assert message.startswith(f"step 3: loss nan in micro-batch 0 of rank 0 ({train_file} rows ")
    assert "2 step(s) in a row" in message and "train.max_skipped_steps = 1" in message
    for name, value in trainer.engine.module.state_dict().items():  # the weights are those of step 1
        assert torch.equal(value, trainer.weights_after[1][name]), name


class RecordsModelLoads(SFTTrainer):
    loaded = 0

    def build_model(self):
        self.loaded += 1
        return super().build_model()


def test_a_warm_up_longer_than_the_run_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 64, seed=0))
    trainer = RecordsModelLoads(sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=1))  # warm-up 2
    with pytest.raises(ValueError, match=r"optim.warmup_steps=2 exceeds the run's total_steps=1"):
        trainer.run()
    assert trainer.loaded == 0  # a large model's load would have been wasted


def test_a_batch_larger_than_the_data_names_the_setting_whether_steps_are_given_or_counted(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 5, seed=0))
    for steps in ({"max_steps": 3}, {"epochs": 1.0}):
        cfg = sft_config(tiny_model_dir, train_file, tmp_path / "run", **steps)
        with pytest.raises(
            ValueError, match=r"train.global_batch_size \(8\) is larger than the training set \(5 samples\)"
        ):
            SFTTrainer(cfg).run()


@pytest.mark.parametrize("packed", [True, False])
def test_loss_runs_the_output_layer_at_the_trained_tokens_only(tiny_model_dir, packed):
    """Two samples of 7 and 4 tokens whose last 3 and 2 tokens are trained: the output layer computes 5
    rows, and the loss is minus the sum of those 5 tokens' log-probs from a plain full forward."""
    from raylign.data import collate_packed, collate_padded
    from raylign.data.sft import Sample

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = [[5, 9, 14, 3, 27, 8, 41], [12, 6, 30, 7]]
    samples = [Sample(s, [0] * (len(s) - n) + [1] * n, "test", 1) for s, n in zip(ids, [3, 2], strict=True)]
    batch = collate_packed(samples, 0) if packed else collate_padded(samples, 0)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[-2]))
    trainer = SFTTrainer.__new__(SFTTrainer)
    loss, _ = trainer.compute_loss(model, batch)
    hook.remove()
    assert rows == [5]
    expected = 0.0
    for s, n in zip(ids, [3, 2], strict=True):
        with torch.no_grad():
            log_p = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0].double(), -1)
        expected -= sum(float(log_p[t - 1, s[t]]) for t in range(len(s) - n, len(s)))
    assert float(loss) == pytest.approx(expected, abs=1e-4)


def test_a_run_of_another_model_in_a_folder_with_checkpoints_is_refused_before_it_writes(tmp_path, tiny_model_dir):
    import shutil

    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("reverse", 16, seed=0))
    SFTTrainer(sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=2)).run()
    saved_config = (tmp_path / "run" / "config.yaml").read_text()
    other = shutil.copytree(tiny_model_dir, tmp_path / "other-model")
    # It would resume the first run's weights and never load other-model: refused, and the first
    # run's config is left as it was.
    with pytest.raises(ValueError, match=r"holds checkpoints of a run of the model .*tiny.*other-model.*train.resume"):
        SFTTrainer(sft_config(other, train_file, tmp_path / "run", max_steps=3)).run()
    assert (tmp_path / "run" / "config.yaml").read_text() == saved_config
    # The same model goes on from the checkpoint; another one starts over with train.resume false.
    SFTTrainer(sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=3)).run()
    SFTTrainer(sft_config(other, train_file, tmp_path / "run", max_steps=2, resume=False)).run()
    # The runs before it are set aside: its own records only, each step once.
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "data/rows_read" in r] == [0]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    aside = (tmp_path / "run" / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside if "train/loss" in json.loads(line)] == [1, 2, 3]


def test_tokens_per_s_counts_the_samples_tokens_not_the_padding_of_packed_rows(tmp_path, tiny_model_dir):
    # Eight samples of one length n; rows of 3n tokens hold three, so each micro-batch of four makes
    # a full row and one padded to 3n: 2n padding tokens per micro-batch that are not the data's.
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("copy", 8, seed=0, min_len=4, max_len=4))
    probe = SFTTrainer(sft_config(tiny_model_dir, train_file, tmp_path / "probe", max_steps=2))
    probe.setup()
    (n,) = {sample.num_tokens for sample in probe.train_samples}
    cfg = sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=2)
    SFTTrainer(cfg.model_copy(update={"data": cfg.data.model_copy(update={"pack_row_tokens": 3 * n})})).run()
    records = [r for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(records) == 2
    for record in records:
        assert record["train/tokens_per_s"] * record["train/step_time_s"] == pytest.approx(8 * n, rel=1e-9)


def test_a_finished_run_started_again_logs_its_final_evaluation_once(tmp_path, tiny_model_dir):
    train_file = write_jsonl(tmp_path / "train.jsonl", make_string_rows("copy", 40, seed=0))
    cfg = sft_config(tiny_model_dir, train_file, tmp_path / "run", max_steps=2)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_fraction": 0.2})})
    SFTTrainer(cfg).run()
    before = read_metrics(tmp_path / "run")
    assert [r["step"] for r in before if "eval/loss" in r] == [2]
    SFTTrainer(cfg).run()  # resumes at step 2 of 2: nothing to train, the final evaluation again
    after = read_metrics(tmp_path / "run")
    assert [r["step"] for r in after if "eval/loss" in r] == [2]
    assert [r["step"] for r in after if "train/loss" in r] == [1, 2]
    aside = (tmp_path / "run" / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside] == [2]
