"""What `autotune build` returns (and prints as `--json`): sizes, the host check, where the time went."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class BuildResult:
    package: str  # the manifest's first package (the only one when the plan fits one package)
    functions: list  # runtime.coreml.converter.FunctionSpec, one per ANE group
    layout: str
    compress: str  # the one compression every function uses, or "mixed" (each function's is in `functions`)
    package_bytes: int  # all packages together, on disk
    unique_weight_bytes: int  # the distinct expert (and dense function) matrices the packages need, counted in fp16
    cached: int  # functions taken from the cache instead of converted
    build_seconds: float
    checks: list = field(default_factory=list)  # per-function numeric checks (runtime.coreml.mil_eval.FunctionCheck)
    packages: list[dict] = field(default_factory=list)  # per package: path, functions, weight_bytes, bytes
    manifest: str = ""
    largest_function_weight_bytes: int = 0
    seconds: dict = field(default_factory=dict)  # where the time went: convert, merge, verify
    function_weight_limit_bytes: int = 0  # the limit the functions were split under
    dense: list = field(default_factory=list)  # the plan's dense functions built (runtime.backends.DenseSpec)

    @property
    def max_rel_error(self) -> float:
        return max((c.max_rel_error for c in self.checks), default=float("nan"))

    def to_json(self) -> dict:
        """What `autotune build --json` prints: sizes, the host check against its tolerance, where the time went."""
        kinds = Counter(fs.compress for fs in self.functions)
        return {"package": self.package, "package_bytes": self.package_bytes,
                "unique_weight_bytes": self.unique_weight_bytes,
                "size_ratio": round(self.package_bytes / self.unique_weight_bytes, 4),
                "max_rel_error": self.max_rel_error,
                "tolerance": max((c.tolerance for c in self.checks), default=float("nan")),
                "dense_functions": len(self.dense),
                "attention_functions": sum(spec.kind == "attention" for spec in self.dense),
                "functions": len(self.functions), "cached_functions": self.cached, "layout": self.layout,
                "compress": self.compress, "compress_counts": dict(sorted(kinds.items())),
                "build_seconds": round(self.build_seconds, 2), "manifest": self.manifest, "packages": self.packages,
                "largest_function_weight_bytes": self.largest_function_weight_bytes,
                "function_weight_limit_bytes": self.function_weight_limit_bytes,
                "build_mb_per_s": round(self.unique_weight_bytes / 1e6 / self.build_seconds, 2),
                "build_seconds_by_stage": self.seconds}
