"""How the CPU holds the experts, decided once per search, before the expert search: the storage changes the exact
path's price and the memory any plan needs, not the per-layer decision space, so the Optuna search runs once, at
the storage chosen.

- `--cpu-weights` pins one storage for the plan (a budget it cannot meet is refused in one line);
- without a pin and without `--memory-gb`: the experts as loaded (bf16), as before;
- with `--memory-gb`: bf16 where its any-plan memory fits the budget (the model as stored, nothing to measure);
  else, of the quantized storages whose any-plan memory fits (`costing/memory.fixed_memory` at the largest
  chunk; int4 only where the expert shapes divide into its blocks of 64), the one whose CPU expert path is
  predicted cheapest (every expert on the exact path over the calibration traces, priced by
  `costing/cpu_storage`); none fitting is one line naming what the smallest needs.

A model already packed (an MLX folder) is held as stored: there is nothing to choose.

A quantized storage's kernels (which runs from which row count: `Plan.cpu_weights.kernel_rows`) are the profile's
fastest per measured row range, else the runtime's defaults (`costing/cpu_storage.planned_kernels`); the fidelity
gate keeps them, or the ones that round fewer rows where the faster ones fail it (`after_gate`). Where the gate
refuses every candidate of a storage the budget chose, the search gates the next wider one that fits (`wider`:
int4 -> int8 -> bf16); a pin is never overridden.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from autotune.costing.costmodel import CostModel
from autotune.costing.cpu_storage import (
    SEARCHED,
    packed_checkpoint_price,
    parse_storage,
    planned_kernels,
    storage_name,
    storage_price,
)
from autotune.costing.memory import GB, ModelSize, fixed_memory
from autotune.evaluation.gate import GateLimits
from autotune.searching.layer_data import LayerData
from runtime.errors import NpumoeError
from runtime.plan import CpuWeights


@dataclass
class CpuChoice:
    storage: str  # bf16, int8 or int4:<group>; or the packed checkpoint's, as loaded
    cost: CostModel  # the profile's cost model with this storage's price
    ane_bytes: float | None  # what the budget leaves for ANE packages at the largest chunk (None: no budget)
    options: list[dict]  # every storage considered: its memory, whether it fits, its CPU expert path's price
    reason: str  # the figure that decided, in words
    decided: bool  # a pin or a budget chose it: the plan records it
    kernel_rows: dict[str, int] | None = None  # the row count from which each kernel runs (None: bf16 or as loaded)
    kernels_reason: str = ""  # where kernel_rows comes from, and the gate's figures where it decided
    wider: CpuChoice | None = None  # the next wider storage that fits the budget (None: a pin, or none fits)
    refused: list[dict] = field(default_factory=list)  # the narrower storages the gate refused, their closest

    @property
    def kind_and_group(self) -> tuple[str, int | None]:
        return parse_storage(self.storage) if self.decided else ("bf16", None)

    def plan_field(self) -> CpuWeights | None:
        """The plan's `cpu_weights` (None: as loaded, nothing decided)."""
        if not self.decided:
            return None
        kind, group = self.kind_and_group
        return CpuWeights(kind=kind, group_size=group, kernel_rows=self.kernel_rows)

    def after_gate(self, gate: dict) -> CpuChoice:
        """This storage with the kernels of the gate's chosen candidate, and why, in the gate's figures."""
        chosen = gate["chosen"]
        if self.kernel_rows is None or chosen is None:
            return self
        by_index, tried = {r["index"]: r for r in gate["candidates"]}, [chosen]
        while "retry_of" in tried[0]:  # the chosen row's remeasures, back to the first measure
            tried.insert(0, by_index[tried[0]["retry_of"]])
        said = ", ".join(f"candidate {r['index']} {_kernels(r['kernel_rows'])}: top-1 {r['top1']:.4f}, perplexity "
                         f"delta {r['ppl_delta']:+.3%} ({'passed' if r['passed'] else 'refused'})" for r in tried)
        kept = chosen["kernel_rows"] == self.kernel_rows
        return replace(self, kernel_rows=chosen["kernel_rows"], kernels_reason=(
            f"{self.kernels_reason}; the gate "
            f"{'passed them' if kept else 'refused them, so the kernels that round fewer rows'}: {said}"))

    def after_refusal(self, gate: dict) -> CpuChoice:
        """The next wider storage, to gate once the gate refused every candidate of this one (`gate`)."""
        limits = GateLimits(**gate["limits"])
        closest = min(gate["candidates"], key=lambda r: limits.shortfall(r["ppl_delta"], r["top1"]))
        said = {"storage": self.storage, "candidates": len(gate["candidates"]),
                "closest": {k: closest[k] for k in ("index", "ppl_delta", "top1", "kl")}}
        return replace(self.wider, refused=[*self.refused, said])

    def to_json(self) -> dict:
        return {"storage": self.storage, "decided_by": "pin" if self.reason.startswith("--cpu-weights") else
                ("budget" if self.decided else "as loaded"), "reason": self.reason, "options": self.options,
                "label": "predicted: memory by costing/memory.py, prices by the profile's cost model "
                         "(costing/cpu_storage.py)",
                "kernel_rows": self.kernel_rows, "kernels": _kernels(self.kernel_rows) if self.kernel_rows else None,
                "kernels_reason": self.kernels_reason, "gate_refused": self.refused}


