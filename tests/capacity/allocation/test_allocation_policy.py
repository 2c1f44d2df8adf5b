"""The allocation policy, rule by rule: plain data in, decisions out (no database)."""

from dataclasses import replace

import pytest

from capacity.allocation.policy import (
    CustomerDemand,
    DeploymentState,
    ModelSnapshot,
    PoolState,
    Snapshot,
    decide,
)


def deployment(**overrides) -> DeploymentState:
    values = {
        "deployment_id": 1,
        "name": "llama-h100",
        "pool_id": 1,
        "gpus_per_replica": 1,
        "mu_per_minute_per_replica": 100.0,
        "current_replicas": 1,
        "ready_replicas": 1,
        "min_replicas": 0,
        "max_replicas": 8,
        "cold_start_seconds": 60,
        "scale_to_zero_after_seconds": 600,
        "target_utilisation": 1.0,
        "cost_per_hour_usd": 4.0,
    }
    return DeploymentState(**(values | overrides))


def customer(
    customer_id=1, reserved=0.0, recent=0.0, peak=None, keep_warm=False, idle_seconds=0.0,
    **fields,
):  # fmt: skip
    """A customer that used the model (or started its reservation) `idle_seconds` ago."""
    return CustomerDemand(
        customer_id, reserved, recent, recent if peak is None else peak, keep_warm,
        idle_seconds=idle_seconds, **fields,
    )  # fmt: skip


def snapshot(customers=(), deployments=None, pools=None, idle_seconds=0.0, load_known=True):
    deployments = deployments or (deployment(),)
    pools = pools or (PoolState(1, "pool", 8),)
    model = ModelSnapshot(
        1, "llama", tuple(customers), tuple(deployments), idle_seconds, load_known
    )
    return Snapshot(models=(model,), pools=tuple(pools))


def target(decisions, deployment_id=1) -> int:
    return decisions.for_deployment(deployment_id).target_replicas


def codes(decisions, deployment_id=1) -> set[str]:
    return {reason.code for reason in decisions.for_deployment(deployment_id).reasons}


def test_reservations_are_covered_by_hot_capacity_even_when_unused():
    decisions = decide(snapshot([customer(reserved=250, recent=0)]))
    assert target(decisions) == 3  # 250 MU/min on 100 MU/min replicas
    assert "guaranteed" in codes(decisions)


def test_best_effort_demand_at_its_recent_peak_adds_replicas():
    decisions = decide(snapshot([customer(reserved=100, recent=150, peak=420)]))
    assert target(decisions) == 5  # 100 guaranteed + 320 best-effort
    assert {"guaranteed", "best_effort", "scale_up"} <= codes(decisions)


def test_target_utilisation_leaves_room_on_every_replica():
    decisions = decide(snapshot([customer(reserved=240)], [deployment(target_utilisation=0.8)]))
    assert target(decisions) == 3  # 80 usable MU/min per replica


def test_scale_up_is_immediate():
    decisions = decide(snapshot([customer(recent=700)], [deployment(current_replicas=1)]))
    assert target(decisions) == 7


def test_a_spike_then_a_drop_scales_down_only_after_the_window():
    quiet = [customer(recent=100)]
    # 100 s after a tick that recommended 6: held at 6.
    held = decide(
        snapshot(quiet, [deployment(current_replicas=6, recent_recommendations=((100.0, 6),))])
    )
    assert target(held) == 6
    assert "stabilising" in codes(held)
    # Once that recommendation is older than the window (later ticks recommended 1), down to 1.
    later = decide(
        snapshot(
            quiet, [deployment(current_replicas=6, recent_recommendations=((310.0, 6), (15.0, 1)))]
        )
    )
    assert target(later) == 1
    assert "scale_down" in codes(later)


def test_the_highest_recommendation_inside_the_window_wins():
    decisions = decide(
        snapshot(
            [customer(recent=100)],
            [
                deployment(
                    current_replicas=8, recent_recommendations=((50.0, 3), (100.0, 5), (400.0, 8))
                )
            ],
        )
    )
    assert target(decisions) == 5


def test_without_any_recent_tick_a_scale_down_waits():
    decisions = decide(snapshot([customer(recent=100)], [deployment(current_replicas=6)]))
    assert target(decisions) == 6
    assert "stabilising" in codes(decisions)


def test_unknown_load_holds_rather_than_scaling_down():
    decisions = decide(
        snapshot([customer(recent=0)], [deployment(current_replicas=5)], load_known=False)
    )
    assert target(decisions) == 5
    assert "load_unknown" in codes(decisions)


