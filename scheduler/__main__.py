"""``python -m scheduler`` is ``schedule-lineage``."""

from scheduler.cli import main

main()
