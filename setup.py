"""Build hooks: a wheel or an sdist built from the repository records its commit.

Everything else about the package is in pyproject.toml. Here, ``build_py`` writes
``worker/build-commit.json`` into the build (what ``worker/instrument/source_commit.py``
defines), so that an installed wheel names the commit it was built from without
``OUROBOROS_INSTRUMENT_COMMIT``; ``sdist`` writes it into the source archive, so that a
wheel built from that archive (``python -m build`` does so) records it too. A tree with
uncommitted tracked changes is recorded as dirty and the installed package refuses to
start a lineage, as such a checkout does; the build itself goes on, so that an editable
install of a working tree is never blocked (an editable install writes no record: it
asks git at run time). A tree that is neither a checkout nor an sdist of one records
nothing, and the installed package needs ``OUROBOROS_INSTRUMENT_COMMIT``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent


def _source_commit_module() -> types.ModuleType:
    # Executed from its file: importing it as ``worker.instrument.source_commit`` would run
    # the package's __init__, which needs the dependencies a build does not have.
    path = ROOT / "worker" / "instrument" / "source_commit.py"
    module = types.ModuleType("source_commit")
    sys.modules[module.__name__] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _write_record(package: Path) -> None:
    """Write the tree's commit record into ``package`` (the ``worker`` folder of a build)."""
    source_commit = _source_commit_module()
    target = package / source_commit.BUILD_FILE
    checkout = source_commit.read_checkout(ROOT)
    if checkout is None:
        # An sdist's own record, or nothing to say.
        from_sdist = ROOT / "worker" / source_commit.BUILD_FILE
        if from_sdist.is_file() and not target.exists():
            target.write_text(from_sdist.read_text())
        return
    if checkout.dirty:
        print(
            f"setup.py: {ROOT} has uncommitted tracked changes; the package built will "
            "refuse to start lineages (build from a clean checkout)",
            file=sys.stderr,
        )
    target.write_text(checkout.encode())


class BuildWithCommit(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            _write_record(Path(self.build_lib) / "worker")


class SdistWithCommit(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _write_record(Path(base_dir) / "worker")


setup(cmdclass={"build_py": BuildWithCommit, "sdist": SdistWithCommit})
