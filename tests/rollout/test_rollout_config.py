"""Rollout config sections reject bad values with the field name."""

from __future__ import annotations

import pytest

from raylign.config.base import ConfigError, parse_config
from raylign.config.rollout import RolloutConfig, SamplingConfig


def test_defaults_are_valid():
    assert SamplingConfig().n == 1
    assert RolloutConfig().bucket_mb == 32.0


@pytest.mark.parametrize(
    ("cls", "data", "field"),
    [
        (SamplingConfig, {"n": 0}, "n"),
        (SamplingConfig, {"temperature": -0.1}, "temperature"),
        (SamplingConfig, {"temperature": 0.005}, "temperature"),  # vLLM would sample at 0.01 instead
        (SamplingConfig, {"top_p": 0.0}, "top_p"),
        (SamplingConfig, {"top_k": -2}, "top_k"),
        (SamplingConfig, {"stop": ["ok", ""]}, "stop"),
        (SamplingConfig, {"max_tokens": 4}, "max_tokens"),
        (RolloutConfig, {"engine": "sglang"}, "engine"),
        (RolloutConfig, {"bucket_mb": 0}, "bucket_mb"),
        (RolloutConfig, {"kv_cache_memory_bytes": 10}, "kv_cache_memory_bytes"),
    ],
)
def test_bad_values_name_the_field(cls, data, field):
    with pytest.raises(ConfigError, match=field):
        parse_config(cls, data)


def test_temperature_zero_and_a_hundredth_are_the_smallest_accepted():
    assert [parse_config(SamplingConfig, {"temperature": t}).temperature for t in (0, 0.01)] == [0, 0.01]


def test_every_field_has_a_description():
    for cls in (SamplingConfig, RolloutConfig):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name}"