def _kernels(rows: dict[str, int]) -> str:
    """`{"packed": 0, "int_mm": 16}` as "packed from 0 rows, int_mm from 16"."""
    return ", ".join(f"{k} from {r}{' rows' if not i else ''}"
                     for i, (k, r) in enumerate(sorted(rows.items(), key=lambda kv: kv[1])))


def all_cpu_ms(cost: CostModel, layers: list[LayerData], hidden: int, ffn: int, prompt_tokens: int) -> float:
    """Every expert on the exact path, per prompt of `prompt_tokens` over the calibration traces (predicted)."""
    total = sum(float(cost.exact_ms(d.calib, hidden, ffn).sum()) for d in layers)
    return total / max(float(layers[0].tokens.sum()) / prompt_tokens, 1e-9)


def choose_cpu_storage(pin: str | None, memory_gb: float | None, size: ModelSize, cost: CostModel,
                       kernel_records: list[dict], layers: list[LayerData], hidden: int, ffn: int, chunk: int,
                       prompt_tokens: int) -> CpuChoice:
    """The search's CPU storage (module docstring); `layers` at the largest chunk searched, `chunk` that chunk."""
    if size.storage != "bf16":
        if pin not in (None, "bf16"):
            raise NpumoeError(f"--cpu-weights {pin}: the model is already quantized ({size.storage}, kept packed "
                              "as stored); give a full-width checkpoint or leave --cpu-weights out")
        fixed = fixed_memory(size, chunk, prompt_tokens)
        packed = cost.with_cpu_storage(packed_checkpoint_price(cost, size.storage, hidden, ffn), False)
        return CpuChoice(size.storage, packed, _left(memory_gb, fixed, size.storage), [], "the checkpoint's own "
                         f"packed storage ({size.storage}): needs {fixed.total / GB:.2f} GB", False)
    storages = [storage_name(*parse_storage(pin))] if pin else list(SEARCHED if memory_gb is not None else ("bf16",))
    if not pin:  # int4 packs rows in blocks of 64 and groups of inputs: a shape it cannot hold is not a choice
        storages = [s for s in storages if not s.startswith("int4") or not (hidden % 64 or ffn % 64)]
    options, costs = [], {}
    for s in storages:
        kind, group = parse_storage(s)
        fixed = fixed_memory(size, chunk, prompt_tokens, kind, group or 64)
        price = storage_price(cost, kernel_records, s, hidden, ffn)
        costs[s] = cost.with_cpu_storage(price)
        options.append({"storage": s, "memory_gb": round(fixed.total / GB, 3),
                        "fits": memory_gb is None or fixed.total <= memory_gb * GB,
                        "all_cpu_ms_per_prompt": round(all_cpu_ms(costs[s], layers, hidden, ffn, prompt_tokens), 3),
                        "price": price.to_json() if price else {"storage": "bf16", "source": "the cost model's fit"}})
    fitting = [o for o in options if o["fits"]]

    def pick(option: dict, reason: str, decided: bool = True) -> CpuChoice:
        s = option["storage"]
        kind, group = parse_storage(s)
        left = _left(memory_gb, fixed_memory(size, chunk, prompt_tokens, kind, group or 64), s)
        rows, why = planned_kernels(kernel_records, s, hidden) if decided else (None, "")
        at = fitting.index(option) if option in fitting else 0  # fitting: widest first
        wider = None if pin or memory_gb is None or not at else pick(
            fitting[at - 1], f"the gate refused every {s} candidate; {fitting[at - 1]['storage']} is the next wider "
                             f"storage that fits: any plan needs {fitting[at - 1]['memory_gb']:.2f} GB of "
                             f"{memory_gb:g}")
        return CpuChoice(s, costs[s], left, options, reason, decided, rows, why, wider)

    if pin:
        o = options[0]
        if not o["fits"]:
            raise NpumoeError(f"--cpu-weights {pin} --memory-gb {memory_gb:g}: with {o['storage']} experts any plan "
                              f"needs {o['memory_gb']:.2f} GB ({_parts(size, chunk, prompt_tokens, o['storage'])}); "
                              "give a larger --memory-gb or a smaller storage")
        return pick(o, f"--cpu-weights {pin} (pinned)")
    if memory_gb is None:
        return pick(options[0], "as loaded (no --memory-gb)", False)
    if not fitting:
        least = min(options, key=lambda o: o["memory_gb"])
        raise NpumoeError(f"--memory-gb {memory_gb:g} is below what any plan needs with any CPU storage: the "
                          f"smallest, {least['storage']}, needs {least['memory_gb']:.2f} GB "
                          f"({_parts(size, chunk, prompt_tokens, least['storage'])}); give --memory-gb "
                          f"{least['memory_gb']:.2f} or more")
    if fitting[0]["storage"] == "bf16":
        return pick(fitting[0], f"bf16 fits: any plan needs {fitting[0]['memory_gb']:.2f} GB of {memory_gb:g}")
    best = min(fitting, key=lambda o: o["all_cpu_ms_per_prompt"])
    others = ", ".join(f"{o['storage']} {o['all_cpu_ms_per_prompt']:.4g} ms" for o in fitting if o is not best)
    bf16 = options[0]
    return pick(best, f"bf16 needs {bf16['memory_gb']:.2f} GB > {memory_gb:g}; {best['storage']} needs "
                      f"{best['memory_gb']:.2f} GB and its CPU expert path is the cheapest that fits: "
                      f"{best['all_cpu_ms_per_prompt']:.4g} ms per {prompt_tokens}-token prompt all on the CPU"
                      + (f" (against {others})" if others else "") + f", {best['price']['source'].split(':')[0]}")


def _parts(size: ModelSize, chunk: int, prompt_tokens: int, storage: str) -> str:
    kind, group = parse_storage(storage)
    return fixed_memory(size, chunk, prompt_tokens, kind, group or 64).describe()


def _left(memory_gb: float | None, fixed, storage: str) -> float | None:
    if memory_gb is None:
        return None
    if fixed.total > memory_gb * GB:
        raise NpumoeError(f"--memory-gb {memory_gb:g} is below what any plan needs with the experts as stored "
                          f"({storage}): {fixed.describe()}; give --memory-gb {fixed.total / GB:.2f} or more")
    return memory_gb * GB - fixed.total