def test_unknown_load_still_scales_up_for_reservations():
    decisions = decide(
        snapshot([customer(reserved=400)], [deployment(current_replicas=1)], load_known=False)
    )
    assert target(decisions) == 4


def test_cheapest_dollars_per_mu_fill_first():
    cheap = deployment(
        deployment_id=1,
        name="l40s",
        pool_id=1,
        mu_per_minute_per_replica=50,
        cost_per_hour_usd=1.0,
        max_replicas=2,
    )  # $/MU 0.00033
    dear = deployment(
        deployment_id=2,
        name="h100",
        pool_id=2,
        mu_per_minute_per_replica=100,
        cost_per_hour_usd=4.0,
    )  # $/MU 0.00067
    decisions = decide(
        snapshot(
            [customer(reserved=300)], [cheap, dear], [PoolState(1, "a", 8), PoolState(2, "b", 8)]
        )
    )
    assert target(decisions, 1) == 2  # full: 100 MU/min
    assert target(decisions, 2) == 2  # the remaining 200 MU/min


def test_a_short_pool_serves_guaranteed_first_and_reports_the_shortfall():
    pool = (PoolState(1, "small", 4),)
    other = ModelSnapshot(
        2,
        "other",
        (customer(customer_id=9, recent=1000),),
        (deployment(deployment_id=2, name="other-h100", current_replicas=0),),
        0.0,
    )
    reserved = ModelSnapshot(
        1, "llama", (customer(reserved=300),), (deployment(current_replicas=0),), 0.0
    )
    # The best-effort model comes first in the list, yet guaranteed demand wins the pool.
    decisions = decide(Snapshot(models=(other, reserved), pools=pool))
    assert target(decisions, 1) == 3
    assert target(decisions, 2) == 1
    outcome = {o.model_id: o for o in decisions.models}
    assert outcome[1].guaranteed_shortfall_mu_per_minute == 0
    assert outcome[2].best_effort_shortfall_mu_per_minute == pytest.approx(900)
    assert "best_effort_limited" in codes(decisions, 2)


def test_a_reservation_larger_than_the_pool_reports_a_guaranteed_shortfall():
    decisions = decide(snapshot([customer(reserved=1000)], pools=[PoolState(1, "p", 4)]))
    assert target(decisions) == 4
    assert decisions.models[0].guaranteed_shortfall_mu_per_minute == pytest.approx(600)


def test_an_idle_model_keeps_one_replica_until_the_idle_window_then_scales_to_zero():
    waiting = decide(
        snapshot(
            [customer(recent=0)],
            [deployment(current_replicas=2, recent_recommendations=((15.0, 1),))],
            idle_seconds=120,
        )
    )
    assert target(waiting) == 1
    assert "idle_wait" in codes(waiting)
    gone = decide(
        snapshot(
            [customer(recent=0)],
            [deployment(current_replicas=1, recent_recommendations=((15.0, 0),))],
            idle_seconds=900,
        )
    )
    assert target(gone) == 0
    assert "scale_to_zero" in codes(gone)


def test_with_scale_to_zero_off_only_a_replica_the_last_plan_had_is_kept_warm():
    def idle_with(last):
        return decide(
            snapshot(
                [customer(recent=0)],
                [
                    deployment(
                        scale_to_zero_after_seconds=None,
                        recent_recommendations=((30.0, last), (15.0, last)),
                    )
                ],
                idle_seconds=3600,
            )
        )

    # The customers' own replica stays: scale to zero is off.
    kept = idle_with(1)
    assert target(kept) == 1
    assert "never_scale_to_zero" in codes(kept)
    # One the last plan did not have (a benchmark's, released since) goes.
    released = idle_with(0)
    assert target(released) == 0
    assert "not_planned" in codes(released)


def test_a_keep_warm_reservation_prevents_scale_to_zero():
    decisions = decide(
        snapshot(
            [customer(reserved=0.001, keep_warm=True)],
            [deployment(current_replicas=1)],
            idle_seconds=10_000,
        )
    )
    assert target(decisions) == 1


def test_demand_wakes_a_model_at_zero():
    decisions = decide(
        snapshot([customer(recent=30)], [deployment(current_replicas=0)], idle_seconds=0)
    )
    assert target(decisions) == 1
    assert "scale_up" in codes(decisions)


def test_never_below_min_nor_above_max():
    low = decide(snapshot([], [deployment(min_replicas=2, current_replicas=2)], idle_seconds=1e6))
    assert target(low) == 2
    high = decide(snapshot([customer(recent=5000)], [deployment(max_replicas=3)]))
    assert target(high) == 3
    assert "guaranteed_limited" not in codes(high)
    assert "best_effort_limited" in codes(high)


