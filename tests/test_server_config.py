"""ServerConfig: the hand-off mode is an enum (its string values still accepted), and bad values name the option."""

from __future__ import annotations

import pytest

from cortexstream.server.config import Handoff, ServerConfig


def test_handoff_takes_the_enum_or_its_string_value():
    assert ServerConfig().handoff is Handoff.PER_STEP
    assert ServerConfig(handoff="per_token").handoff is Handoff.PER_TOKEN
    assert ServerConfig(handoff=Handoff.PER_TOKEN).handoff == "per_token"


@pytest.mark.parametrize("options, option", [
    ({"handoff": "per_request"}, "handoff"),
    ({"kv_tokens": 0}, "kv_tokens"),
    ({"kv_tokens": 64, "kv_memory": 0.5}, "kv_tokens / kv_memory"),
    ({"max_queue": -1}, "max_queue"),
    ({"api_keys": ("a", "a")}, "api_keys"),
])
def test_bad_values_name_the_option(options, option):
    with pytest.raises(ValueError, match=f"^{option}:"):
        ServerConfig(**options)
