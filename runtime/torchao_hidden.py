"""transformers imports torchao with its model classes whenever torchao is installed (its torchao quantizer asks
`is_torchao_available()` at import, then imports it), and Core AI's optimizer (the `coreai` extra: coreai-opt)
installs it: about 4 s of imports and lines of load failures on every model load, for torchao-quantized checkpoints,
which npumoe does not read. So the first time transformers' `import_utils` is imported, it is asked once with torchao
hidden (it caches the answer); torchao itself stays importable for whoever imports it. A hook, not an import here:
`import runtime` stays light."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "transformers.utils.import_utils"


def _prime(module) -> None:
    sys.modules["torchao"] = None  # importlib's find_spec reads a None entry as not installed
    try:
        module.is_torchao_available()
    finally:
        del sys.modules["torchao"]


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _prime(module)

        spec.loader.exec_module = exec_module
        return spec


def hide_torchao_from_transformers() -> None:
    """Install the hook, unless transformers or torchao is imported already (then it is too late, or wanted)."""
    if TARGET in sys.modules or "torchao" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
