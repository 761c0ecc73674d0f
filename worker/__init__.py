"""The trusted instrument of the Ouroboros fleet (``celery -A worker worker``).

Importing the package switches off bytecode writing first, so a worker never leaves
compiled files behind; the Celery app lives in ``worker.celery`` and is found there
by ``celery -A worker``.
"""

import sys

sys.dont_write_bytecode = True
