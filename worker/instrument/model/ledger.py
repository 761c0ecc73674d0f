"""The spending ledger of one generation: reserve the worst case, charge what was used.

Owns the per-generation budget arithmetic. Before a model call the model socket reserves
the call's worst-case cost: every prompt byte counted as one input token (no
tokenizer yields more tokens than bytes) plus FRAMING_TOKENS for the provider's
message framing, at the input price, plus every granted output token at the output
price. A reservation that does not fit what is left is refused, so the provider is
never called. Afterwards the reservation is settled with the call's real cost,
capped at the reservation: the budget stays a hard ceiling even when a provider
reports more usage than we allowed for. All amounts are exact Decimals.

Thread-safe: concurrent calls reserve and settle under one lock. Trusts: the prices
it is given and the usage the model socket passes on from the provider.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from decimal import Decimal

from worker.instrument.model.prices import Prices

FRAMING_TOKENS = 4096


class BudgetExhausted(Exception):
    """A call's worst case does not fit what is left of the generation's budget."""

    def __init__(self, worst_case_usd: Decimal, remaining_usd: Decimal) -> None:
        super().__init__(
            f"worst case USD {worst_case_usd} exceeds the remaining USD {remaining_usd}"
        )
        self.worst_case_usd = worst_case_usd
        self.remaining_usd = remaining_usd


@dataclass(frozen=True)
class Reservation:
    """Money set aside for one call until it is settled."""

    number: int
    amount_usd: Decimal


class Ledger:
    """Budget, outstanding reservations and spending of one generation."""

    def __init__(self, budget_usd: Decimal, prices: Prices) -> None:
        self.budget_usd = budget_usd
        self.prices = prices
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._open: dict[int, Reservation] = {}
        self._spent = Decimal(0)

    @property
    def spent_usd(self) -> Decimal:
        with self._lock:
            return self._spent

    @property
    def remaining_usd(self) -> Decimal:
        """Budget neither spent nor held by an open reservation."""
        with self._lock:
            return self._remaining()

    def worst_case_usd(self, prompt_bytes: int, output_tokens: int) -> Decimal:
        return self.prices.cost_usd(prompt_bytes + FRAMING_TOKENS, output_tokens)

    def reserve(self, prompt_bytes: int, output_tokens: int) -> Reservation:
        """Hold the worst case of a call, or raise BudgetExhausted without holding anything."""
        amount = self.worst_case_usd(prompt_bytes, output_tokens)
        with self._lock:
            remaining = self._remaining()
            if amount > remaining:
                raise BudgetExhausted(amount, remaining)
            reservation = Reservation(number=next(self._numbers), amount_usd=amount)
            self._open[reservation.number] = reservation
            return reservation

    def settle(self, reservation: Reservation, cost_usd: Decimal) -> Decimal:
        """Close a reservation, charging min(cost, reserved); returns the charge.

        A cost of zero is a full refund; the reservation's own amount forfeits it.
        """
        charge = min(max(cost_usd, Decimal(0)), reservation.amount_usd)
        with self._lock:
            if self._open.pop(reservation.number, None) is None:
                raise ValueError(f"reservation {reservation.number} is not open")
            self._spent += charge
        return charge

    def _remaining(self) -> Decimal:
        held = sum((r.amount_usd for r in self._open.values()), Decimal(0))
        return self.budget_usd - self._spent - held
