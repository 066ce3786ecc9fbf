"""A linear program over ops split between units: each op's rows in bands, each unit's busy time its share of each
band at the price the cost model gives, each unit busy at most the makespan, the energy at most a cap, what a
static backend keeps resident within its window; the least makespan (`SplitProgram.solve`).

An op is split by rows at the points s_0 = 0 < s_1 < ... < s_K (its bands between them). A unit takes it in a role:
a *prefix* (a static function computing the first rows, `Role.prices` its price for rows [0, s_j) at each point)
or a *suffix* (the host computing the rest, its price for rows [s_j, s_K)). Each band's shares over the roles add
up to the op's cover (1, or a variable: a lazy host's last layer); a prefix's shares do not grow band to band, a
suffix's do not shrink. The LP's price of a role is then a mixture of its prices at the split points (Abel
summation: with shares x_k, sum_k x_k (P(s_k+1) - P(s_k)) = sum_j (x_j-1 - x_j) P(s_j)), so any real split at a
point is one of its solutions, priced at most as the cost model prices it. A one-band op with a prefix role [0, p]
is "the unit does fraction x of it at x p": the chord, a lower bound of a price whose per-row cost does not grow."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_array


@dataclass(frozen=True)
class Role:
    """How one unit takes an op: its prices at the op's split points (K + 1 of them: P(0) = 0 ... P(all) for a
    prefix; H(all) ... H(none) = 0 for a suffix), at `power_w` (W; 0: none known)."""
    unit: str
    prices: tuple[float, ...]
    power_w: float = 0.0
    suffix: bool = False

    def marginals(self) -> np.ndarray:
        """Each band's price: what extending the role by that band adds."""
        p = np.asarray(self.prices, dtype=np.float64)
        return p[:-1] - p[1:] if self.suffix else np.diff(p)


@dataclass
class Solved:
    """The LP's optimum: the makespan, each unit's busy ms, the energy (mJ), each variable's value and the duals of
    the named rows (d makespan / d the row's bound: a unit's busy row's is its share of the makespan; the energy cap's
    and the window's how much the makespan falls per mJ or byte more)."""
    bound_ms: float
    busy_ms: dict[str, float]
    energy_mj: float
    x: np.ndarray
    duals: dict[str, float]
    by_op: dict[str, dict[str, float]] = field(default_factory=dict)  # unit -> op tag -> busy ms
    ops: list[tuple[str, float, list[tuple[Role, list[int]]]]] = field(default_factory=list)  # `SplitProgram.ops`


