"""Reward for the copy / reverse letter tasks (raylign.tasks.strings): the fraction of answer
letters in the right place. A reward file only has to define ``reward_func``."""

from raylign.tasks.strings import letter_match_reward as reward_func  # noqa: F401
