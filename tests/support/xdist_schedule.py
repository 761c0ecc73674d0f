"""How pytest-xdist hands the full tier to its processes: the heavy modules together.

Owns the scheduler of ``-n N`` (``--dist load``, what ``scripts/test.sh`` runs): every
test is its own unit of work, handed out as processes free up, except the modules that
hold the machine-wide heavy lock (``HEAVY_MODULES``: the VM and the compose fleet), which
are one unit. That unit is the largest, so it goes out first: one process runs the VM
and compose modules one after the other, each with its module-scoped fleet set up once,
while the others run the rest. (xdist's own ``--dist loadgroup`` does not group under
pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)

Trusts: xdist's ``LoadScopeScheduling``, of which this changes only what a unit is.
"""

from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

# The modules that use the ``machine_to_itself`` fixture (tests/test_structure.py checks).
HEAVY_MODULES = frozenset({"tests/test_compose.py", "tests/test_vm_host.py"})


class HeavyTogether(LoadScopeScheduling):
    """Each test a unit of its own; the heavy modules' tests one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return "heavy" if nodeid.split("::", 1)[0] in HEAVY_MODULES else nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> HeavyTogether | None:
    """``--dist load`` (the default of ``-n``) schedules with ``HeavyTogether``."""
    return HeavyTogether(config, log) if config.getvalue("dist") == "load" else None
