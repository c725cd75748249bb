"""Typed, validated knobs: the schema every policy and router feature declares.

A knob is a named, typed, range-checked number or choice with a default and a line of doc.
The control API, the CLI's ``--knob key=value`` and the TUI's knob form all validate through
``validate_knobs``, so one set of rules (and one set of error messages) holds everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class KnobError(ValueError):
    """A knob value was rejected. ``field`` names the knob; the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # int, float, str or bool
    default: Any
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None

    def describe_range(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.type is bool:
            return "true or false"
        lo = "-inf" if self.min is None else _fmt(self.min)
        hi = "inf" if self.max is None else _fmt(self.max)
        return f"{self.type.__name__} in [{lo}, {hi}]"

    def coerce(self, value: Any) -> Any:
        """Return ``value`` as this knob's type, or raise KnobError.

        Accepts JSON values (the control API) and strings (the CLI's ``key=value``).
        """
        if isinstance(value, str) and self.type is not str:
            value = _parse_scalar(value)
        if self.type is bool:
            if isinstance(value, bool):
                return value
            raise KnobError(self.name, f"expected true or false, got {value!r}")
        if self.type is str:
            if not isinstance(value, str):
                raise KnobError(self.name, f"expected a string, got {value!r}")
            if self.choices and value not in self.choices:
                raise KnobError(self.name, f"{value!r} is not allowed; {self.describe_range()}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KnobError(self.name, f"expected {self.type.__name__}, got {value!r}; {self.describe_range()}")
        if self.type is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise KnobError(self.name, f"expected an integer, got {value!r}")
                value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise KnobError(self.name, f"must be finite, got {value!r}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise KnobError(self.name, f"{value!r} is out of range; {self.describe_range()}")
        return value

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type.__name__,
            "default": self.default,
            "min": self.min,
            "max": self.max,
            "choices": list(self.choices) if self.choices else None,
            "range": self.describe_range(),
            "doc": self.doc,
        }


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _parse_scalar(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return int(low)
    except ValueError:
        pass
    try:
        return float(low)
    except ValueError:
        return text


@dataclass(frozen=True)
class KnobSchema:
    knobs: tuple[Knob, ...] = field(default_factory=tuple)

    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def get(self, name: str) -> Knob | None:
        for k in self.knobs:
            if k.name == name:
                return k
        return None

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs}

    def validate(self, values: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
        """Validate ``values`` on top of ``base`` (defaults when None); return the full set.

        Every value is checked before anything is returned, so a caller that swaps only on
        success never applies half of an update.
        """
        if not isinstance(values, dict):
            raise KnobError("knobs", "expected an object of knob names to values")
        out = dict(self.defaults() if base is None else base)
        for name, value in values.items():
            knob = self.get(name)
            if knob is None:
                allowed = ", ".join(self.names()) or "none"
                raise KnobError(str(name), f"unknown knob; known knobs: {allowed}")
            out[name] = knob.coerce(value)
        return out

    def to_json(self) -> list[dict[str, Any]]:
        return [k.to_json() for k in self.knobs]

    def __add__(self, other: "KnobSchema") -> "KnobSchema":
        return KnobSchema(self.knobs + other.knobs)


def parse_knob_args(items: list[str]) -> dict[str, str]:
    """Parse CLI ``key=value`` strings into a dict (values are validated later)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KnobError(item, "expected key=value")
        out[key.strip()] = value.strip()
    return out
