"""Where each lineage lives: the fleet's shared repositories ("homes").

Owns the homes a host is configured with (``OUROBOROS_LINEAGE_REPOS``, JSON of name to
repository URL; unset, the one home ``default`` at ``OUROBOROS_LINEAGE_REPO``), the rule
that places a new lineage (rendezvous, or highest-random-weight, hashing: the home with
the greatest ``sha256(home + "\\0" + name)``, so adding a home moves no existing choice
but the ones the new home wins, and every host computes the same answer alone), one
``LineageCache`` per home for a role, finding an existing lineage's home, and listing
every lineage of every home.

Finding a lineage: the homes are asked in the rule's order (its choice first, then the
others by name), one ref lookup each, and all of them are asked, because a name is
unique fleet-wide and a branch in two homes (a move cut short, a copy made by hand) is
refused loudly rather than one of the two picked. The root metadata records the home a
lineage was made in (``LineageMetadata.home``); the branch itself says where it lives
now, which differs only after ``schedule-lineage move`` or an import into another home.
When no home holds the branch, the observation store's copy of the root says which home
should: one this host is not configured with is refused in one line naming it and the
setting. The answer is kept for the process (a process's ``Homes`` is used by one
thread); a branch that is gone from the home remembered is looked for again
(``fetch``), so a worker goes on after a move without a restart.

Trusts: the settings and the repositories' refs; root metadata read back is validated
(``worker.instrument.lineage``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable

from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.gitrepo import LineageCache, branch_ref, run_git
from worker.instrument.lineage import (
    LineageMetadata,
    check_free,
    check_name,
    parse_metadata,
    root_metadata,
)
from worker.instrument.names import BRANCH_PREFIX, is_home_name, is_lineage_name
from worker.instrument.repo_urls import local_repository
from worker.instrument.store import ObservationStore
from worker.instrument.store_keys import claim_key, metadata_key

log = logging.getLogger(__name__)

SETTING = "OUROBOROS_LINEAGE_REPOS"


def rendezvous(lineage: str, homes: Iterable[str]) -> str:
    """The home a new lineage of this name is placed in: the highest random weight."""
    return max(homes, key=lambda home: hashlib.sha256(f"{home}\0{lineage}".encode()).digest())


def search_order(lineage: str, homes: Iterable[str]) -> list[str]:
    """The homes in the order they are asked for ``lineage``: the rule's choice, then by name."""
    names = sorted(homes)
    first = rendezvous(lineage, names)
    return [first, *(home for home in names if home != first)]


def not_configured(lineage: str, home: str) -> Refusal:
    return Refusal(
        f"lineage {lineage} lives in home {home!r}, which {SETTING} does not configure on "
        "this host; add that home there"
    )


