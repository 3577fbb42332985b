"""Kubernetes resource quantities ('500m', '4Gi', '1e3', 2), read once, when a job is validated.

Kubernetes' grammar (k8s.io/apimachinery/pkg/api/resource/quantity.go): a number, then a binary
suffix (Ki ... Ei), a decimal one (m, k ... E) or an exponent (e3). Kubernetes reads far more than
it counts: `ParseQuantity` takes "1e999999" (an exponent up to int32, truncated past it), and its
scheduler and kubelet count CPU in int64 milli-units (`MilliValue`, `MaxMilliValue`). kubetrain
takes a quantity only when its milli-units fit int64 (0 to 9223372036854775807m, about 8Pi) and
its exponent has at most two digits: "1e999999" once made the gang sums (engine/gang.py) compute
`int()` of a million-digit number, 28.5 s holding the operator's interpreter in every round of
the job, then ValueError; "1e999999999" raised decimal.Overflow.

`kubetrain validate` and the operator call `problem`; the CRD's rule (crd.QUANTITY_CEL: `matches`,
`isQuantity`, `quantity().compareTo`) judges the same strings the same way, with MESSAGE. Within
these bounds a quantity is at most MAX_LENGTH characters, and `parse` reads it exactly, in
microseconds, with nothing but QuantityError (a ValueError) for what it refuses.
"""

from __future__ import annotations

import re
from decimal import Context, Decimal, localcontext
from typing import Any

from .schema import type_name

MAX_MILLI = 2**63 - 1
"""Kubernetes' bound: a quantity's milli-units are an int64 (resource.MaxMilliValue * 1000)."""
MAX = Decimal(MAX_MILLI).scaleb(-3)
MAX_TEXT = f"{MAX_MILLI}m"
MAX_INTEGER = MAX_MILLI // 1000
"""The largest quantity written as an integer (a YAML or JSON number rather than a string)."""
MAX_LENGTH = 64
"""Characters of a quantity: far past any real one ('9223372036854775807m' is 20), and a bound on
what the CRD's rule reads."""
MAX_NAMES = 64
"""Resource names in one requests, limits or minResources map (Kubernetes sets none; real pods
name a handful): a bound on what the CRD's rule walks."""

SUFFIXES = {
    "": Decimal(1), "m": Decimal("0.001"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}
PATTERN = r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][-+]?[0-9]{1,2})?"
"""Kubernetes' grammar, in RE2 and Python alike: no sign but '+' (a negative request is refused by
Kubernetes too), an exponent of one or two digits."""
_QUANTITY = re.compile(r"\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]{1,2})|(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei))?")

MESSAGE = (f"must be a Kubernetes quantity such as 2, 500m, 4Gi or 1e3, from 0 to {MAX_TEXT} (Kubernetes counts "
           "resources in 64-bit milli-units; an exponent has at most two digits)")

# Exact within the bounds: 64 digits of mantissa times 2^60, or scaled by 10^99, never rounded.
_EXACT = Context(prec=200)


class QuantityError(ValueError):
    """Not a quantity kubetrain takes (MESSAGE)."""


def parse(value: Any) -> Decimal:
    """A quantity ('500m', '4Gi', '1e3', or an integer) as an exact number; QuantityError for anything
    else, a quantity past the bounds included. Never slow: nothing past MAX_LENGTH characters is read."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise QuantityError(f"not a quantity: {_show(value)}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_INTEGER:
            raise QuantityError(f"not a quantity within bounds: {_show(value)}")
        return Decimal(value)
    match = _QUANTITY.fullmatch(value) if len(value) <= MAX_LENGTH else None
    if match is None:
        raise QuantityError(f"not a quantity: {_show(value)}")
    number, exponent, suffix = match.groups()
    with localcontext(_EXACT):
        amount = Decimal(number)
        amount = amount.scaleb(int(exponent)) if exponent else amount * SUFFIXES[suffix or ""]
    if amount > MAX:
        raise QuantityError(f"not a quantity within bounds: {_show(value)}")
    return amount


def problem(value: Any) -> str | None:
    """MESSAGE and the value, when `value` is not a quantity kubetrain takes; None when it is."""
    try:
        parse(value)
    except QuantityError:
        return f"{MESSAGE}, got {_show(value)}"
    return None


def map_problems(values: Any, path: str) -> list[tuple[str, str]]:
    """(path, message) for a requests, limits or minResources map: an object of at most MAX_NAMES
    quantities. A null is left to the null check (load.null_problems), which names it."""
    if values is None:
        return []
    if not isinstance(values, dict):
        return [(path, f"must be an object, got {type_name(values)}")]
    if len(values) > MAX_NAMES:
        return [(path, f"must have at most {MAX_NAMES} resources, got {len(values)}")]
    return [(f"{path}.{name}", message) for name, value in values.items()
            if value is not None and (message := problem(value)) is not None]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
