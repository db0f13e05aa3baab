"""``torch.compile`` per decoder block (``--compile``), as torchtitan applies it.

Each block is compiled on its own (``nn.Module.compile``: the module keeps its parameters and
names), so one compiled graph serves every layer of the same shape and a stage's compile time does
not grow with its layer count. What cannot be traced (the TP collectives through the Communicator,
the split backward's weight-gradient queue) runs eagerly between graphs; the numbers are those of
the eager run within the compiler's fusion rounding, which the parity test bounds.
"""

from __future__ import annotations

from hethub.runtime.model import StageModel


def compile_blocks(model: StageModel) -> None:
    """Compile every decoder block of ``model`` in place."""
    for block in model.layers.values():
        block.compile()
