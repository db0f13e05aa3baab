"""Communication for the runtime: one seam (:class:`Communicator`) behind which backends live.

:func:`make_communicator` picks the implementation for a plan: native backends inside each device
kind and, between kinds whose libraries cannot talk, the host/gloo bridge (:class:`BridgedCommunicator`).
"""

from hethub.comm.bridge import BridgedCommunicator
from hethub.comm.communicator import Communicator
from hethub.comm.factory import make_communicator

__all__ = ["BridgedCommunicator", "Communicator", "make_communicator"]
