"""Joint sellability: can the fleet serve everything sold, at every moment? (docs/design.md#sold)

Pure: plain data in, numbers out (numpy and SciPy's HiGHS, no Django), so selling, the
catalogue's and pricing's re-checks, the allocation tick and the bench all ask the same
programme.

Sold capacity is feasible at a moment when some assignment of every pool's GPUs to the
deployments on it, in whole replicas, serves every model's sold MU/min then:

    variables   x_d ∈ {0, 1, 2, …}   replicas of deployment d
    per pool    Σ_{d in p} g_d x_d ≤ G_p                   (GPUs)
    per d       x_d ≤ min(max_replicas_d, ⌊G_p / g_d⌋)
    per model   Σ_{d of m} r_d x_d ≥ sold_m                (r_d: the MU/min a replica mints,
                                                            × (1 − headroom) × overcommit)

Models that share no pool, directly or through other models, never compete: the check runs
per connected component of the model–pool graph (`connected_models`).

Two programmes answer. The mixed-integer one above (HiGHS's branch and bound, `milp`) decides:
whether a sale fits (`whole_fits`) and how much a model can still take (`whole_available`).
Its linear relaxation (x_d ≥ 0 real, `linprog`) explains: its duals name the pools and
deployments that bind, and it screens (a sale the relaxation refuses, whole replicas refuse
too). The relaxation alone would let two models split a replica's GPUs: 405 + 157.5 MU/min of
two models on one 8-GPU pool fit it fractionally (4.5 replicas of 1 GPU, 1.75 of 2) and need 9
whole GPUs. The least unserved MU/min of what is already sold (`shortfall`: the at-risk
re-checks, the oversold state, the tick) is still the relaxation's: it can understate a
shortfall by less than one replica per deployment that shares its pool with another.

The moments checked are the first moment of the span and every start of a reservation in it:
the sold total only rises there. A moment whose sold vector is at or below another's in every
model needs no check of its own (`pareto_moments`). Each mixed-integer programme is one
moment's, small (a model's group of pools and deployments): the componentwise maximum of a
set of moments dominates each of them, so it is tried first for the whole span (when it fits,
every moment fits: one programme, the common case) and a set whose maximum does not fit is
split in two. A branch and bound over moments that takes longer than WHOLE_REPLICAS_SECONDS
stops undecided (None), and the caller falls back to the relaxation's answer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

# MU/min below this, relative to the sold total, is the solver's rounding, not a shortfall.
RELATIVE_TOLERANCE = 1e-7
ABSOLUTE_TOLERANCE_MU = 1e-6
# A dual value (MU/min per GPU, or per replica) this small says the constraint does not bind.
MARGINAL_TOLERANCE = 1e-9
# The most one whole-replica answer (every moment of a span) may take; past it, undecided.
WHOLE_REPLICAS_SECONDS = 2.0


class Undecided(Exception):
    """The branch and bound ran out of WHOLE_REPLICAS_SECONDS before it could answer."""


@dataclass(frozen=True)
class PoolSpec:
    pool_id: int
    name: str
    gpu_count: int


@dataclass(frozen=True)
class UnitSpec:
    """A deployment as the programme sees it."""

    deployment_id: int
    name: str
    model_id: int
    pool_id: int
    gpus_per_replica: int
    max_replicas: int
    # MU/min one replica mints × (1 − headroom) × overcommit; 0: it sells nothing.
    sellable_mu_per_minute_per_replica: float


@dataclass(frozen=True)
class Binding:
    """What limits the answer: pools out of GPUs, deployments at their max_replicas."""

    pools: tuple[int, ...] = ()
    deployments: tuple[int, ...] = ()


@dataclass(frozen=True)
class Available:
    """The most an open-ended addition to one model fits at every moment, others' sales met."""

    # MU/min; negative when the model's own sales do not fit; None when the other models'
    # sales do not fit whatever this one gets (the component is oversold without it).
    mu_per_minute: float | None
    moment_index: int  # into the moments given: where it binds
    binding: Binding = field(default_factory=Binding)