class Homes:
    """The homes of one role on this host: their caches, and where each lineage lives."""

    def __init__(
        self, settings: Settings, role: str = "worker", store: ObservationStore | None = None
    ) -> None:
        """store: where a lineage found in no home is looked up, to name its home."""
        self.settings = settings
        self.role = role
        self.urls = settings.lineage_homes
        self.store = store
        self._caches: dict[str, LineageCache] = {}
        self._found: dict[str, str] = {}

    def cache(self, home: str) -> LineageCache:
        """This role's cache of ``home``'s repository, made on first use."""
        if home not in self._caches:
            # Imported here: assembly builds Homes, and this keeps the import one-way.
            from worker.fleet.assembly import lineage_cache

            self._caches[home] = lineage_cache(self.settings, self.role, home)
        return self._caches[home]

    def require(self, home: str) -> str:
        """``home`` if this host is configured with it, else a one-line Refusal."""
        if home not in self.urls:
            raise Refusal(
                f"no home {home!r} in {SETTING}; use one of {', '.join(self.urls)}, or add it there"
            )
        return home

    def choose(self, lineage: str, home: str | None = None) -> str:
        """A new lineage's home: the one asked for (``--home``), or the rule's choice."""
        return self.require(home) if home is not None else rendezvous(lineage, self.urls)

    def claim(self, lineage: str, home: str | None = None) -> str:
        """The home a new lineage ``lineage`` goes to (``home``, or the rule's choice),
        once no home holds the name and neither the home nor the store has it."""
        check_name(lineage)
        if self.locate(lineage) is not None:
            raise Refusal(f"lineage {lineage} already exists; choose another name")
        chosen = self.choose(lineage, home)
        assert self.store is not None, "a lineage is only made with the store at hand"
        check_free(lineage, self.cache(chosen), self.store)
        self.reserve(lineage, chosen)
        return chosen

    def reserve(self, lineage: str, home: str) -> None:
        """Claim ``lineage`` for ``home`` in the observation store, write-once, before its
        branch is written there: the store is the fleet's, so of two commands making one
        name in two homes at once, one is refused here (each home's own compare-and-swap
        cannot see the other home). The claim for the same home again passes: a retry,
        a second import of one archive."""
        assert self.store is not None, "a lineage is only made with the store at hand"
        mine = json.dumps({"home": home, "lineage": lineage}, sort_keys=True).encode()
        key = claim_key(lineage)
        if self.store.put_once(key, mine):
            return
        held = self.store.get(key)
        if held == mine:
            return
        try:
            other = json.loads(held or b"")
            claimed = other["home"] if other["lineage"] == lineage else None
        except (ValueError, TypeError, KeyError):
            claimed = None
        if isinstance(claimed, str) and is_home_name(claimed):
            raise Refusal(
                f"lineage {lineage} is claimed for home {claimed}, not {home} (made, or being "
                "made, there by another command); choose another name"
            )
        raise Refusal(
            f"the store's claim of lineage {lineage} ({key}) is not one this fleet writes; "
            f"if no home holds lineage {lineage}, remove that object, or choose another name"
        )

    def made(self, home: str) -> bool:
        """Whether ``home``'s repository exists: a local one not made yet (by ``init`` or an
        import) holds no lineage; a remote one is asked."""
        path = local_repository(self.urls[home])
        return path is None or (path / "HEAD").exists()

    def holders(self, lineage: str) -> dict[str, str]:
        """Every home holding ``lineage-NAME``, with its head there, in search order."""
        found = {}
        for home in search_order(lineage, self.urls):
            if not self.made(home):
                continue
            head = self.cache(home).fetch(lineage)
            if head is not None:
                found[home] = head
        return found

    def locate(self, lineage: str) -> str | None:
        """The home ``lineage`` lives in; None if no home holds it (see the module)."""
        if lineage in self._found:
            return self._found[lineage]
        holders = self.holders(lineage)
        if len(holders) > 1:
            raise Refusal(
                f"lineage {lineage} is in homes {' and '.join(holders)}; a name lives in one "
                "home only: delete the stale branch (schedule-lineage move explains how)"
            )
        if not holders:
            recorded = self.recorded_home(lineage)
            if recorded is not None and recorded not in self.urls:
                raise not_configured(lineage, recorded)
            return None
        home = next(iter(holders))
        self._found[lineage] = home
        return home

    def recorded_home(self, lineage: str) -> str | None:
        """The home the store's metadata object names; None without a readable one (what
        an unreadable one means is the command's to say: import refuses it as a clash)."""
        raw = None if self.store is None else self.store.get(metadata_key(lineage))
        try:
            return None if raw is None else parse_metadata(raw, lineage).home_name
        except Refusal:
            return None

    def forget(self, lineage: str) -> None:
        self._found.pop(lineage, None)

    def moved(self, lineage: str) -> bool:
        """Whether the branch this process remembered has left its home (then forgotten)."""
        home = self._found.get(lineage)
        if home is None or self.cache(home).fetch(lineage) is not None:
            return False
        self.forget(lineage)
        return True

    def home_cache(self, lineage: str) -> LineageCache:
        """The cache of ``destination``: where it lives, else its rule's choice (a fetch
        there then finds nothing, as it would in a fleet of one home)."""
        return self.cache(self.destination(lineage))

    def destination(self, lineage: str, home: str | None = None) -> str:
        """The home ``lineage`` lives in, else the one it would be made in (``home``, or the
        rule's choice): where an import writes it."""
        found = self.locate(lineage)
        return found if found is not None else self.choose(lineage, home)

    def repository(self, lineage: str, home: str | None = None) -> str:
        """The URL of ``destination``."""
        return self.urls[self.destination(lineage, home)]

    def fetch(self, lineage: str) -> str | None:
        """The lineage's head in its home (fetching it); None if no home holds it.

        A branch gone from the home this process remembered (moved meanwhile) is looked
        for again in every home."""
        remembered = lineage in self._found
        head = self.home_cache(lineage).fetch(lineage)
        if head is None and remembered:
            self.forget(lineage)
            head = self.home_cache(lineage).fetch(lineage)
        return head

    def metadata(self, lineage: str, head: str) -> LineageMetadata:
        """The root metadata of ``lineage`` at ``head`` (fetched through ``fetch``)."""
        return root_metadata(self.home_cache(lineage), head, lineage)

    def move(self, lineage: str, target: str) -> tuple[list[str], str]:
        """Move ``lineage``'s branch to home ``target``: its objects copied there, the branch
        made there, then deleted from every home it leaves (only if still at the head that
        was copied; those homes must be local repositories). The caller makes sure no run
        drives it meanwhile. A move cut short (the branch in several homes at one head) is
        finished by moving it again. The homes it left and the head moved."""
        self.require(target)
        holders = self.holders(lineage)
        sources = [home for home in holders if home != target]
        if not sources:
            if target in holders:
                raise Refusal(f"lineage {lineage} already lives in home {target}")
            raise Refusal(f"no lineage named {lineage}; see schedule-lineage status for all")
        if len(set(holders.values())) > 1:
            raise Refusal(
                f"lineage {lineage} is in homes {' and '.join(holders)} at different heads; "
                'delete the stale branch by hand (docs/design.md, "Homes")'
            )
        head = holders[sources[0]]
        if target not in holders:
            into = self.cache(target)
            into.adopt(self.cache(sources[0]), head)
            if not into.push_cas(lineage, head, None):
                raise Refusal(
                    f"lineage {lineage} appeared in home {target} meanwhile; see it there"
                )
        # Checked again just before deleting: a home's path swapped under a running move
        # (a symlink) must not make the deletion take the only copy.
        if self.cache(target).fetch(lineage) != head:
            raise Refusal(
                f"lineage {lineage} is not at {head[:12]} in home {target} after the copy; "
                "nothing was deleted; move it again"
            )
        target_path = local_repository(self.urls[target])
        for source in sources:
            source_path = local_repository(self.urls[source])
            if target_path and source_path and os.path.samefile(source_path, target_path):
                raise Refusal(
                    f"homes {source} and {target} are now one repository; nothing was "
                    "deleted: give every home its own repository"
                )
            self._delete(source, lineage, head)
        self._found[lineage] = target
        return sources, head

    def _delete(self, home: str, lineage: str, head: str) -> None:
        """Delete ``lineage-NAME`` from ``home``'s repository, only if it is still at ``head``.

        Directly in the repository: what arrives through receive-pack may never delete a
        branch (``REPO_CONFIG``), so a move runs where the home it leaves is local."""
        repo = local_repository(self.urls[home])
        assert repo is not None, "move checks that the home it leaves is local"
        done = run_git(repo, "update-ref", "-d", branch_ref(lineage), head, check=False)
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise Refusal(
                f"lineage {lineage} was copied to its new home but not deleted from home "
                f"{home} ({said[-1] if said else 'git update-ref failed'}); move it again"
            )

    def lineages(self) -> dict[str, str]:
        """Every lineage branch of every home, by name, with its home.

        A foreign ref (a name git refuses, or content that names no object, as
        ls-remote shows it: all zeros) is no lineage: left out with a warning, so one
        broken ref never stops the reconciler or ``status`` for every lineage. A name in
        two homes is left out with a warning too (``locate`` refuses it). What the
        listing found is remembered, as ``locate`` would have found it.
        """
        prefix = f"refs/heads/{BRANCH_PREFIX}"
        found: dict[str, list[str]] = {}
        for home in filter(self.made, self.urls):
            for line in self.cache(home).ls_remote("refs/heads/*").splitlines():
                sha, _, ref = line.partition("\t")
                if not ref.startswith(prefix):
                    continue
                if is_lineage_name(name := ref.removeprefix(prefix)) and sha.strip("0"):
                    found.setdefault(name, []).append(home)
                else:
                    log.warning(
                        "ignoring %s of home %s: not a lineage branch git can read", ref, home
                    )
        listed = {}
        for name, homes in sorted(found.items()):
            if len(homes) > 1:
                log.warning("ignoring lineage %s: it is in homes %s", name, " and ".join(homes))
                continue
            listed[name] = self._found[name] = homes[0]
        return listed
