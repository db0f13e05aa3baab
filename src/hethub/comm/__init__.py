"""Communication for the runtime: one seam (:class:`Communicator`) behind which backends live."""

from hethub.comm.communicator import Communicator

__all__ = ["Communicator"]
