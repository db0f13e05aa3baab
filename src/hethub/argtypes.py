"""argparse value types shared by every command: each rejects a bad value with a message naming it.

Used for flags of the ``hethub`` commands and of ``python -m hethub.train``, so a value is checked
once, before anything long (a measurement, a launch of ranks) starts.
"""

from __future__ import annotations

import argparse
import math


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def positive_float(text: str) -> float:
    v = _finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def above_one(text: str) -> float:
    """A number > 1 (a factor that means "slower")."""
    v = _finite(text)
    if v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    v = _finite(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    v = _finite(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return v


def headroom_fraction(text: str) -> float:
    """A share of memory to keep free: a number in [0, 1)."""
    v = _finite(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {v}")
    return v


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (unless it has none, or already says it); the
    description and the examples in the epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings or action.required):
            return text
        default = ",".join(map(str, action.default)) if isinstance(action.default, tuple) else "%(default)s"
        return f"{text} (default: {default})" if text else f"default: {default}"