def test_gpus_per_replica_count_against_the_pool():
    decisions = decide(
        snapshot(
            [customer(recent=1000)],
            [deployment(gpus_per_replica=4, mu_per_minute_per_replica=400)],
            pools=[PoolState(1, "p", 8)],
        )
    )
    assert target(decisions) == 2


def test_held_replicas_give_way_when_the_pool_is_needed():
    holding = deployment(deployment_id=1, current_replicas=4, recent_recommendations=((10.0, 4),))
    hungry = deployment(deployment_id=2, name="b", current_replicas=0)
    m1 = ModelSnapshot(1, "a", (customer(recent=100),), (holding,), 0.0)
    m2 = ModelSnapshot(2, "b", (customer(customer_id=2, reserved=300),), (hungry,), 0.0)
    decisions = decide(Snapshot(models=(m1, m2), pools=(PoolState(1, "p", 4),)))
    assert target(decisions, 2) == 3
    assert target(decisions, 1) == 1
    assert "pool_full" in codes(decisions, 1)


def test_allowances_guarantee_reservations_and_share_the_slack():
    decisions = decide(
        snapshot(
            [customer(1, reserved=100, recent=100), customer(2, reserved=0, recent=200)],
            [deployment(current_replicas=5, ready_replicas=5)],
        )
    )
    allowances = {a.customer_id: a for a in decisions.allowances}
    assert allowances[1].guaranteed_mu_per_minute == 100
    assert allowances[2].guaranteed_mu_per_minute == 0
    # 500 hot − 100 reserved = 400 slack: 80 % by demand (all customer 2's), 20 % evenly.
    assert allowances[2].best_effort_mu_per_minute == pytest.approx(320 + 40)
    assert allowances[1].best_effort_mu_per_minute == pytest.approx(40)


def test_the_policy_is_deterministic():
    snap = snapshot([customer(reserved=120, recent=300)], [deployment(current_replicas=2)])
    assert decide(snap) == decide(replace(snap))


def burst_model(burst_mu_per_minute, busiest_minute_mu):
    model = ModelSnapshot(
        1,
        "llama",
        (customer(recent=200, peak=300),),
        (deployment(target_utilisation=0.8),),
        0.0,
        burst_mu_per_minute=burst_mu_per_minute,
        burst_window_busiest_minute_mu=busiest_minute_mu,
    )
    return decide(Snapshot(models=(model,), pools=(PoolState(1, "pool", 8),)))


def test_bursts_that_bind_need_full_replicas_not_replicas_at_the_target_utilisation():
    # 640 MU/min of burst rate, against a busiest minute of 300: bursty traffic. The burst
    # rate already holds its latency headroom, so it needs 7 replicas (640 / 100), not 8
    # (640 / 80).
    assert target(burst_model(640.0, 300.0)) == 7
    # Without bursts, the busiest minute decides: 300 / 80 -> 4.
    assert target(burst_model(0.0, 0.0)) == 4


def test_bursts_the_minute_plan_absorbs_do_not_hold_capacity():
    # Over the burst window the busiest minute was 500 MU: bursts needing 600 MU/min at full
    # capacity (480 at the target) are within what that minute plans, so only the recent
    # minutes (300 / 80 -> 4) decide.
    assert target(burst_model(600.0, 500.0)) == 4


def test_requests_queued_in_the_engines_count_as_demand():
    # Usage is metered when requests finish, so a fleet too small for its demand hides the
    # rest in its queues: 300 MU waiting on top of 100 MU/min used asks for 4 replicas.
    model = ModelSnapshot(1, "llama", (customer(recent=100),), (deployment(),), 0.0, True, 300.0)
    decisions = decide(Snapshot(models=(model,), pools=(PoolState(1, "pool", 8),)))
    assert target(decisions) == 4


# -- The closed loop: refused and waiting demand, readiness, cold starts, keep-warm ------------


def model_snapshot(customers=(), deployments=None, idle_seconds=0.0, **fields) -> Snapshot:
    model = ModelSnapshot(
        1, "llama", tuple(customers), tuple(deployments or (deployment(),)), idle_seconds,
        **fields,
    )  # fmt: skip
    return Snapshot(models=(model,), pools=(PoolState(1, "pool", 8),))


def test_refused_best_effort_demand_grows_the_fleet():
    # Behind a gateway that obeys admission, a best-effort customer's traffic beyond the slack
    # is refused: what it would have cost is the demand that grows the fleet.
    served = customer(recent=90)
    refused = customer(recent=90, refused_best_effort_mu_per_minute=300)

    assert target(decide(snapshot([served]))) == 1
    grown = decide(snapshot([refused]))
    assert target(grown) == 4  # 90 served + 300 turned away on 100 MU/min replicas
    (outcome,) = grown.models
    assert outcome.refused_best_effort_mu_per_minute == 300


