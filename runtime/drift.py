"""The drift monitor: does a run route the way the calibration text did when the plan was tuned?

Over a rolling window of the last `window` chunks, per MoE layer: the measured overflow rate (assignments dropped
under `overflow: drop`, spilled under `overflow: spill`) and the total-variation distance between the window's
expert load shares and the plan's calibration shares. It alerts once, on one line through logging, when the
window's overflow rate passes the plan's own spread of window rates on held-out text (mean + SPREAD_SDS sd, never
below RATE_FACTOR x the expected rate; plans without the spread: RATE_FACTOR x the expected held-out rate), or when a
layer's distance passes TV_THRESHOLD. Plans without calibration statistics (made before they existed) get the
measured rates only.
"""
from __future__ import annotations

import logging
from collections import deque

import numpy as np

from runtime.plan import Plan

log = logging.getLogger("npumoe.drift")

WINDOW_CHUNKS = 16  # 16 chunks of 256 tokens: 4,096 tokens, 8,192 assignments per layer at top-2
RATE_FACTOR = 1.5  # the plan holds while its window overflow rate stays within 1.5x the expected held-out rate
# ... or, where the plan keeps the spread of its held-out window rates, within mean + 3 sd of them. The 1.5x rule
# alone false-alarmed on in-domain text: windows at 2.94% against a 2.80% limit (1.5 x 1.87%) while the whole run
# matched the expected 1.87%. Low rates swing by more than half between 16-chunk windows; the spread says how much.
SPREAD_SDS = 3.0
# TV between a full window's load shares and the calibration shares, per layer. Measured with tiny-moe's tuned
# plan (scripts/drift_windows.py, 49 windows of 16 chunks per text): held-out pydoc text (in domain) at most 0.156
# in any layer (median 0.04-0.06); numeric CSV records 0.54-0.70 in every window; standard-library code 0.14-0.25
# (median 0.16-0.20), overlapping in-domain's tail in its mildest windows. 0.2 keeps a 0.044 margin over the
# in-domain maximum. Shorter windows swing too much to judge: 4-chunk windows of held-out pydoc reach TV 0.25 and
# a drop rate 1.7x the expected one, so a window is judged only when full.
TV_THRESHOLD = 0.2


def tv_distance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Total-variation distance between distributions over the same experts, along the last axis: one number for
    two share vectors, one per layer for two [layers, experts] share matrices."""
    return 0.5 * np.abs(np.asarray(p) - np.asarray(q)).sum(axis=-1)


class DriftMonitor:
    """Fed one (expert loads, overflow) pair per layer and chunk by the executor's run statistics."""

    def __init__(self, plan: Plan, window: int = WINDOW_CHUNKS, tv_threshold: float = TV_THRESHOLD) -> None:
        self.policy, self.window, self.tv_threshold = plan.overflow, window, tv_threshold
        self.expected = {lp.layer: lp.calibration.heldout_overflow_rate for lp in plan.layers} \
            if plan.calibrated else None
        self.shares = {lp.layer: np.asarray(lp.calibration.load_shares) for lp in plan.layers} \
            if plan.calibrated else None
        self.expected_rate = plan.heldout_overflow_rate()
        self.rate_limit = None if self.expected_rate is None else RATE_FACTOR * self.expected_rate
        self.spread = plan.window_spread() if window == WINDOW_CHUNKS else None  # measured over windows this long
        if self.spread is not None:
            self.rate_limit = max(self.rate_limit, self.spread[0] + SPREAD_SDS * self.spread[1])
        self.last_layer = max(lp.layer for lp in plan.layers)
        self.layers = [lp.layer for lp in plan.layers]
        self.reset()

    def reset(self) -> None:
        self.recent: dict[int, deque] = {i: deque(maxlen=self.window) for i in self.layers}
        self.chunks = 0
        self.alert, self.reason = False, None

    def observe(self, layer: int, loads: np.ndarray, overflow: int) -> None:
        """One chunk of one layer; the window is judged once the last MoE layer has seen the chunk."""
        self.recent[layer].append((loads, overflow))
        if layer == self.last_layer:
            self.chunks += 1
            if len(self.recent[layer]) == self.window:
                self._judge()

    def _layer(self, layer: int) -> dict:
        loads = np.sum([l for l, _ in self.recent[layer]], axis=0)
        n = max(1, int(loads.sum()))
        rate = sum(o for _, o in self.recent[layer]) / n
        out = {"drop_rate": rate if self.policy == "drop" else 0.0,
               "spill_rate": rate if self.policy == "spill" else 0.0, "assignments": int(loads.sum())}
        if self.shares is not None:
            out["expected_rate"] = self.expected[layer]
            out["tv"] = float(tv_distance(loads / n, self.shares[layer]))
        return out

    def _window(self) -> tuple[dict[int, dict], float]:
        layers = {i: self._layer(i) for i in sorted(self.recent) if self.recent[i]}
        total = sum(s["assignments"] for s in layers.values())
        overflow = sum(sum(o for _, o in self.recent[i]) for i in layers)
        return layers, overflow / max(1, total)

    def _judge(self) -> None:
        if self.alert or self.shares is None:
            return
        layers, rate = self._window()
        verb = "drop" if self.policy == "drop" else "spill"
        if rate > self.rate_limit:
            self.reason = (f"{verb} rate {rate:.2%} over the last {self._seen()} chunks is past {self._limit_says()}: "
                           "this text routes unlike the calibration text; re-tune on it (--record-traces, then "
                           "autotune search --traces)")
        else:
            worst = max(layers, key=lambda i: layers[i]["tv"])
            if layers[worst]["tv"] > self.tv_threshold:
                self.reason = (f"layer {worst}'s expert loads moved from the calibration shares by TV "
                               f"{layers[worst]['tv']:.3f} > {self.tv_threshold} over the last {self._seen()} chunks; "
                               "re-tune on this text (--record-traces, then autotune search --traces)")
        if self.reason:
            self.alert = True
            log.warning("drift: %s", self.reason)

    def _limit_says(self) -> str:
        if self.spread is not None and self.rate_limit > RATE_FACTOR * self.expected_rate:
            mean, sd = self.spread
            return (f"{self.rate_limit:.2%}, the plan's held-out windows' mean {mean:.2%} + {SPREAD_SDS:g} sd "
                    f"({sd:.2%})")
        return f"{RATE_FACTOR}x the plan's expected {self.expected_rate:.2%}"

    def _seen(self) -> int:
        return len(self.recent[self.last_layer])

    def report(self) -> dict:
        """The JSON `drift` object: the last window's figures, and whether (and why) any full window alerted."""
        layers, rate = self._window()
        out = {"window_chunks": self.window, "chunks_in_window": self._seen(), "chunks_seen": self.chunks,
               "overflow": self.policy, "rate": rate, "calibrated": self.shares is not None}
        if self.shares is not None:
            out.update(expected_rate=self.expected_rate, rate_limit=self.rate_limit,
                       window_spread=None if self.spread is None else {"mean": self.spread[0], "sd": self.spread[1]},
                       tv_max=max((s["tv"] for s in layers.values()), default=0.0), tv_threshold=self.tv_threshold)
        out["layers"] = {str(i): s for i, s in layers.items()}
        out["alert"], out["reason"] = self.alert, self.reason or self._quiet_reason()
        return out

    def _quiet_reason(self) -> str | None:
        if self.shares is None:
            return "the plan has no calibration statistics (re-run autotune search to add them)"
        if self._seen() < self.window:  # shorter windows swing too much in-domain (see TV_THRESHOLD)
            return f"not judged: {self._seen()} of the window's {self.window} chunks seen"
        return None