@dataclass(frozen=True)
class Shortfall:
    """The least sold MU/min left unserved at each moment (an assignment that minimises it)."""

    per_model: np.ndarray  # (moments × models), MU/min of each model left unserved
    binding: tuple[Binding, ...]  # per moment

    @property
    def per_moment(self) -> np.ndarray:
        totals: np.ndarray = self.per_model.sum(axis=1)
        return totals


def tolerance(sold_total: float) -> float:
    return max(ABSOLUTE_TOLERANCE_MU, RELATIVE_TOLERANCE * sold_total)


def connected_models(edges: Iterable[tuple[int, int]], seeds: Iterable[int]) -> set[int]:
    """Every model reachable from `seeds` through shared pools; `edges` are (model, pool)."""
    pools_of: dict[int, set[int]] = {}
    models_of: dict[int, set[int]] = {}
    for model_id, pool_id in edges:
        pools_of.setdefault(model_id, set()).add(pool_id)
        models_of.setdefault(pool_id, set()).add(model_id)
    found = set(seeds)
    frontier = list(found)
    while frontier:
        model_id = frontier.pop()
        for pool_id in pools_of.get(model_id, ()):
            for other in models_of[pool_id]:
                if other not in found:
                    found.add(other)
                    frontier.append(other)
    return found


def components(edges: Iterable[tuple[int, int]], model_ids: Iterable[int]) -> list[set[int]]:
    """The models split into groups that share pools (each group sorted out once)."""
    edges = list(edges)
    left = set(model_ids)
    groups = []
    while left:
        group = connected_models(edges, [min(left)]) & left | {min(left)}
        groups.append(group)
        left -= group
    return groups


