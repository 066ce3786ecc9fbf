"""What a plan costs in fidelity, measured: perplexity and agreement against the unmodified model, the search's
fidelity gate, and lm-evaluation-harness tasks."""
