"""The scheduler's side of the fleet: the ``schedule-lineage`` command line, its views
and the web UI.

Importing it imports ``worker`` first, which moves all bytecode to the private,
checked cache (``worker/__init__.py`` says why), and then has this package's own
modules compiled there the same way, before any of them is imported.
"""

from pathlib import Path

from worker import checked_bytecode

checked_bytecode(Path(__file__).resolve().parent)
