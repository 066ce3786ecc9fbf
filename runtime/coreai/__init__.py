"""Core AI (macOS 27's framework for transformer models; its Python packages run on Linux too): the `coreai` backend,
its asset build through coreai-torch and its runtime through coreai-core."""
