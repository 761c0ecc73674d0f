"""The spending ledger: worst-case reservations, capped charges, a budget never exceeded."""

from __future__ import annotations

import contextlib
import threading
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.instrument.model.ledger import FRAMING_TOKENS, BudgetExhausted, Ledger
from worker.instrument.model.prices import Prices

prices_strategy = st.builds(
    Prices,
    input_usd_per_mtok=st.decimals(min_value=0, max_value=100, places=2),
    output_usd_per_mtok=st.decimals(min_value=0, max_value=200, places=2),
)
budgets = st.decimals(min_value=0, max_value=5, places=6)
prompt_sizes = st.integers(min_value=1, max_value=400_000)
output_grants = st.integers(min_value=1, max_value=50_000)
usages = st.integers(min_value=0, max_value=500_000)


def test_reservation_is_prompt_bytes_and_framing_at_input_price_plus_grant_at_output_price():
    ledger = Ledger(Decimal("1.00"), Prices(input_usd_per_mtok=3, output_usd_per_mtok=15))

    reservation = ledger.reserve(prompt_bytes=1000, output_tokens=2000)

    assert FRAMING_TOKENS == 4096
    assert reservation.amount_usd == Decimal("0.045288")  # (5096 * 3 + 2000 * 15) / 10**6
    assert ledger.remaining_usd == Decimal("1.00") - Decimal("0.045288")


def test_charge_is_reported_usage_and_the_rest_is_refunded():
    ledger = Ledger(Decimal("1"), Prices(input_usd_per_mtok=5, output_usd_per_mtok=25))
    reservation = ledger.reserve(prompt_bytes=4000, output_tokens=1000)

    charge = ledger.settle(reservation, ledger.prices.cost_usd(1200, 300))

    assert charge == Decimal("0.0135")  # (1200 * 5 + 300 * 25) / 10**6
    assert ledger.spent_usd == charge
    assert ledger.remaining_usd == Decimal(1) - charge


def test_prices_from_decimal_strings_cost_exactly():
    prices = Prices(input_usd_per_mtok=Decimal("0.1"), output_usd_per_mtok=Decimal("0.3"))
    assert prices.cost_usd(3, 7) == Decimal("0.0000024")


def test_call_that_cannot_fit_is_refused_without_holding_anything():
    ledger = Ledger(Decimal("0.01"), Prices(input_usd_per_mtok=5, output_usd_per_mtok=25))

    with pytest.raises(BudgetExhausted) as refused:
        ledger.reserve(prompt_bytes=1000, output_tokens=1000)

    assert refused.value.remaining_usd == Decimal("0.01")
    assert refused.value.worst_case_usd == Decimal("0.05048")
    assert ledger.remaining_usd == Decimal("0.01")
    assert ledger.spent_usd == 0


def test_open_reservations_hold_budget_against_each_other():
    ledger = Ledger(Decimal("0.10"), Prices(input_usd_per_mtok=10, output_usd_per_mtok=0))
    first = ledger.reserve(prompt_bytes=904, output_tokens=1)  # exactly USD 0.05

    second = ledger.reserve(prompt_bytes=904, output_tokens=1)
    with pytest.raises(BudgetExhausted):
        ledger.reserve(prompt_bytes=1, output_tokens=1)

    ledger.settle(first, Decimal(0))
    ledger.settle(second, Decimal(0))
    assert ledger.remaining_usd == Decimal("0.10")


def test_a_reservation_settles_only_once():
    ledger = Ledger(Decimal(1), Prices(input_usd_per_mtok=1, output_usd_per_mtok=1))
    reservation = ledger.reserve(prompt_bytes=10, output_tokens=10)
    ledger.settle(reservation, Decimal(0))

    with pytest.raises(ValueError, match="not open"):
        ledger.settle(reservation, Decimal(0))


@given(
    budget=budgets,
    prices=prices_strategy,
    calls=st.lists(
        st.tuples(
            prompt_sizes, output_grants, usages, usages, st.sampled_from(["usage", "fail", "lost"])
        ),
        max_size=30,
    ),
)
def test_spending_never_exceeds_budget_and_every_charge_is_capped_at_its_reservation(
    budget: Decimal, prices: Prices, calls: list[tuple[int, int, int, int, str]]
) -> None:
    ledger = Ledger(budget, prices)
    charges: list[Decimal] = []
    for prompt_bytes, grant, used_in, used_out, outcome in calls:
        worst = prices.cost_usd(prompt_bytes + FRAMING_TOKENS, grant)
        remaining = ledger.remaining_usd
        try:
            reservation = ledger.reserve(prompt_bytes, grant)
        except BudgetExhausted:
            assert worst > remaining
            continue
        assert worst <= remaining
        assert reservation.amount_usd == worst
        if outcome == "usage":
            charge = ledger.settle(reservation, ledger.prices.cost_usd(used_in, used_out))
            assert charge == min(prices.cost_usd(used_in, used_out), reservation.amount_usd)
        elif outcome == "fail":
            charge = ledger.settle(reservation, Decimal(0))
            assert charge == 0
        else:
            charge = ledger.settle(reservation, reservation.amount_usd)
            assert charge == reservation.amount_usd
        charges.append(charge)
        assert ledger.spent_usd <= budget
    assert sum(charges, Decimal(0)) == ledger.spent_usd
    assert ledger.spent_usd + ledger.remaining_usd == budget


@given(
    budget=budgets,
    prices=prices_strategy,
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("reserve"), prompt_sizes, output_grants),
            st.tuples(st.just("settle"), usages, usages),
        ),
        max_size=40,
    ),
    data=st.data(),
)
def test_interleaved_reservations_keep_spent_plus_held_within_budget(
    budget: Decimal,
    prices: Prices,
    steps: list[tuple[str, int, int]],
    data: st.DataObject,
) -> None:
    ledger = Ledger(budget, prices)
    open_reservations = []
    charges: list[Decimal] = []
    for action, first, second in steps:
        if action == "reserve":
            with contextlib.suppress(BudgetExhausted):
                open_reservations.append(ledger.reserve(first, second))
        elif open_reservations:
            chosen = open_reservations.pop(data.draw(st.integers(0, len(open_reservations) - 1)))
            charge = ledger.settle(chosen, ledger.prices.cost_usd(first, second))
            assert charge == min(prices.cost_usd(first, second), chosen.amount_usd)
            charges.append(charge)
        held = sum((r.amount_usd for r in open_reservations), Decimal(0))
        assert ledger.spent_usd + held <= budget
        assert ledger.remaining_usd == budget - ledger.spent_usd - held
    assert sum(charges, Decimal(0)) == ledger.spent_usd


def test_concurrent_calls_never_overspend_or_lose_a_charge():
    budget = Decimal("0.50")
    ledger = Ledger(budget, Prices(input_usd_per_mtok=1, output_usd_per_mtok=1))
    charges: list[Decimal] = []
    charges_lock = threading.Lock()

    def caller(seed: int) -> None:
        for round_ in range(300):
            try:
                reservation = ledger.reserve(prompt_bytes=1000 + seed, output_tokens=5000)
            except BudgetExhausted:
                continue
            charge = ledger.settle(
                reservation, ledger.prices.cost_usd(900 + round_ % 7, 3000 + seed)
            )
            with charges_lock:
                charges.append(charge)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert ledger.spent_usd == sum(charges, Decimal(0))
    assert ledger.spent_usd <= budget
    assert ledger.remaining_usd == budget - ledger.spent_usd
