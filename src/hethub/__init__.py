"""hethub: plan, predict and train LLMs on heterogeneous accelerator clusters."""

__version__ = "0.1.0"
