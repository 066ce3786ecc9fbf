"""A test stand-in for Core AI's compute plan, so that the build's placement proof (runtime/coreai/placement.py) runs
on Linux, where the in-package runtime takes no SpecializationOptions and reports no devices.

Only Apple's `ComputePlan` is replaced: `from_program(program, options)` walks the program's own ops (their real
names and ids, as Apple's `to_dict` reports them) and places each by its name (`devices`: op name -> device; the
rest on the Neural Engine). As Apple's plan does, constants get no entry and the graph's output an entry that
resolves to `UNKNOWN` alone.
"""
from __future__ import annotations

from runtime.coreai import assets, placement


class ComputePlan:
    devices: dict[str, str] = {}  # op name -> device ("CPU", "GPU"); others on the Neural Engine

    def __init__(self, entries: list[dict]) -> None:
        self.entries = entries

    @classmethod
    async def from_program(cls, program, specialization_options=None) -> "ComputePlan":
        assert specialization_options == "neural-engine"
        from coreai_torch.debugging.debug_info import get_operation_id
        from coreai_torch.debugging.utils import _walk_operations

        entries = []
        for op in _walk_operations(program):
            op_id = get_operation_id(op)
            if op_id is None or op.name in ("coreai.constant", "coreai.graph", "builtin.module"):
                continue
            device = "UNKNOWN" if op.name == "coreai.output" else cls.devices.get(op.name, "NEURAL_ENGINE")
            entries.append({"operation_id": op_id, "devices": [device], "names": op.name})
        return cls(entries)

    def to_dict(self, program=None) -> dict:
        hist: dict[str, int] = {}
        for e in self.entries:
            hist[e["devices"][0]] = hist.get(e["devices"][0], 0) + 1
        return {"entries": [{"operation_id": e["operation_id"], "devices": e["devices"]} for e in self.entries],
                "entry_count": len(self.entries), "device_histogram": hist,
                "operation_names": {e["operation_id"]: e["names"] for e in self.entries}}


def install(monkeypatch, devices: dict[str, str] | None = None) -> type[ComputePlan]:
    """Core AI's compute plan replaced for this test, readable here; `devices` places ops off the Neural Engine."""
    import coreai_torch.debugging.compute_plan as cp

    plan = type("ComputePlan", (ComputePlan,), {"devices": dict(devices or {})})
    monkeypatch.setattr(cp, "ComputePlan", plan)
    monkeypatch.setattr(assets, "neural_engine_options", lambda: "neural-engine")
    monkeypatch.setattr(placement, "readable", lambda: True)
    return plan
