"""The MIL lint: disallowed ops named with their function, non-static shapes refused, the allow-list accepted."""
import pytest
from helpers import mil_program

from runtime.coreml.converter import quiet_coremltools_import

quiet_coremltools_import()


def test_lint_names_a_disallowed_op_and_its_function():
    from runtime.coreml.mil_lint import LintError, lint_program

    prog = mil_program(lambda mb, x: mb.topk(x=x, k=2, axis=-1)[0])
    issues = lint_program(prog)
    assert [(i.function, i.op_type) for i in issues] == [("main", "topk")]
    with pytest.raises(LintError, match=r"function main: op '.*' \(topk\): op is not in the ANE allow-list"):
        raise LintError(issues)


def test_lint_rejects_non_static_shapes():
    from coremltools.converters.mil.mil import get_new_symbol

    from runtime.coreml.mil_lint import lint_program

    prog = mil_program(lambda mb, x: mb.silu(x=x), shape=(get_new_symbol(), 16))
    messages = [str(i) for i in lint_program(prog)]
    assert any("input" in m and "non-static shape" in m for m in messages)
    assert any("silu" in m and "non-static shape" in m for m in messages)


def test_lint_accepts_the_allowed_ops():
    from runtime.coreml.mil_lint import lint_program

    def body(mb, x):
        y = mb.add(x=mb.mul(x=mb.sigmoid(x=x), y=x), y=x)
        y = mb.reshape(x=mb.transpose(x=y, perm=[1, 0]), shape=[16, 8])
        return mb.concat(values=[mb.slice_by_index(x=y, begin=[0, 0], end=[8, 8]), y], axis=0)

    assert lint_program(mil_program(body)) == []
