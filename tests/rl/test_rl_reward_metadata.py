"""A prompt row's fields beyond its prompt and label reach the RL run's reward functions as metadata
columns, as they do in ``raylign score``: a reward can read a row's test cases, difficulty or tags."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest

from raylign.config.rl import RLDataConfig
from raylign.data.errors import RowError
from raylign.models.loading import load_tokenizer
from raylign.rl.prompts import load_prompts
from raylign.rl.stream import sample_from
from raylign.rl.trainer import RLTrainer
from raylign.rollout.base import Completion
from raylign.rollout.rewards import PythonFileReward

REWARD = """
def reward_func(prompts, responses, labels, difficulty, source, **metadata):
    # the row's difficulty, and which keys arrived
    return {"rewards": [float(d) for d in difficulty], "keys": [float(len(metadata)) for _ in prompts]}

def names(prompts, responses, labels, **metadata):
    import json, os
    with open(os.environ["RAYLIGN_TEST_KEYS"], "w") as f:
        json.dump(metadata, f)
    return [0.0] * len(prompts)
"""


def test_a_rows_other_fields_reach_the_reward_function(rl_model_dir, tmp_path, monkeypatch):
    rows = [
        {"prompt": "abc", "label": "abc", "difficulty": 3, "tags": ["easy"]},
        {"prompt": "de", "label": "de", "difficulty": 7, "source": "set_b"},
    ]
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(textwrap.dedent(REWARD))
    data_cfg = RLDataConfig(train=[{"path": str(data_file)}])
    prompts = load_prompts(data_cfg.train, data_cfg, load_tokenizer(str(rl_model_dir)))
    samples = [sample_from(Completion(i, 0, p.token_ids, [5], [-0.1], "stop", "x"), p) for i, p in enumerate(prompts)]

    keys_file = tmp_path / "keys.json"
    monkeypatch.setenv("RAYLIGN_TEST_KEYS", str(keys_file))
    with PythonFileReward(reward_file, function_name="names", num_workers=1, timeout_s=60) as source:
        RLTrainer.score(SimpleNamespace(reward=source), samples)
    assert json.loads(keys_file.read_text()) == {
        "source": ["prompts", "set_b"],  # the prompt file's name, or the row's own "source" field
        "difficulty": [3, 7],
        "tags": [["easy"], None],  # None where a row lacks the field
    }
    with PythonFileReward(reward_file, num_workers=1, timeout_s=60) as source:
        RLTrainer.score(SimpleNamespace(reward=source), samples)
    assert [s.reward for s in samples] == [3.0, 7.0]
    assert [s.reward_metrics["keys"] for s in samples] == [1.0, 1.0]  # tags, beside the named difficulty and source


def test_a_row_field_named_like_a_reward_functions_own_argument_is_refused_at_load(rl_model_dir, tmp_path):
    # Passed by keyword beside prompts/responses/labels it would clash at the first scoring, mid-run.
    rows = [{"prompt": "abc", "label": "abc"}, {"prompt": "de", "label": "de", "responses": ["ed"]}]
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_cfg = RLDataConfig(train=[{"path": str(data_file)}])
    with pytest.raises(RowError, match=r"prompts\.jsonl.* row 2.*responses.*rename the field") as err:
        load_prompts(data_cfg.train, data_cfg, load_tokenizer(str(rl_model_dir)))
    assert (err.value.row, err.value.key, err.value.reason) == (2, "responses", "reserved_name")
