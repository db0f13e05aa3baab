"""The torch profiler: measures a model's per-layer forward, backward and update times (and memory)
on this machine's device, for :mod:`hethub.profile`'s file format. Needs torch (``hethub[train]``)."""