def demand_matrix(
    *,
    model_index: dict[int, int],
    terms: Sequence[tuple[int, float, float | None, float]],
    start: float,
    end: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Moments (seconds, ascending) and the MU/min sold of each model at each.

    `terms` are (model id, start, end or None for open-ended, MU/min) in seconds, already
    limited to those that overlap [start, end)."""
    starts = np.array([t[1] for t in terms], dtype=float)
    later = starts[(starts > start) & ((starts < end) if end is not None else True)]
    moments = np.unique(np.concatenate([[start], later]))
    demand = np.zeros((moments.size + 1, len(model_index)))
    if terms:
        columns = np.array([model_index[t[0]] for t in terms])
        ends = np.array([np.inf if t[2] is None else t[2] for t in terms], dtype=float)
        mu = np.array([t[3] for t in terms], dtype=float)
        # A term counts at the moments in [its start, its end): a difference array per model.
        first = np.searchsorted(moments, starts, side="left")
        stop = np.searchsorted(moments, ends, side="left")
        first = np.where(starts <= start, 0, first)
        np.add.at(demand, (first, columns), mu)
        np.add.at(demand, (stop, columns), -mu)
    demand = np.cumsum(demand, axis=0)[:-1]
    return moments, np.maximum(demand, 0.0)


def pareto_moments(demand: np.ndarray) -> np.ndarray:
    """Indices of the moments not dominated by another (ties: the first kept)."""
    if demand.shape[0] <= 1:
        return np.arange(demand.shape[0])
    order = np.argsort(-demand.sum(axis=1), kind="stable")
    kept: list[int] = []
    kept_rows = np.empty((0, demand.shape[1]))
    for index in order:
        row = demand[index]
        if kept and np.any(np.all(kept_rows >= row - 1e-12, axis=1)):
            continue
        kept.append(int(index))
        kept_rows = np.vstack([kept_rows, row])
    return np.array(sorted(kept))


class Programme:
    """One group of models' programme, built once and solved for any stack of moments."""

    def __init__(
        self, *, pools: Sequence[PoolSpec], units: Sequence[UnitSpec], model_ids: Sequence[int]
    ) -> None:
        self.model_ids = list(model_ids)
        self.model_index = {model_id: i for i, model_id in enumerate(self.model_ids)}
        by_id = {pool.pool_id: pool for pool in pools}
        usable = []
        for unit in units:
            pool = by_id.get(unit.pool_id)
            if pool is None or unit.model_id not in self.model_index:
                continue
            fits = pool.gpu_count // unit.gpus_per_replica
            bound = min(unit.max_replicas, fits)
            if unit.sellable_mu_per_minute_per_replica > 0 and bound > 0:
                usable.append((unit, bound, fits <= unit.max_replicas))
        self.units = [unit for unit, _, _ in usable]
        self.upper = np.array([bound for _, bound, _ in usable], dtype=float)
        # Whether the pool (not max_replicas) is what bounds the deployment.
        self.pool_bounded = np.array([limited for _, _, limited in usable], dtype=bool)
        pool_ids = sorted({unit.pool_id for unit in self.units})
        self.pools = [by_id[pool_id] for pool_id in pool_ids]
        pool_row = {pool_id: i for i, pool_id in enumerate(pool_ids)}
        n_units = len(self.units)
        self.gpus = sparse.csr_matrix(
            (
                [float(unit.gpus_per_replica) for unit in self.units],
                ([pool_row[unit.pool_id] for unit in self.units], range(n_units)),
            ),
            shape=(len(self.pools), n_units),
        )
        self.rates = sparse.csr_matrix(
            (
                [unit.sellable_mu_per_minute_per_replica for unit in self.units],
                ([self.model_index[unit.model_id] for unit in self.units], range(n_units)),
            ),
            shape=(len(self.model_ids), n_units),
        )
        self.gpu_counts = np.array([float(pool.gpu_count) for pool in self.pools])

    # --- The shortfall: least sold MU/min left unserved ------------------------------------

    def shortfall(self, demand: np.ndarray) -> Shortfall:
        """Per moment (rows of `demand`, models in `model_ids` order), the least unserved."""
        moments, n_models = demand.shape
        n_units, n_pools = len(self.units), len(self.pools)
        if moments == 0:
            return Shortfall(np.zeros((0, n_models)), ())
        # Per moment: [x (units), s (models)]; rows [pools, models]:
        #   G x ≤ G_p    and    −R x − s ≤ −sold
        block = sparse.bmat(
            [
                [self.gpus, sparse.csr_matrix((n_pools, n_models))],
                [-self.rates, -sparse.identity(n_models, format="csr")],
            ],
            format="csr",
        )
        a_ub = sparse.kron(sparse.identity(moments, format="csr"), block, format="csr")
        b_ub = np.concatenate(
            [np.concatenate([self.gpu_counts, -demand[k]]) for k in range(moments)]
        )
        cost = np.tile(np.concatenate([np.zeros(n_units), np.ones(n_models)]), moments)
        upper = np.tile(np.concatenate([self.upper, demand.max(axis=0)]), moments)
        bounds = np.column_stack([np.zeros(cost.size), upper])
        result = _solve(cost, a_ub, b_ub, bounds)
        width = n_units + n_models
        solution = result.x.reshape(moments, width)
        per_model = np.maximum(solution[:, n_units:], 0.0)
        pool_marginals = result.ineqlin.marginals.reshape(moments, n_pools + n_models)[:, :n_pools]
        upper_marginals = result.upper.marginals.reshape(moments, width)[:, :n_units]
        binding = tuple(
            self._binding(pool_marginals[k], upper_marginals[k], solution[k, :n_units])
            if per_model[k].sum() > tolerance(demand[k].sum())
            else Binding()
            for k in range(moments)
        )
        return Shortfall(per_model, binding)

    # --- What remains for one model, given the others' sales -------------------------------

    def available(self, demand: np.ndarray, model_id: int) -> Available:
        """The most MU/min an addition to `model_id` gets at every moment, others met."""
        moments, n_models = demand.shape
        n_units, n_pools = len(self.units), len(self.pools)
        target = self.model_index[model_id]
        rows = n_pools + n_models
        # Per moment: [x (units)] rows [pools, models]; one shared z:  −R_m x + z ≤ −sold_m.
        block = sparse.vstack([self.gpus, -self.rates], format="csr")
        stacked = sparse.kron(sparse.identity(moments, format="csr"), block, format="csr")
        z_rows = np.arange(moments) * rows + n_pools + target
        z_column = sparse.csr_matrix(
            (np.ones(moments), (z_rows, np.zeros(moments, dtype=int))), shape=(moments * rows, 1)
        )
        a_ub = sparse.hstack([stacked, z_column], format="csr")
        b_ub = np.concatenate(
            [np.concatenate([self.gpu_counts, -demand[k]]) for k in range(moments)]
        )
        cost = np.zeros(moments * n_units + 1)
        cost[-1] = -1.0
        bounds = np.column_stack(
            [
                np.concatenate([np.zeros(moments * n_units), [-np.inf]]),
                np.concatenate([np.tile(self.upper, moments), [np.inf]]),
            ]
        )
        result = _solve(cost, a_ub, b_ub, bounds, infeasible_ok=True)
        if result is None:
            return Available(None, int(np.argmax(demand.sum(axis=1))))
        marginals = result.ineqlin.marginals.reshape(moments, rows)
        moment = int(np.argmax(np.abs(marginals[:, n_pools + target])))
        x = result.x[:-1].reshape(moments, n_units)
        upper_marginals = result.upper.marginals[:-1].reshape(moments, n_units)
        return Available(
            float(result.x[-1]),
            moment,
            self._binding(marginals[moment, :n_pools], upper_marginals[moment], x[moment]),
        )

    # --- Whole replicas: the decision ---------------------------------------------------

    def whole_fits(
        self,
        demand: np.ndarray,
        model_id: int,
        mu_per_minute: float,
        *,
        hint: int | None = None,
        seconds: float = WHOLE_REPLICAS_SECONDS,
    ) -> bool | None:
        """Whether adding `mu_per_minute` to `model_id` at every moment (rows of `demand`)
        leaves each moment servable in whole replicas; None when undecided in `seconds`. A set
        of moments is checked at its componentwise maximum, and split in two when that does
        not fit: a moment that does not fit alone refuses. `hint`: the moment to try first
        (where the relaxation binds: the likeliest to refuse)."""
        added = demand.copy()
        added[:, self.model_index[model_id]] += mu_per_minute
        deadline = time.monotonic() + seconds
        pending = [np.arange(added.shape[0])]
        try:
            if hint is not None and self._whole(added[hint], None, deadline) is None:
                return False
            while pending:
                subset = pending.pop()
                if self._whole(added[subset].max(axis=0), None, deadline) is not None:
                    continue
                if subset.size == 1:
                    return False
                half = subset.size // 2
                pending += [subset[half:], subset[:half]]
        except Undecided:
            return None
        return True

    def whole_available(
        self,
        demand: np.ndarray,
        model_id: int,
        *,
        hint: int | None = None,
        seconds: float = WHOLE_REPLICAS_SECONDS,
    ) -> tuple[float | None, int] | None:
        """The most MU/min an addition to `model_id` gets at every moment in whole replicas,
        others met, and the moment (row of `demand`) where it binds: (None, row) when the
        others' sales cannot all be served there; None when undecided in `seconds`.

        A branch and bound over moments: what fits at a set's componentwise maximum is a lower
        bound for each of its moments, and a set whose bound is no better than the best single
        moment found is not split. `hint`: the moment to try first (the relaxation's)."""
        column = self.model_index[model_id]
        deadline = time.monotonic() + seconds
        best, best_row = np.inf, 0
        pending = [np.arange(demand.shape[0])]
        try:
            if hint is not None:
                value = self._whole(demand[hint], column, deadline)
                best, best_row = (-np.inf if value is None else value), hint
            while pending:
                subset = pending.pop()
                value = self._whole(demand[subset].max(axis=0), column, deadline)
                bound = -np.inf if value is None else value
                if subset.size == 1:
                    if bound < best:
                        best, best_row = bound, int(subset[0])
                    continue
                if bound >= best:
                    continue
                half = subset.size // 2
                pending += [subset[half:], subset[:half]]
        except Undecided:
            return None
        return (None if best == -np.inf else float(best)), best_row

    @cached_property
    def _whole_rows(self) -> sparse.csr_matrix:
        """[pools; models] × units: G x ≤ G_p over −R x ≤ −sold."""
        return sparse.vstack([self.gpus, -self.rates], format="csr")

    def _whole(self, sold: np.ndarray, column: int | None, deadline: float) -> float | None:
        """One moment in whole replicas. With `column`: the most MU/min that model gets beyond
        its `sold`, the others' met (None when they cannot be). Without: 0.0 when `sold` is
        servable, None when not. Undecided when the deadline passes."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Undecided
        n_units, n_pools = len(self.units), len(self.pools)
        # Within the solver's rounding, an exact fit fits (the others' sales; what the model
        # itself gets is the answer, not a need).
        need = sold - tolerance(float(sold.sum()))
        if column is not None:
            need[column] = sold[column]
        b = np.concatenate([self.gpu_counts, -need])
        if column is None:
            if n_units == 0:
                return 0.0 if (b[n_pools:] >= 0).all() else None
            a = self._whole_rows
            cost = np.zeros(n_units)
            bounds = Bounds(np.zeros(n_units), self.upper)
            integrality = np.ones(n_units)
        else:
            # [x, z]: z ≤ R_m x − sold_m, maximised.
            z = sparse.csr_matrix(
                ([1.0], ([n_pools + column], [0])), shape=(n_pools + len(self.model_ids), 1)
            )
            a = sparse.hstack([self._whole_rows, z], format="csr")
            cost = np.zeros(n_units + 1)
            cost[-1] = -1.0
            bounds = Bounds(
                np.concatenate([np.zeros(n_units), [-np.inf]]),
                np.concatenate([self.upper, [np.inf]]),
            )
            integrality = np.concatenate([np.ones(n_units), [0.0]])
        result = milp(
            cost,
            constraints=LinearConstraint(a, -np.inf, b),
            bounds=bounds,
            integrality=integrality,
            options={"time_limit": remaining},
        )
        if result.status == 2:
            return None
        if result.status == 1:
            raise Undecided
        if result.status != 0:
            raise RuntimeError(f"the whole-replica programme failed: {result.message}")
        return 0.0 if column is None else float(-result.fun)

    def _binding(
        self, pool_marginals: np.ndarray, upper_marginals: np.ndarray, replicas: np.ndarray
    ) -> Binding:
        """Pools whose GPUs, and deployments whose max_replicas, would buy more if raised."""
        pools = {
            self.pools[i].pool_id for i in np.flatnonzero(pool_marginals < -MARGINAL_TOLERANCE)
        }
        deployments = set()
        for i in np.flatnonzero(upper_marginals < -MARGINAL_TOLERANCE):
            unit = self.units[i]
            if self.pool_bounded[i]:
                pools.add(unit.pool_id)  # ⌊G_p / g_d⌋ binds: the pool is full for it
            else:
                deployments.add(unit.deployment_id)
        if not pools and not deployments:
            # A degenerate vertex may price nothing: name the pools it fills.
            used = self.gpus @ replicas
            pools = {
                pool.pool_id
                for pool, gpus in zip(self.pools, used, strict=True)
                if gpus >= pool.gpu_count - 1e-6
            }
        return Binding(tuple(sorted(pools)), tuple(sorted(deployments)))


def _solve(
    cost: np.ndarray,
    a_ub: sparse.csr_matrix,
    b_ub: np.ndarray,
    bounds: np.ndarray,
    *,
    infeasible_ok: bool = False,
) -> Any:
    """HiGHS's answer (an OptimizeResult); None for an infeasible one when that is an answer."""

    result = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if result.status == 2 and infeasible_ok:
        return None
    if result.status != 0:
        raise RuntimeError(f"the sellability programme failed: {result.message}")
    return result