@dataclass
class SplitProgram:
    """The program as built: variables (unit, busy ms, mJ at share 1, upper bound, op tag), inequality and
    equality rows."""
    cols: list[tuple[str | None, float, float, float | None, str, str]] = field(default_factory=list)  # + step
    ub: list[tuple[dict[int, float], float, str | None]] = field(default_factory=list)
    eq: list[tuple[dict[int, float], float]] = field(default_factory=list)
    window: dict[int, float] = field(default_factory=dict)  # variable -> bytes it keeps resident at share 1
    ops: list[tuple[str, float, list[tuple[Role, list[int]]]]] = field(default_factory=list)  # tag, count, bands

    def var(self, unit: str | None = None, ms: float = 0.0, power_w: float = 0.0, upper: float | None = 1.0,
            tag: str = "", step: str = "") -> int:
        """A variable in [0, upper] (None: no upper bound) that keeps `unit` busy `ms` at share 1 (for op `tag`, in
        the chain's `step`: `solve(chain=True)`)."""
        self.cols.append((unit, float(ms), float(ms) * float(power_w or 0.0), upper, tag, step))
        return len(self.cols) - 1

    def le(self, terms: dict[int, float], rhs: float = 0.0, name: str | None = None) -> None:
        self.ub.append((terms, float(rhs), name))

    def equal(self, terms: dict[int, float], rhs: float = 0.0) -> None:
        self.eq.append((terms, float(rhs)))

    def op(self, roles: list[Role], count: float = 1.0, cover: int | None = None, tag: str = "",
           step: str = "") -> dict[str, int]:
        """An op split over `roles` (see the module docstring), `count` times over (identical ops priced as one);
        `cover`: a variable its bands' shares add up to (None: 1). Returns each role's first band's variable by
        unit (a prefix's is its largest share: what a window counts)."""
        bands = len(roles[0].prices) - 1
        grid = [[self.var(r.unit, m * count, r.power_w, tag=tag, step=step) for m in r.marginals()] for r in roles]
        self.ops.append((tag, count, list(zip(roles, grid))))  # each role's band variables, to read a split back
        for k in range(bands):
            terms = {g[k]: 1.0 for g in grid}
            if cover is None:
                self.equal(terms, 1.0)
            else:
                self.equal({**terms, cover: -1.0})
        for r, g in zip(roles, grid):
            for a, b in zip(g[:-1], g[1:]):  # a prefix does not grow band to band, a suffix does not shrink
                self.le({a: -1.0, b: 1.0} if not r.suffix else {a: 1.0, b: -1.0})
        return {r.unit: g[0] for r, g in zip(roles, grid)}

    def solve(self, energy_cap_mj: float | None = None, window_bytes: float | None = None,
              chain: bool = False) -> Solved:
        """The least makespan T: each unit's busy time at most T, the energy at most `energy_cap_mj` and the resident
        bytes at most `window_bytes` (None: no such row). `chain`: the ops run as one chain of steps (each variable's
        `step`), each step's units side by side and the next step after the slowest, so T is the sum over steps of
        each step's longest unit (one chunk as its schedule runs it). Raises ValueError where no split fits."""
        n = len(self.cols)
        units = sorted({u for u, *_ in self.cols if u is not None})
        rows, extra = self._busy_rows(units, chain)
        if energy_cap_mj is not None:
            rows.append(({i: c[2] for i, c in enumerate(self.cols) if c[2]}, energy_cap_mj, "energy_cap"))
        if window_bytes is not None and self.window:
            rows.append((dict(self.window), window_bytes, "window"))
        rows += self.ub
        width = n + 1 + extra
        c = np.zeros(width)
        c[n] = 1.0
        got = linprog(c, A_ub=_matrix([r[0] for r in rows], width), b_ub=[r[1] for r in rows],
                      A_eq=_matrix([e[0] for e in self.eq], width) if self.eq else None,
                      b_eq=[e[1] for e in self.eq] if self.eq else None,
                      bounds=[(0.0, c[3]) for c in self.cols] + [(0.0, None)] * (1 + extra), method="highs")
        if not got.success:
            raise ValueError(f"no split fits: {got.message}")
        x = got.x[:n]
        by_op: dict[str, dict[str, float]] = {u: {} for u in units}
        for (unit, ms, _, _, tag, _), share in zip(self.cols, x):
            if unit is not None and ms * share:
                by_op[unit][tag] = by_op[unit].get(tag, 0.0) + ms * share
        busy = {u: float(sum(t.values())) for u, t in by_op.items()}
        energy = float(sum(c[2] * x[i] for i, c in enumerate(self.cols)))
        duals = {name: -float(d) for (_, _, name), d in zip(rows, got.ineqlin.marginals) if name}
        return Solved(float(got.x[n]), busy, energy, x, duals, by_op, self.ops)

    def _busy_rows(self, units: list[str], chain: bool) -> tuple[list[tuple[dict[int, float], float, str | None]], int]:
        """The rows that bound the makespan (variable n) and how many variables they add after it: each unit's busy
        time at most it; or, for a chain, each step's (variable n + 1 + k) at least each unit's busy time in it, and
        the makespan at least their sum."""
        n = len(self.cols)
        if not chain:
            return [({i: c[1] for i, c in enumerate(self.cols) if c[0] == u and c[1]} | {n: -1.0}, 0.0, f"busy:{u}")
                    for u in units], 0
        steps: dict[str, dict[str, dict[int, float]]] = {}
        for i, (unit, ms, _, _, _, step) in enumerate(self.cols):
            if unit is not None and ms:
                steps.setdefault(step, {}).setdefault(unit, {})[i] = ms
        rows: list[tuple[dict[int, float], float, str | None]] = [
            (terms | {n + 1 + k: -1.0}, 0.0, None) for k, by_unit in enumerate(steps.values())
            for terms in by_unit.values()]
        rows.append(({n + 1 + k: 1.0 for k in range(len(steps))} | {n: -1.0}, 0.0, "chain"))
        return rows, len(steps)


def _matrix(rows: list[dict[int, float]], width: int) -> coo_array:
    r, c, v = [], [], []
    for i, terms in enumerate(rows):
        for j, value in terms.items():
            r.append(i)
            c.append(j)
            v.append(value)
    return coo_array((v, (r, c)), shape=(len(rows), width)).tocsr()
