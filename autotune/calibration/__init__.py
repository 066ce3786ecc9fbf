"""Routing calibration: the texts (built-in and files), their tokens, the routing traces a search tunes on, and model
statistics (load shares, skew, perplexity)."""
