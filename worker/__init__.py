"""The trusted instrument of the Ouroboros fleet (``celery -A worker worker``).

Importing the package switches off bytecode writing first, so no worker module is
ever compiled to disk. Python compiles this ``__init__`` before its first line runs,
so launchers also set ``PYTHONDONTWRITEBYTECODE=1`` (the systemd units, the image and
the demo do). The Celery app lives in ``worker.celery`` and is found there by
``celery -A worker``.
"""

import sys

sys.dont_write_bytecode = True
