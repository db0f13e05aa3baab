"""Online re-balancing: batch shares and layers follow measured speed, without a restart (docs/rebalance.md).

Pure (no torch): what the runtime measures each step goes in (``measure``), a small model of the
step built on the schedules' closed form prices other splits of the batch and single layer moves
(``step_model``), and a policy decides when a change pays (``policy``); a ``Decision`` is applied to
the plan here and to the ranks by ``hethub.runtime.rebalance``. The runtime may import this package
(it imports only ``plan``, ``schedules``, ``spec`` and ``layout``), never the predictor.
"""

from hethub.rebalance.config import MODES, RebalanceConfig
from hethub.rebalance.decision import Decision, LayerMove, rebalanced_of
from hethub.rebalance.policy import Observation, Rebalancer

__all__ = ["MODES", "Decision", "LayerMove", "Observation", "RebalanceConfig", "Rebalancer", "rebalanced_of"]
