"""What a plan costs, predicted: the fitted cost model (latency, energy, CPU-busy time per call and per layer) and a
plan's memory."""
