"""Which transport the bridge uses (``comm/transport.py``): by name, from the caller or the
environment, so a test suite re-runs on another transport without edits."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hethub.comm.store_transport import StoreTransport
from hethub.comm.transport import GlooTransport, Transport
from hethub.errors import RuntimeSetupError

TRANSPORT_ENV = "HETHUB_BRIDGE_TRANSPORT"


def transport_name(requested: str = "gloo") -> str:
    """The transport to use: HETHUB_BRIDGE_TRANSPORT if set (so a test suite re-runs on another
    transport unedited), else ``requested``; validated against :data:`TRANSPORTS`."""
    name = os.environ.get(TRANSPORT_ENV, "").strip().lower() or requested
    if name not in TRANSPORTS:
        raise RuntimeSetupError(f"bridge transport {name!r} (from {TRANSPORT_ENV} or the caller) is not one of "
                                f"{', '.join(TRANSPORTS)}. Fix: set {TRANSPORT_ENV}={' or '.join(TRANSPORTS)}.")
    return name


def make_transport(name: str, make_group: Callable[[Sequence[int], str, str], Any]) -> Transport:
    """The transport called ``name``; ``make_group`` creates torch groups in the world's common order."""
    return TRANSPORTS[name](make_group)


def _store_transport(make_group: Callable[[Sequence[int], str, str], Any]) -> Transport:
    return StoreTransport()


TRANSPORTS: dict[str, Callable[[Callable[[Sequence[int], str, str], Any]], Transport]] = {
    "gloo": GlooTransport,
    "store": _store_transport,
}
