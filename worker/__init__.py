"""What a sandbox host runs (``celery -A worker worker``): the instrument and the plumbing.

``worker/instrument/`` is the trusted instrument, fingerprinted by being in that
folder; ``worker/fleet/`` is the fleet plumbing, loaded eagerly but not fingerprinted.

Importing the package switches off bytecode writing first, so no worker module is
ever compiled to disk. Python compiles this ``__init__`` before its first line runs,
so launchers also set ``PYTHONDONTWRITEBYTECODE=1`` (the systemd units, the image and
the demo do). The Celery app lives in ``worker.celery`` and is found there by
``celery -A worker``.
"""

import sys

sys.dont_write_bytecode = True