def test_a_request_waiting_at_the_gateway_wakes_a_model_at_zero():
    at_zero = deployment(current_replicas=0, ready_replicas=0)
    asleep = decide(model_snapshot([], [at_zero]))
    waking = decide(model_snapshot([], [at_zero], gateway_waiting_mu=2.0))

    assert target(asleep) == 0
    assert target(waking) == 1
    assert "scale_up" in codes(waking)


def test_requests_held_at_the_gateway_wake_the_fleet_their_arrival_rate_needs():
    # A model at zero whose replicas load for 3 s; 100 MU/min a replica.
    quick = deployment(current_replicas=0, ready_replicas=0, cold_start_seconds=3)
    slow = deployment(current_replicas=0, ready_replicas=0, cold_start_seconds=120)

    def woken(mu: float, waited_seconds: float, at_zero=quick) -> int:
        held = {"gateway_waiting_mu": mu, "gateway_waiting_seconds": waited_seconds}
        return target(decide(model_snapshot([], [at_zero], **held)))

    # 15 MU held, the oldest for 6 s: they arrive at 150 MU/min, which the woken fleet must
    # serve when it is ready, not 15 MU/min.
    assert woken(15.0, waited_seconds=6) == 2
    assert woken(30.0, waited_seconds=6) == 3
    assert woken(15.0, waited_seconds=6, at_zero=slow) == 2
    # The same 15 MU gathered over a minute or more: 15 MU/min, one replica.
    assert woken(15.0, waited_seconds=60) == 1
    assert woken(15.0, waited_seconds=300) == 1
    # A request a tenth of a second old is no flood: read over the 3 s cold start (4 MU: 80
    # MU/min), or over the 6 s panic window when the cold start is longer (8 MU: 80 MU/min).
    assert woken(4.0, waited_seconds=0.1) == 1
    assert woken(8.0, waited_seconds=0.1, at_zero=slow) == 1
    # How long they waited not known (the simulator's held requests): served within a minute.
    assert woken(15.0, waited_seconds=0) == 1


def test_the_engines_own_mu_is_a_floor_when_metering_lags():
    # The gateway posts no usage (or it lags): the engines served 300 MU/min all the same.
    fleet = deployment(current_replicas=3, ready_replicas=3)
    unmetered = decide(model_snapshot([customer(recent=0)], [fleet], engine_mu_per_minute=300.0))
    assert target(unmetered) == 3


def test_best_effort_stays_within_the_models_ceiling():
    hungry = [customer(recent=0, refused_best_effort_mu_per_minute=700)]
    by_mu = decide(model_snapshot(hungry, best_effort_ceiling_mu_per_minute=250.0))
    by_replicas = decide(model_snapshot(hungry, best_effort_ceiling_replicas=2))

    assert target(by_mu) == 3  # 250 MU/min of best-effort on 100 MU/min replicas
    assert target(by_replicas) == 2
    limited = next(
        r for r in by_replicas.for_deployment(1).reasons if r.code == "best_effort_limited"
    )
    assert limited.data["limited_by"] == "best_effort_ceiling"
    ready = deployment(current_replicas=8, ready_replicas=8)
    (allowance,) = decide(
        model_snapshot(hungry, [ready], best_effort_ceiling_mu_per_minute=250.0)
    ).allowances
    assert allowance.best_effort_mu_per_minute == pytest.approx(250)


def test_every_customer_allowed_on_the_model_shares_the_slack_history_or_not():
    fleet = deployment(current_replicas=4, ready_replicas=4)
    newcomer = customer(customer_id=2, idle_seconds=None)  # no reservation, never used it
    decisions = decide(model_snapshot([customer(customer_id=1, recent=100), newcomer], [fleet]))
    allowances = {a.customer_id: a.best_effort_mu_per_minute for a in decisions.allowances}
    # 400 ready, nothing reserved: 80 % by demand (all customer 1's), 20 % evenly.
    assert allowances == {1: pytest.approx(320 + 40), 2: pytest.approx(40)}


