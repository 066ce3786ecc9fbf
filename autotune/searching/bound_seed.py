"""Starts for the schedule's choice (`overlap_choice`) beside the search's own plans.

A layer's CPU tail (`LayerConfig.cpu_tail`: its coldest experts on cpu-exact beside the GPU's exact path) shortens
the chain the search prices, which has no energy in its latency objective; at the CPU's power it can take a whole
plan past the GPU alone's energy, the cap two chunks in flight are held to. Where every plan of a chunk size within
the ANE's window carries tails past the cap (phi-3.5-moe at one chunk of 4,096 tokens, published M2 Ultra profile),
no placement of its dense half can bring it back under, and that chunk size fell back to the GPU alone. So each plan
with a tail is also offered without it (`tail_free`): the same residents and groups, the tail's experts on the
plan's exact path."""
from __future__ import annotations

import dataclasses

from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import Solution, solution
from autotune.searching.scoring import Scorer


def tail_free(sols: list[Solution], layers: list[LayerData], scorer: Scorer) -> list[Solution]:
    """Each of `sols` that runs a CPU tail in some layer, again with every layer's tail on its exact path (its
    drops unchanged: a tail's experts are computed either way)."""
    out = []
    for sol in sols:
        if sol.baseline is None and any(c.cpu_tail for c in sol.configs):
            configs = [dataclasses.replace(c, cpu_tail=0) for c in sol.configs]
            out.append(dataclasses.replace(solution(configs, layers, scorer, sol.exact_partial), dense=sol.dense))
    return out
