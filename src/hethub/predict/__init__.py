"""Performance predictor (pure Python, no torch): step time, throughput, memory and timeline of a plan."""
