"""The fleet's places on this host: the shared repository, the observation store, the state.

Owns whether this process can use them, said in one line that names the place, the
setting that put it there and what to do: a place that is missing, a new one whose
parent directory does not exist, one this user cannot write (a read-only mount, an
immutable or foreign directory). And owns how ``init`` creates a missing repository
or file store: only one whose parent directory exists (the fleet's home itself only
when the home's parent exists), and it says so. The imports leave a missing one to
the import, which verifies its archive before it writes anything; every other command
refuses a missing one, so a typo in ``OUROBOROS_HOME``, ``OUROBOROS_LINEAGE_REPO`` or
``OUROBOROS_OBSERVATIONS`` never starts a new, empty record beside the real one.

Only local places are checked: a repository over ssh and an S3 store answer for
themselves when used. Trusts the settings; writes nothing but what it is asked to
create and a probe file, named with a leading dot (which git and the store's listing
skip), removed at once.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from worker.fleet.repo_admin import ensure_shared_repo
from worker.fleet.settings import Settings
from worker.instrument.errors import Refusal
from worker.instrument.names import DEFAULT_HOME
from worker.instrument.repo_urls import local_repository
from worker.instrument.store import FileStore, open_store


@dataclass(frozen=True)
class Place:
    """A local repository or file store, and the setting that names it."""

    what: str
    path: Path
    variable: str
    repository: bool

    def present(self) -> bool:
        return (self.path / "HEAD").exists() if self.repository else self.path.is_dir()

    def writable_dirs(self) -> list[Path]:
        """Where using it writes: a repository's objects and branch refs, a store's root."""
        if self.repository:
            return [self.path / "objects", self.path / "refs" / "heads"]
        return [self.path]


def places(settings: Settings) -> list[Place]:
    """The local shared repositories (every home's) and file store of ``settings``, if
    they are local."""
    found = []
    for home, url in settings.lineage_homes.items():
        repo = local_repository(url)
        if repo is None:
            continue
        if home != DEFAULT_HOME or DEFAULT_HOME in settings.lineage_repos:
            what, variable = f"shared lineage repository of home {home}", "OUROBOROS_LINEAGE_REPOS"
        else:
            what = "shared lineage repository"
            variable = "OUROBOROS_LINEAGE_REPO" if settings.lineage_repo else "OUROBOROS_HOME"
        found.append(Place(what, repo.absolute(), variable, True))
    store = open_store(settings.observations_url, settings)
    if isinstance(store, FileStore):
        variable = "OUROBOROS_OBSERVATIONS" if settings.observations else "OUROBOROS_HOME"
        found.append(Place("observation store", store.base, variable, False))
    return found


def require_places(
    settings: Settings, *, write: bool, create: bool = False, missing_ok: bool = False
) -> list[str]:
    """Refuse, in one line, a place this command cannot use; what was created (``create``).

    write: the command writes lineages or observations, so each place must be writable.
    create: a missing place is created when its parent directory exists (``init``).
    missing_ok: a missing place is left for the command to make (the imports, which
    verify an archive before they write anything); otherwise it is refused.
    """
    created = []
    for place in places(settings):
        if not place.present():
            if missing_ok:
                continue
            if not create:
                raise Refusal(
                    f"there is no {place.what} at {place.path}; create lineages with "
                    f"schedule-lineage init, or fix {place.variable} if it is mistyped"
                )
            created.append(_create(settings, place))
        if write:
            for directory in place.writable_dirs():
                if (problem := unwritable(directory)) is not None:
                    raise Refusal(
                        f"the {place.what} {place.path} is not writable here ({problem}); "
                        f"make it writable for this user, or fix {place.variable}"
                    )
    return created


def require_store_of_fleet(settings: Settings) -> None:
    """A worker's start: refuse a missing file store beside an existing local repository.

    A worker may start before the first ``init`` (no repository yet), but once the
    fleet exists its store does too: a missing one is a mistyped setting, and the
    worker's observations would start a second record.
    """
    found = places(settings)
    repository = next((p for p in found if p.repository and p.present()), None)
    for place in found:
        if repository is not None and not place.repository and not place.present():
            raise Refusal(
                f"there is no observation store at {place.path}, yet the shared lineage "
                f"repository {repository.path} exists; fix {place.variable} if it is mistyped"
            )


def _create(settings: Settings, place: Place) -> str:
    parent = place.path.parent
    home = settings.home_dir
    if parent == home and not home.exists() and home.parent.is_dir():
        # The fleet's home, made on its first init as it always was.
        home.mkdir()
    if not parent.is_dir():
        raise Refusal(
            f"cannot create the {place.what} {place.path}: its parent directory {parent} "
            f"does not exist; fix {place.variable} if it is mistyped, or create {parent} first"
        )
    if place.repository:
        ensure_shared_repo(str(place.path))
    else:
        try:
            place.path.mkdir()
        except OSError as exc:
            raise Refusal(
                f"cannot create the {place.what} {place.path}: {exc.strerror}; fix {place.variable}"
            ) from None
    return f"created a new {place.what} at {place.path}"


def state_dir(settings: Settings) -> Path:
    """The state directory, made if missing; a Refusal naming it if it cannot be used."""
    path = settings.state_path
    variable = "OUROBOROS_STATE_DIR" if settings.state_dir else "OUROBOROS_HOME"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refusal(
            f"the state directory {path} cannot be made ({exc.strerror}); "
            f"point {variable} at a writable directory"
        ) from None
    if (problem := unwritable(path)) is not None:
        raise Refusal(
            f"the state directory {path} is not writable here ({problem}); "
            f"point {variable} at a writable directory"
        )
    return path


def unwritable(directory: Path) -> str | None:
    """Why this user cannot create a file in ``directory``, or None if it can.

    Tried, not judged from modes: root passes every mode check, but not a read-only
    mount or an immutable directory.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".ouroboros-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(probe)
    return None
