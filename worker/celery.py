"""The Celery app of a sandbox host: ``celery -A worker worker`` finds ``app`` here.

The one module that builds the worker's app at import: it loads the settings and
the instrument and the fleet plumbing (so the worker's code, scripts and seed are
fixed from its first moment) and hands them to ``worker.fleet.tasks.WorkerApp``. A refusal (bad
settings, a fleet-version mismatch) is one line on stderr and exit status 2.
Nothing else imports this module: senders and inspectors use
``worker.fleet.app.client_app``.
"""

from __future__ import annotations

import sys

from worker.fleet.settings import Settings, load_settings
from worker.fleet.tasks import WorkerApp
from worker.instrument.errors import Refusal
from worker.instrument.fingerprint import Instrument, current, load_plumbing


def _load() -> tuple[Settings, Instrument]:
    try:
        settings, instrument = load_settings(), current()
        load_plumbing()
        return settings, instrument
    except Refusal as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


app = WorkerApp(*_load()).app
