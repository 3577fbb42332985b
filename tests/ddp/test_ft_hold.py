"""KUBETRAIN_TEST_FT_HOLD, the test knob that holds a fault-tolerant step until enough replica groups
take part (kubetrain/trainer/testhooks.py's `Hold`), and KUBETRAIN_TEST_FT_JOIN_DELAY, which makes groups come up seconds
apart (`join_delay`): their values, and a clear error naming the variable for a bad one. Their effect on a
run: tests/local/test_fault_tolerant_runs.py."""

from __future__ import annotations

import pytest

from kubetrain.shared.launch import FT_HOLD_VAR, FT_JOIN_DELAY_VAR
from kubetrain.trainer.testhooks import Hold, join_delay
from kubetrain.trainer.errors import ConfigError


@pytest.mark.parametrize("value, expected", [
    ("", None),
    ("600:3", Hold(step=600, groups=3)),
    ("1:1", Hold(step=1, groups=1)),
], ids=["unset", "step-600-3-groups", "smallest"])
def test_the_hold_is_read_from_the_environment(value, expected):
    assert Hold.from_env({FT_HOLD_VAR: value} if value else {}) == expected


@pytest.mark.parametrize("value", ["600", "600:", ":3", "0:3", "600:0", "a:3", "600:3:1", "-1:3"])
def test_a_bad_hold_names_the_variable_and_the_value(value):
    with pytest.raises(ConfigError) as err:
        Hold.from_env({FT_HOLD_VAR: value})
    assert str(err.value) == (f"{FT_HOLD_VAR}: expected STEP:GROUPS (two positive integers) such as '600:3', "
                              f"got {value!r}")


@pytest.mark.parametrize("value, group, expected", [
    ("", 1, 0.0),
    ("ddp-1:3,ddp-2:20", 1, 3.0),
    ("ddp-1:3,ddp-2:20", 2, 20.0),
    ("ddp-1:3,ddp-2:20", 0, 0.0),
    ("ddp-0:0.5", 0, 0.5),
], ids=["unset", "first-named", "second-named", "not-named", "fraction"])
def test_the_join_delay_is_read_from_the_environment(value, group, expected):
    assert join_delay({FT_JOIN_DELAY_VAR: value} if value else {}, group) == expected


@pytest.mark.parametrize("value", ["ddp-1", "ddp-1:", "1:3", "ddp-1:-1", "ddp-1:nan", "ddp-1:inf", "ddp-1:x"])
def test_a_bad_join_delay_names_the_variable_and_the_value(value):
    with pytest.raises(ConfigError) as err:
        join_delay({FT_JOIN_DELAY_VAR: value}, 1)
    assert str(err.value) == (f"{FT_JOIN_DELAY_VAR}: expected GROUP:SECONDS,... such as 'ddp-1:3,ddp-2:20', "
                              f"got {value!r}")
