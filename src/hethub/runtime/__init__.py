"""Training runtime: executes a plan with torch.distributed (one process per device)."""
