"""The search: its config, the per-layer decision space and its scorers, the optimizer, robustness, the fidelity
gate's candidates, study storage, the report and explanations, plan templates."""
