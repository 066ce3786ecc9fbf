"""Core ML and the Neural Engine: the `ane` backend and its simulator `ane-sim`, the ANE limits, and the package build
(conversion, lint, host numeric check, cache)."""
