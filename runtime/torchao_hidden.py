"""torchao is imported by transformers with its model classes (its torchao quantizer asks `is_torchao_available()` at
import, then imports it) and by coremltools at import (`coremltools._deps`, for its torch frontend), whenever it is
installed; Core AI's optimizer (the `coreai` extra: coreai-opt) installs it. That is about 4 s of imports and lines
of load failures on every model load and build, for torchao-quantized checkpoints and torchao ops, which npumoe
neither reads nor converts. So each of those two modules is executed once with torchao hidden (transformers is asked
then, and caches the answer); torchao itself stays importable for whoever imports it. A hook, not an import here:
`import runtime` stays light."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGETS = ("transformers.utils.import_utils", "coremltools._deps")


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending = {name for name in TARGETS if name not in sys.modules}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the module as the other finders find it, its loader wrapped
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            outermost = "torchao" not in sys.modules  # one target may import the other
            sys.modules["torchao"] = None  # importlib reads a None entry as not installed: `import torchao` fails
            try:
                run(module)
                if hasattr(module, "is_torchao_available"):
                    module.is_torchao_available()  # transformers caches the answer
            finally:
                if outermost:
                    sys.modules.pop("torchao", None)

        spec.loader.exec_module = exec_module
        return spec


def hide_torchao() -> None:
    """Install the hook, unless torchao is imported already (then it is wanted) or the hook is in place."""
    if "torchao" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    hook = _Hook()
    if hook.pending:
        sys.meta_path.insert(0, hook)
