"""Options and inputs several commands share."""

from __future__ import annotations

import argparse

from hethub.argtypes import headroom_fraction


def add_headroom(sp: argparse.ArgumentParser) -> None:
    from hethub.predict.memory import DEFAULT_MEM_HEADROOM

    sp.add_argument("--mem-headroom", type=headroom_fraction, default=DEFAULT_MEM_HEADROOM, metavar="FRACTION",
                    help="share of each device's memory to keep free (default %(default)s: the memory model's "
                         "error; docs/predictor.md)")


def load_profiles_arg(arg: str | None, model=None, seq_len: int | None = None):
    """The measured profiles of a command's ``--profiles`` (None without it)."""
    if not arg:
        return None
    from hethub.profile.format import load_profiles

    return load_profiles(arg, model=model, seq_len=seq_len)
