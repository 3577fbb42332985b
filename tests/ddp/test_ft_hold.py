"""KUBETRAIN_TEST_FT_HOLD, the test knob that holds a fault-tolerant step until enough replica groups
take part (trainer/ddp/ft.py's `Hold`): its value, and a clear error naming the variable for a bad one.
Its effect on a run: tests/local/test_fault_tolerant_runs.py."""

from __future__ import annotations

import pytest

from kubetrain_contract.launch import FT_HOLD_VAR
from kubetrain_trainer.ddp.ft import Hold
from kubetrain_trainer.errors import ConfigError


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
