"""Measurements of a local emulation host's effects with torch: wake penalty, core speed spread and
the all-reduce among local gloo ranks. Needs torch (``hethub[train]``)."""
