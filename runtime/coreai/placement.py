"""Where Core AI places each function of a program: its compute plan (`coreai_torch.debugging.compute_plan.
ComputePlan.from_program(program, options).to_dict(program)`, macOS 27's OS framework) read per function as the
share of its ops, and of its matmul FLOPs, that run on the Neural Engine.

An op counts only where the plan names a real device for it: constants, fused ops (no entry) and ops the plan
resolves to `UNKNOWN` alone are neither on nor off the Neural Engine. `autotune build --format coreai` refuses a
function that lands mostly elsewhere (`MIN_SHARE`), before the asset is written, and records the shares in the
asset's metadata and its manifest; the doctor's check reads the same plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from runtime.coreai import assets
from runtime.errors import NpumoeError

NEURAL_ENGINE = "NEURAL_ENGINE"
UNKNOWN = "UNKNOWN"
MIN_SHARE = 0.5  # "mostly elsewhere": under half of a function's placed ops (or matmul FLOPs) on the Neural Engine
UNSCHEDULED = ("coreai.constant", "coreai.graph", "coreai.output", "builtin.module")


@dataclass
class Share:
    """One function's placement: placed ops, those on the Neural Engine, and the same for matmul FLOPs."""
    ops: int
    ops_on_neural_engine: int
    matmul_flops: int
    matmul_flops_on_neural_engine: int
    devices: dict[str, int]  # placed ops per device

    @property
    def share(self) -> float:
        """The lower of the op share and the matmul-FLOP share (0 when the plan places none of its ops)."""
        ops = self.ops_on_neural_engine / self.ops if self.ops else 0.0
        return min(ops, self.matmul_flops_on_neural_engine / self.matmul_flops) if self.matmul_flops else ops

    def to_json(self) -> dict:
        return {**asdict(self), "share": round(self.share, 4)}


def readable() -> bool:
    """Whether Core AI's compute plan can be read here (the OS framework, specializing for the Neural Engine)."""
    return assets.on_neural_engine()


def compute_plan(program) -> dict:
    """Core AI's compute plan of `program` specialized for the Neural Engine, as plain values."""
    from coreai_torch.debugging.compute_plan import ComputePlan

    with assets.quiet():
        plan = assets.run_sync(ComputePlan.from_program(program, assets.neural_engine_options()))
        return plan.to_dict(program)


def _ops_by_function(program) -> dict[int, tuple[str, str, int]]:
    """op id -> (function, op name, matmul FLOPs) for every schedulable op of the program's functions."""
    from coreai_torch.debugging.debug_info import get_operation_id
    from coreai_torch.debugging.utils import _walk_operations

    out = {}
    for op in _walk_operations(program):
        parent = op.parent
        if op.name in UNSCHEDULED or parent is None or parent.name != "coreai.graph":
            continue
        op_id = get_operation_id(op)
        if op_id is not None:
            out[op_id] = (str(parent.attributes["sym_name"]).strip('"'), op.name, _matmul_flops(op))
    return out


def _matmul_flops(op) -> int:
    if "matmul" not in op.name or not op.results or not op.operands:
        return 0
    k = list(op.operands[0].type.shape)[-1]
    n = 1
    for d in op.results[0].type.shape:
        n *= d
    return 2 * n * k


def shares(program, plan: dict) -> dict[str, Share]:
    """Each function's placement under `plan` (`compute_plan`'s values); an op with no real device is not counted."""
    ops = _ops_by_function(program)
    out = {name: Share(0, 0, 0, 0, {}) for name, _, _ in ops.values()}
    for entry in plan["entries"]:
        devices = [d for d in entry.get("devices") or () if d != UNKNOWN]
        if entry["operation_id"] not in ops or not devices:
            continue
        name, _, flops = ops[entry["operation_id"]]
        s, on = out[name], NEURAL_ENGINE in devices
        s.ops += 1
        s.ops_on_neural_engine += on
        s.matmul_flops += flops
        s.matmul_flops_on_neural_engine += flops * on
        for d in devices:
            s.devices[d] = s.devices.get(d, 0) + 1
    return out


def off_neural_engine(program, plan: dict) -> list[str]:
    """Names of the ops the plan places on a real device other than the Neural Engine."""
    ops = _ops_by_function(program)
    return sorted({ops[e["operation_id"]][1] for e in plan["entries"] if e["operation_id"] in ops
                   and [d for d in e.get("devices") or () if d != UNKNOWN]
                   and NEURAL_ENGINE not in e["devices"]})


def check(found: dict[str, Share], dtype: str, min_share: float = MIN_SHARE) -> None:
    """Refuse, in one line, the first function that lands mostly off the Neural Engine; for a float32 asset, the
    way out (the Neural Engine computes in float16)."""
    hint = "; the Neural Engine computes float16: build without --dtype float32" if dtype == "float32" else ""
    for name, s in found.items():
        if s.share < min_share:
            where = ", ".join(f"{d} {n}" for d, n in sorted(s.devices.items())) or "no op placed"
            raise NpumoeError(
                f"function {name}: Core AI's compute plan puts {s.share:.0%} of it on the Neural Engine (ops "
                f"{s.ops_on_neural_engine}/{s.ops}, matmul FLOPs {s.matmul_flops_on_neural_engine:,}/"
                f"{s.matmul_flops:,}; {where}), under the {min_share:.0%} a device function needs; nothing "
                f"written{hint}")


def read(program) -> dict[str, Share] | None:
    """The program's per-function placement where a compute plan can be read here, else None."""
    return shares(program, compute_plan(program)) if readable() else None
