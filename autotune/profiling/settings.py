"""What `autotune profile-device` measures and how hard: the shapes, token grids and repetition rules."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import NpumoeError

# (hidden, expert FFN) of the model sizes we target.
SHAPES = {"tiny-moe": (256, 256), "bench-layer": (1024, 2048), "qwen3-30b-a3b": (2048, 768)}
CLOCKS = ("auto", "cpu", "wall")  # auto: per record, CPU time for one-thread CPU work, else the wall clock
MAX_PACK_ELEMENTS = 2**26  # padded buffers up to 256 MB (fp32): larger ones only measure this host's page faults


@dataclass(frozen=True)
class Settings:
    """What to measure and how hard. `quick` fits in 5 minutes on 2 cores; the full run in 30."""
    shapes: dict[str, tuple[int, int]]
    tokens: list[int]  # M grid for single-expert calls
    groups: list[tuple[int, int]]  # (G experts, capacity C) for multi-expert calls
    pack_tokens: list[int]  # chunk sizes for pack / exact_host records
    top_k: int = 2
    num_experts: int = 16
    warmup: int = 1
    min_runs: int = 5
    max_runs: int = 50
    min_time_s: float = 0.15  # keep repeating small calls until this much time has passed
    quick: bool = False
    kernels: bool = True  # time the CPU's expert kernels per storage kind (autotune/profiling/kernels.py)
    dense_shapes: tuple[str, ...] | None = None  # the dense ops' model sizes (dense_records.DENSE_SHAPES; None: all)

    def to_json(self) -> dict:
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "tokens": self.tokens,
                "groups": [list(g) for g in self.groups], "pack_tokens": self.pack_tokens, "top_k": self.top_k,
                "num_experts": self.num_experts, "warmup": self.warmup, "min_runs": self.min_runs,
                "max_runs": self.max_runs, "min_time_s": self.min_time_s, "quick": self.quick,
                "kernels": self.kernels, "dense_shapes": self.dense_shapes}


def settings_for(quick: bool) -> Settings:
    # Every M up to 16 (GEMM kernels switch there: per-expert time is not monotonic in M), then 2-4 per octave.
    if quick:
        tokens = [*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512, 640,
                  768, 1024, 1536, 2048]
        return Settings(SHAPES, tokens=tokens, groups=[(4, 16), (4, 64), (8, 32), (4, 256), (16, 64)],
                        pack_tokens=[32, 64, 128, 256, 512, 1024, 2048, 4096], quick=True)
    tokens = sorted({*range(1, 33), *(int(round(2 ** (i / 4))) for i in range(20, 49))})  # ... 4096
    return Settings(SHAPES, tokens=tokens,
                    groups=[(2, 8), (4, 16), (4, 64), (8, 32), (4, 256), (8, 128), (16, 64), (16, 16), (4, 1024)],
                    pack_tokens=[16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 4096], min_runs=9,
                    min_time_s=0.4, max_runs=100)


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """`tiny-moe,2048x768` -> {name: (hidden, ffn)}."""
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in SHAPES:
            out[item] = SHAPES[item]
            continue
        try:
            h, f = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise NpumoeError(f"--shapes: {item!r} is neither a named size ({', '.join(SHAPES)}) nor HIDDENxFFN") \
                from None
        out[f"{h}x{f}"] = (h, f)
    return out