def test_the_part_of_the_slack_not_split_by_demand_follows_the_tier_weights():
    fleet = deployment(current_replicas=4, ready_replicas=4)
    # Customer 1 has all the best-effort demand; customers 2 (weight 1: free) and 3 (weight 4:
    # premium) have none. 400 ready, nothing reserved: 320 by demand, 80 by tier weight.
    decisions = decide(
        model_snapshot(
            [
                customer(customer_id=1, recent=100, tier_weight=3.0),
                customer(customer_id=2, tier_weight=1.0),
                customer(customer_id=3, tier_weight=4.0),
            ],
            [fleet],
        )
    )
    allowances = {a.customer_id: a.best_effort_mu_per_minute for a in decisions.allowances}
    assert allowances == {
        1: pytest.approx(320 + 30),
        2: pytest.approx(10),
        3: pytest.approx(40),
    }
    # Without any best-effort demand, the whole slack goes by weight.
    idle = decide(
        model_snapshot(
            [customer(customer_id=2, tier_weight=1.0), customer(customer_id=3, tier_weight=3.0)],
            [fleet],
        )
    )
    assert {a.customer_id: a.best_effort_mu_per_minute for a in idle.allowances} == {
        2: pytest.approx(100),
        3: pytest.approx(300),
    }


def test_replicas_still_starting_are_never_lent_out():
    starting = deployment(current_replicas=4, ready_replicas=1, starting_replicas=3)
    decisions = decide(model_snapshot([customer(recent=50)], [starting]))
    (allowance,) = decisions.allowances
    assert allowance.best_effort_mu_per_minute == pytest.approx(100)  # one ready replica
    decision = decisions.for_deployment(1)
    assert (decision.ready_replicas, decision.starting_replicas) == (1, 3)


def test_a_rising_trend_scales_up_a_cold_start_ahead():
    # A 5-minute mean of 250 MU/min rising 1 MU/min a second: the mean sits 150 s back, so
    # one 60 s cold start from now demand is 250 + 210 = 460, past the 300 MU/min that the 3
    # ready replicas serve at full rate. What starts now for it is ready in time.
    fleet = deployment(current_replicas=3, ready_replicas=3, cold_start_seconds=60)
    rising = decide(
        model_snapshot([customer(recent=250)], [fleet], demand_trend_mu_per_minute_per_second=1.0)
    )
    flat = decide(model_snapshot([customer(recent=250)], [fleet]))
    # Growth the target utilisation's headroom absorbs within a cold start needs nothing now.
    gentle = decide(
        model_snapshot([customer(recent=250)], [fleet], demand_trend_mu_per_minute_per_second=0.1)
    )

    assert target(flat) == 3
    assert target(gentle) == 3
    assert target(rising) == 5
    lead = next(r for r in rising.for_deployment(1).reasons if r.code == "cold_start_lead")
    assert "trend" in lead.message
    assert rising.models[0].cold_start_lead_mu_per_minute == pytest.approx(210)


def test_a_reservation_without_keep_warm_goes_cold_after_its_idle_window():
    fleet = deployment(current_replicas=3, ready_replicas=3, scale_to_zero_after_seconds=600)
    used_lately = customer(reserved=250, idle_seconds=300)
    idle_long = customer(reserved=250, idle_seconds=3600)
    kept_warm = customer(reserved=250, idle_seconds=3600, keep_warm=True)

    assert target(decide(model_snapshot([used_lately], [fleet]))) == 3
    assert target(decide(model_snapshot([kept_warm], [fleet]))) == 3
    cold = decide(model_snapshot([idle_long], [fleet], idle_seconds=3600))
    assert cold.for_deployment(1).recommended_replicas == 0
    assert "scale_to_zero" in codes(cold)
    # Its guaranteed bucket stays: an admitted request waits a cold start at the gateway.
    (allowance,) = cold.allowances
    assert allowance.guaranteed_mu_per_minute == 250


def test_reserved_capacity_sitting_idle_is_lent_to_best_effort():
    fleet = deployment(current_replicas=4, ready_replicas=4)
    reserved = {"customer_id": 1, "reserved": 300, "recent": 300}
    hungry = customer(2, refused_best_effort_mu_per_minute=500)
    busy = decide(
        model_snapshot([customer(**reserved, current_mu_per_minute=300), hungry], [fleet])
    )
    stopped = decide(
        model_snapshot([customer(**reserved, current_mu_per_minute=0), hungry], [fleet])
    )

    def lent(decisions):
        return {a.customer_id: a for a in decisions.allowances}

    # Using its 300: 100 of the 400 ready is slack. Stopped: all 400 is.
    assert sum(a.best_effort_mu_per_minute for a in lent(busy).values()) == pytest.approx(100)
    assert sum(a.best_effort_mu_per_minute for a in lent(stopped).values()) == pytest.approx(400)
    # Its guaranteed bucket is its reservation either way: it is admitted the moment it is back.
    assert lent(stopped)[1].guaranteed_mu_per_minute == 300
