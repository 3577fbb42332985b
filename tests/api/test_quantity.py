"""api/quantity.py: Kubernetes quantities read exactly, within Kubernetes' bounds, in microseconds."""

from __future__ import annotations

import re
import time
from decimal import Decimal

import pytest

from kubetrain.api import crd, quantity


@pytest.mark.parametrize("text, value", [
    ("500m", Decimal("0.5")), ("2", Decimal(2)), (3, Decimal(3)), ("1Gi", Decimal(2**30)), ("1k", Decimal(1000)),
    ("1e3", Decimal(1000)), ("1P", Decimal(10**15)), ("0.5Gi", Decimal(2**29)), (".5", Decimal("0.5")),
    ("9223372036854775807m", Decimal("9223372036854775.807")),  # Kubernetes' bound, 64-bit milli-units
])
def test_quantities_parse_as_the_api_server_reads_them(text, value):
    assert quantity.parse(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "1.2.3", "5 Gi", "1Xi", "--1", "-1", "1e999999", "1e999999999", "9Ei",
                                 "1e-100", 2**63, -1, True, 0.5, None, "1" * 65])
def test_what_is_no_quantity_is_refused(bad):
    with pytest.raises(quantity.QuantityError, match="not a quantity"):
        quantity.parse(bad)



@pytest.mark.parametrize("text", ["1e99", "9" * 64, "1." + "0" * 62, "9223372036854775.8070000000000000000000000000001",
                                  "9Ei", "1e-99", "0.000000001m"])
def test_reading_any_quantity_takes_microseconds(text):
    start = time.perf_counter()
    for _ in range(100):
        try:
            quantity.parse(text)
        except quantity.QuantityError:
            pass
    assert time.perf_counter() - start < 0.1


def test_the_bound_is_exact_past_decimals_default_precision():
    # 28 digits would round this to the bound itself; Kubernetes compares exactly.
    with pytest.raises(quantity.QuantityError):
        quantity.parse("9223372036854775.8070000000000000000000000000001")
    assert quantity.parse("9223372036854775.807") == quantity.MAX


@pytest.mark.parametrize("text", ["1", "1.", ".5", "+2", "500m", "1Ki", "2E", "1E5", "1e+05", "1e-9", "5 Gi", "1e", "e3",
                                  "1e123", "-1", "1Kii", "1k5", "."])
def test_the_crds_grammar_is_the_validators(text):
    """The CRD's rule matches the string with quantity.PATTERN (RE2), the validator with its own regex: the
    same language."""
    cel = re.fullmatch(quantity.PATTERN, text) is not None
    python = quantity._QUANTITY.fullmatch(text) is not None
    assert cel == python
    assert quantity.PATTERN in crd.QUANTITY_CEL.replace("\\\\", "\\")
