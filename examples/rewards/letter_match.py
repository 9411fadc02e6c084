"""Reward for the copy / reverse letter tasks: the fraction of answer letters in the right place.

Partial credit gives a dense signal (a tiny model rarely gets a whole answer right at first);
an exact answer scores 1.0 and an overlong one is penalised by its extra letters.
"""


def reward_func(prompts, responses, labels, **metadata):
    rewards = []
    for response, label in zip(responses, labels):
        got, want = response.split(), str(label).split()
        hits = sum(a == b for a, b in zip(got, want))
        rewards.append(hits / max(len(want), len(got), 1))
    return rewards
