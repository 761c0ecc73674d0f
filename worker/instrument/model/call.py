"""One model call while it is served: its reservation in the ledger and its attempts.

Owns ``Call``, a request that got as far as having a body, from then until it is
audited, and ``Attempt``, the attempt at the provider in progress. A call holds at
most one open reservation at a time, and settling it never charges more than it
reserved (the ledger's rule).

Trusts the ledger it is given; the prompt it holds is the organism's and is only
counted, hashed and passed on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from worker.instrument.model.ledger import Ledger, Reservation
from worker.instrument.model.throttle import Admission
from worker.instrument.records import ModelAttempt


@dataclass
class Attempt:
    """The attempt in progress; the model thread fills in what it learns."""

    number: int
    started_at: datetime
    clock: float
    admission: Admission | None = None
    # When the thread began to wait for the cap (time.monotonic()), if it did.
    capping: float | None = None
    cap_waited: float = 0.0
    # When the request left for the vendor (time.monotonic()); None while it has not.
    sent: float | None = None


@dataclass
class Call:
    """A request that got as far as having a body, until it is audited.

    Mutated by the event loop only, and read by __exit__ once the loop has stopped.
    """

    index: int
    started_at: datetime
    clock: float
    prompt: bytes
    requested_output_tokens: int | None = None
    # The open reservation the next attempt runs on, if any.
    reservation: Reservation | None = None
    reserved: Decimal = Decimal(0)
    charged: Decimal = Decimal(0)
    attempts: list[ModelAttempt] = field(default_factory=list)
    current: Attempt | None = None

    def reserve(self, ledger: Ledger, tokens: int) -> None:
        """Hold a worst case for the next attempt; BudgetExhausted holds nothing."""
        self.reservation = ledger.reserve(len(self.prompt), tokens)
        self.reserved += self.reservation.amount_usd

    def settle(self, ledger: Ledger, cost: Decimal) -> Decimal:
        """Close the open reservation at min(cost, reserved); the charge."""
        if self.reservation is None:
            return Decimal(0)
        charge = ledger.settle(self.reservation, cost)
        self.reservation = None
        self.charged += charge
        return charge
