"""Read-only git access to the shared bare repository, for browsing.

Owns the allowlist of git subcommands a browser may run (none of them writes a
ref, an object, an index or a lock) and the environment they run in: explicit
``--git-dir``, ``GIT_OPTIONAL_LOCKS=0`` (so even a read never takes the index or
ref locks a writer needs), no global or system configuration, no replace refs, no
signature verification, and every diff with ``--no-ext-diff --no-textconv`` so no
helper named by configuration or attributes runs on lineage content. The common
hardening (hooks, attributes file, excludes, ``diff.external``) is the worker's own
``run_git``.

Trusts: the git binary and the repository's own configuration (the fleet's).
Treats every byte git returns about lineage content as data.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from worker.instrument.gitrepo import run_git

ALLOWED = frozenset({"for-each-ref", "rev-parse", "log", "cat-file", "diff"})
_DIFF_GUARDS = ("--no-ext-diff", "--no-textconv", "--no-color", "--no-renames")
# Extra configuration through the environment: run_git already places its own
# ``-c`` options before the subcommand, and these must not depend on their order.
_EXTRA_CONFIG = {"log.showSignature": "false", "core.quotePath": "false"}
_ENV = {
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_NO_REPLACE_OBJECTS": "1",
    "GIT_ATTR_NOSYSTEM": "1",
    "GIT_CONFIG_COUNT": str(len(_EXTRA_CONFIG)),
    **{f"GIT_CONFIG_KEY_{i}": key for i, key in enumerate(_EXTRA_CONFIG)},
    **{f"GIT_CONFIG_VALUE_{i}": value for i, value in enumerate(_EXTRA_CONFIG.values())},
}


class ReadOnlyGit:
    """One bare repository, reachable only through read-only subcommands.

    ``alternates``: other repositories whose objects it reads too (the other homes of a
    fleet of several, so a commit, tree or diff of any home's lineage reads through one
    repository); their refs are not its own.
    """

    def __init__(self, git_dir: Path, alternates: Sequence[Path] = ()) -> None:
        self.git_dir = git_dir
        self._env = _ENV
        if alternates:
            objects = ":".join(str(repo / "objects") for repo in alternates)
            self._env = {**_ENV, "GIT_ALTERNATE_OBJECT_DIRECTORIES": objects}

    def run(
        self, subcommand: str, *args: str, input: bytes | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        if subcommand not in ALLOWED:
            raise PermissionError(f"git {subcommand} is not a read-only browsing command")
        guards = _DIFF_GUARDS if subcommand == "diff" else ()
        return run_git(
            self.git_dir, subcommand, *guards, *args, input=input, env=self._env, check=check
        )

    def blobs(self, specs: list[str]) -> dict[str, bytes | None]:
        """Contents of ``rev:path`` specs through one ``cat-file --batch``; None if absent."""
        if not specs:
            return {}
        out = self.run("cat-file", "--batch", input="".join(f"{s}\n" for s in specs).encode())
        found: dict[str, bytes | None] = {}
        pos = 0
        for spec in specs:
            header_end = out.stdout.index(b"\n", pos)
            header = out.stdout[pos:header_end].split()
            if len(header) != 3 or header[1] != b"blob":
                # "<spec> missing", or a tree or commit where a file was expected.
                found[spec] = None
                pos = header_end + 1
                if len(header) == 3:
                    pos += int(header[2]) + 1
                continue
            size = int(header[2])
            found[spec] = out.stdout[header_end + 1 : header_end + 1 + size]
            pos = header_end + 1 + size + 1
        return found
