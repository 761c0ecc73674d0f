"""The decoder's name rules on trees made outside the fleet: what ``import-bundle`` and
``fork`` ask before a tree enters the shared repository as a lineage.

Owns walking git trees by their raw entry names (and symlink targets) and reporting the
first one that ``path_rules`` (the rules every life's result obeys) refuses, with the
path it lies at and the reason, escaped for a one-line message. A lineage imported or forked with an
ESC, a newline, a bidi override or a look-alike in a name would keep it through every
rollback commit, and every reader would show it.

Trusts pygit2 to read the objects; trusts nothing in the names.
"""

from __future__ import annotations

from collections.abc import Iterable

import pygit2

from worker.instrument.path_rules import shown, target_problem, tree_name_problem

_TREE_MODE = 0o040000
_SYMLINK_MODE = 0o120000


def refused_name(repo: pygit2.Repository, roots: Iterable[pygit2.Tree]) -> str | None:
    """The first name or symlink target under ``roots`` the decoder's rules refuse, as
    "'PATH': REASON", or None when every name passes. Each tree is read once, however
    many commits share it."""
    seen: set[pygit2.Oid] = set()
    pending: list[tuple[bytes, pygit2.Tree]] = [(b"", root) for root in roots]
    while pending:
        prefix, tree = pending.pop()
        if tree.id in seen:
            continue
        seen.add(tree.id)
        for item in tree:
            # A tree's entries always have a name (the stubs allow None for any object).
            name = item.raw_name or b""
            path = prefix + name
            problem = tree_name_problem(name)
            if problem is None and item.filemode == _SYMLINK_MODE:
                problem = target_problem(repo[item.id].peel(pygit2.Blob).data)
            if problem is not None:
                return f"{shown(path)}: {problem}"
            if item.filemode == _TREE_MODE:
                pending.append((path + b"/", repo[item.id].peel(pygit2.Tree)))
    return None


def history_trees(repo: pygit2.Repository, tip: str) -> list[pygit2.Tree]:
    """The root tree of every commit in ``tip``'s history, every parent followed."""
    return [commit.tree for commit in repo.walk(repo[tip].peel(pygit2.Commit).id)]
