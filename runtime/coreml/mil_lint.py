"""A static lint of built ML programs: only ops the Neural Engine runs well, and only static shapes.

It reads the program back from the saved package (what will ship, after every coremltools pass), so an op a
pass introduced is caught too. Routing and packing belong on the host: a topk, gather, scatter or a flexible
shape inside a function means the graph would leave the ANE (or not compile for it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from runtime.errors import NpumoeError

ALLOWED_OPS = frozenset({
    "const", "linear", "matmul", "conv", "silu", "sigmoid", "mul", "add", "reshape", "transpose",
    "slice_by_index", "slice_by_size", "concat", "stack", "cast",
    "layer_norm", "softmax", "tile",  # the dense functions' norms and attention core (ANEMLL, ml-ane-transformers)
})
# The ANE's tensors have at most 4 axes (N, C, H, W); a 5-D tensor splits the graph or leaves the ANE, and 5-D
# attention hit an accuracy bug on iOS 26 (executorch #15833): the attention core stays 3-D.
MAX_RANK = 4
# Weight decompression from `--compress`: constants that Core ML expands at load time, not runtime compute.
CONSTEXPR_OPS = frozenset({
    "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense", "constexpr_affine_dequantize",
    "constexpr_cast", "constexpr_sparse_to_dense",
})
# Inputs that decide an output shape: they must be constants, or the shape is not static.
SHAPE_ARGS = {"reshape": ("shape",), "transpose": ("perm",), "slice_by_index": ("begin", "end", "stride"),
              "slice_by_size": ("begin", "size"), "concat": ("axis",), "stack": ("axis",)}


@dataclass(frozen=True)
class LintIssue:
    function: str
    op: str  # op name in the program ('' for a function input)
    op_type: str
    message: str

    def __str__(self) -> str:
        what = f"op {self.op!r} ({self.op_type})" if self.op else "input"
        return f"function {self.function}: {what}: {self.message}"


class LintError(NpumoeError):
    def __init__(self, issues: list[LintIssue]) -> None:
        self.issues = issues
        shown = "; ".join(str(i) for i in issues[:5])
        more = f" (and {len(issues) - 5} more)" if len(issues) > 5 else ""
        super().__init__(f"the built program fails the ANE lint: {shown}{more}")


def _static(shape) -> bool:
    from coremltools.converters.mil.mil.types.symbolic import is_symbolic

    return all(not is_symbolic(d) and int(d) >= 0 for d in shape)


def lint_function(name: str, function) -> list[LintIssue]:
    """Issues of one pymil function: ops outside the allow-list, nested blocks, non-static shapes."""
    from coremltools.converters.mil.mil import types

    issues = []
    for var in function.inputs.values():
        if not _static(var.shape):
            issues.append(LintIssue(name, "", "input", f"input {var.name} has a non-static shape {var.shape}"))
    for op in function.operations:
        if op.op_type not in ALLOWED_OPS and op.op_type not in CONSTEXPR_OPS:
            issues.append(LintIssue(name, op.name, op.op_type, "op is not in the ANE allow-list"))
        if op.blocks:
            issues.append(LintIssue(name, op.name, op.op_type, "op has nested blocks (control flow)"))
        for arg in SHAPE_ARGS.get(op.op_type, ()):
            var = op.inputs.get(arg)
            if var is not None and var.val is None:
                issues.append(LintIssue(name, op.name, op.op_type, f"shape argument {arg!r} is not a constant"))
        for out in op.outputs:
            if types.is_tensor(out.sym_type) and not _static(out.shape):
                issues.append(LintIssue(name, op.name, op.op_type, f"output {out.name} has a non-static shape "
                                                                   f"{out.shape}"))
            elif types.is_tensor(out.sym_type) and len(out.shape) > MAX_RANK:
                issues.append(LintIssue(name, op.name, op.op_type, f"output {out.name} has {len(out.shape)} axes, "
                                                                   f"past the ANE's {MAX_RANK}"))
            elif not (types.is_tensor(out.sym_type) or types.is_scalar(out.sym_type)):
                issues.append(LintIssue(name, op.name, op.op_type, f"output {out.name} is not a tensor"))
    return issues


def lint_program(prog) -> list[LintIssue]:
    return [issue for name, fn in prog.functions.items() for issue in lint_function(name, fn)]


def _spec_issues(spec) -> list[LintIssue]:
    """Flexible shapes are declared in the model description (ranges, enumerations), not only in the program."""
    issues = []
    descriptions = list(spec.description.functions) or [spec.description]
    for fd in descriptions:
        name = getattr(fd, "name", "") or "main"
        for feature in list(fd.input) + list(fd.output):
            array = feature.type.multiArrayType
            if feature.type.WhichOneof("Type") != "multiArrayType":
                issues.append(LintIssue(name, "", "input", f"feature {feature.name} is not a multi-array"))
            elif array.WhichOneof("ShapeFlexibility") is not None:
                issues.append(LintIssue(name, "", "input", f"feature {feature.name} declares a flexible shape "
                                                           f"({array.WhichOneof('ShapeFlexibility')})"))
    return issues


def load_package_program(path: str | os.PathLike):
    """(spec, pymil Program) of a saved .mlpackage, weights included; works without Core ML's runtime."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load
    from coremltools.models.utils import _try_get_weights_dir_path

    spec = ct.utils.load_spec(str(path))
    if spec.WhichOneof("Type") != "mlProgram":
        raise NpumoeError(f"{path} is not an ML program package")
    prog = milproto_load(spec, spec.specificationVersion, _try_get_weights_dir_path(str(path)))
    return spec, prog


def lint_package(path: str | os.PathLike, prog=None, spec=None) -> None:
    """Raise LintError naming each offending op and function of the package at `path`."""
    if prog is None:
        spec, prog = load_package_program(path)
    issues = _spec_issues(spec) + lint_program(prog)
    if issues:
        raise LintError(issues)
