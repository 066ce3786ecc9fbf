"""A test stand-in for Core ML's compile and predict, so that `ane.py`'s own code (prepare, prepare_dense, _load, the
compiled cache, layouts, casts, masks) runs on Linux against the packages `autotune build` made.

Only what needs Core ML's runtime is replaced: `compile_model` copies the package into the compiled folder (and counts
its calls), and `CompiledMLModel(path, compute_units, function_name).predict(feed)` evaluates that function of the saved
program with `runtime.coreml.mil_eval`, after doing what coremltools and Core ML do to a feed: coremltools converts
fp16 arrays to fp32 (`MLModel._update_float16_multiarray_input_to_float32`), Core ML rounds them to the declared
fp16 input type. Every feed is checked against the function's declared inputs (names, shapes, dtypes) as Core ML
refuses a mismatch.
"""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from runtime.coreml import ane
from runtime.coreml.mil_eval import evaluate_function
from runtime.coreml.mil_lint import load_package_program

COPIED = "package.mlpackage"  # what the stand-in's "compiled" folder holds


class StandIn:
    """The stand-in's state: compiles and predictions counted, programs loaded once per compiled folder."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self._programs: dict[str, tuple] = {}

    def compile_model(self, package: str, destination_path: str) -> str:
        assert destination_path.endswith(".mlmodelc") and Path(package).suffix == ".mlpackage"
        shutil.copytree(package, Path(destination_path) / COPIED)
        self.calls["compile"] += 1
        return destination_path

    def program(self, compiled: str) -> tuple:
        if compiled not in self._programs:
            self._programs[compiled] = load_package_program(Path(compiled) / COPIED)
        return self._programs[compiled]

    def model_class(self):
        standin = self

        class CompiledMLModel:
            def __init__(self, path: str, compute_units=None, function_name: str | None = None) -> None:
                import coremltools as ct

                assert compute_units == ct.ComputeUnit.CPU_AND_NE, compute_units
                spec, prog = standin.program(path)
                self.name = function_name
                self.function = prog.functions[function_name]
                self.description = next(f for f in spec.description.functions if f.name == function_name)

            def predict(self, data: dict) -> dict:
                import coremltools as ct

                fp16 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
                feed = {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float16 else v
                        for k, v in data.items()}  # coremltools' own conversion
                declared = {i.name: i.type.multiArrayType for i in self.description.input}
                assert set(feed) == set(declared), f"{self.name}: fed {sorted(feed)}, declared {sorted(declared)}"
                for name, array in declared.items():
                    x = feed[name]
                    assert isinstance(x, np.ndarray) and x.dtype == np.float32, (self.name, name, type(x))
                    assert list(x.shape) == list(array.shape), (self.name, name, x.shape, list(array.shape))
                    assert array.dataType == fp16, (self.name, name, array.dataType)
                    feed[name] = x.astype(np.float16).astype(np.float32)  # Core ML: to the declared fp16
                out = evaluate_function(self.function, feed)
                standin.calls["predict"] += 1
                return {o.name: out[o.name] for o in self.description.output}

        return CompiledMLModel


def install(monkeypatch, cache: Path) -> StandIn:
    """Core ML's compile and predict replaced for this test; the compiled cache under `cache`."""
    import coremltools as ct

    standin = StandIn()
    monkeypatch.setenv("NPUMOE_CACHE", str(cache))
    monkeypatch.setattr(ane, "coreml_available", lambda: (True, "Core ML stand-in (tests)"))
    monkeypatch.setattr(ct.models.utils, "compile_model", standin.compile_model)
    monkeypatch.setattr(ct.models, "CompiledMLModel", standin.model_class())
    return standin


class LoadedProgram:
    """Stands in for `ct.convert(..., compute_units=...)`'s loaded model (what `profile-device` times): predicts by
    evaluating the program's function on the host, after the same feed checks (names, shapes; fp16 values)."""

    def __init__(self, prog, calls: Counter) -> None:
        self.function, self.calls = prog.functions["main"], calls

    def predict(self, data: dict) -> dict:
        declared = {name: tuple(var.shape) for name, var in self.function.inputs.items()}
        assert {k: v.shape for k, v in data.items()} == declared, (sorted(data), declared)
        assert all(v.dtype == np.float16 for v in data.values())
        self.calls["predict"] += 1
        return evaluate_function(self.function, {k: v.astype(np.float32) for k, v in data.items()})


def install_loaded_programs(monkeypatch) -> Counter:
    """`program_mlmodel(prog, compute_units)` (the profiler's converted and loaded functions) replaced: programs are
    counted by what they hold and evaluated on the host when called."""
    from runtime.coreml import converter

    calls: Counter = Counter()
    real = converter.program_mlmodel

    def loaded(prog, compute_units=None):
        if compute_units is None:
            return real(prog)
        calls["load"] += 1
        return LoadedProgram(prog, calls)

    monkeypatch.setattr(converter, "program_mlmodel", loaded)
    return calls
