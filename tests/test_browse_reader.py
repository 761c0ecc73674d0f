"""The read-only reader: numbering from subjects, the legacy sample, caches, no writes."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from support.browse import PAYLOAD, sample_bundle, write_hostile_lineage
from support.legacy_lineage import FIXTURE_BACKTRACE, FIXTURE_GENERATIONS, FIXTURE_OUT_OF_LOOP

from scheduler.history import journal_entries, journal_entry, parse_subject
from scheduler.importer import import_bundle
from scheduler.reader import NotFound, Reader, parse_generation
from scheduler.readgit import ReadOnlyGit
from worker.fleet.settings import Settings
from worker.instrument.gitrepo import IDENTITY
from worker.instrument.store import ObservationStore, open_store


@pytest.fixture
def fixture_reader(tmp_path: Path, file_store: ObservationStore) -> Reader:
    repo = tmp_path / "lineages.git"
    import_bundle(sample_bundle(tmp_path), "sample", str(repo), claim=lambda: None)
    return Reader(file_store, repo)


def _git(repo: Path, *args: str, input: bytes | None = None) -> str:
    return subprocess.run(
        ["git", f"--git-dir={repo}", *args],
        input=input,
        capture_output=True,
        check=True,
        env={**os.environ, **IDENTITY},
    ).stdout.decode()


def _commit(repo: Path, parent: str, subject: str) -> str:
    tree = _git(repo, "rev-parse", f"{parent}^{{tree}}").strip()
    return _git(repo, "commit-tree", tree, "-p", parent, "-m", subject).strip()


def test_subjects_of_both_wordings_are_numbered_from_the_subject() -> None:
    cases = {
        "gen 12: no-change": ("no-change", 12, None),
        "gen 3: changed (organism +4/-1; 2 paths)": ("changed", 3, None),
        "gen 4: changed (organism unchanged; 1 other paths)": ("changed", 4, None),
        "gen 7: died (exit 137); staged writes discarded": ("died", 7, 137),
        "gen 1: died (exit 255); reverted": ("died", 1, 255),
        "gen 2: changed +197/-43": ("changed", 2, None),
        "gen 9: something the kernel never wrote": ("generation", 9, None),
        "external edit: gen 5: no-change": ("out-of-loop", None, None),
        "generation 5": ("out-of-loop", None, None),
        "gen 0: no-change": ("out-of-loop", None, None),
    }
    for subject, (kind, generation, exit_status) in cases.items():
        meaning = parse_subject(subject, is_root=False)
        assert (meaning.kind, meaning.generation, meaning.exit_status) == (
            kind,
            generation,
            exit_status,
        ), subject
    assert parse_subject("seed", is_root=True).kind == "seed"
    assert parse_subject("gen 2: changed +197/-43", is_root=False).summary == "organism +197/-43"


def test_journal_entries_carry_exit_and_the_fenced_lines_only() -> None:
    text = (
        "\n## gen 1 — died — 2026-08-12T15:40:08-07:00\nexit 255\n~~~\n"
        + "".join(f"{line}\n" for line in FIXTURE_BACKTRACE)
        + "~~~\n\n## gen 2 — changed — organism +1/-0; 1 paths — 2026-08-12T15:41:12Z\n"
    )
    entries = journal_entries(text)
    assert entries[1].exit_status == 255
    assert entries[1].stderr_lines == FIXTURE_BACKTRACE
    assert entries[2].words == "changed — organism +1/-0; 1 paths"
    assert entries[2].time == "2026-08-12T15:41:12Z"
    assert journal_entry(text, 1) == entries[1]
    assert journal_entry(text, 2) == entries[2]
    assert journal_entry(text, 3) is None


@pytest.mark.full
def test_fixture_reads_as_five_generations_one_death_and_unnumbered_edits(
    fixture_reader: Reader,
) -> None:
    view = fixture_reader.lineage("sample")
    numbered = {r.commit.generation: r.outcome for r in view.rows if r.commit.generation}
    assert numbered == FIXTURE_GENERATIONS
    unnumbered = [r.commit.subject for r in view.rows if r.commit.generation is None]
    assert unnumbered == FIXTURE_OUT_OF_LOOP
    summary = view.summary
    assert summary.kind == "imported"
    assert summary.generations == 5
    assert summary.outcomes == {"died": 1, "changed": 2, "no-change": 2}
    assert summary.out_of_loop == 5
    assert summary.backlog is None and summary.spent_usd is None
    # Deaths by kind: without observations, only the subject's "died" is known.
    assert summary.deaths == {"died": 1}
    # No figures are indexed, but git still tells the organism's size, its lines and the deaths.
    assert [series.key for series in view.series] == ["organism", "lines"]
    assert [mark.generation for mark in view.series[0].deaths] == [1]

    death = fixture_reader.generation("sample", 1)
    assert death.row.outcome == "died" and death.row.commit.exit_status == 255
    assert death.journal is not None and death.journal.stderr_lines == FIXTURE_BACKTRACE
    # The lethal body is the parent's organism.el: the hand commit that added the crash.
    assert death.lethal_body is not None and death.lethal_body.rstrip().endswith('(error "boom")')
    assert [f.path for f in death.diff] == ["organism.el", "journal.md"]
    assert death.diff[0].patch is not None and '-(error "boom")' in death.diff[0].patch
    assert death.observation is None
    assert (death.previous, death.next) == (None, 2)

    # Gen 3's parent is the external edit between gens 2 and 3, not gen 2.
    third = fixture_reader.generation("sample", 3)
    assert third.parent == next(
        r.commit.sha for r in view.rows if r.commit.subject == "external edit: silence probe"
    )


@pytest.mark.full
def test_compare_puts_organism_first_and_unknown_numbers_are_not_found(
    fixture_reader: Reader,
) -> None:
    compared = fixture_reader.compare("sample", 1, 5)
    paths = [f.path for f in compared.diff]
    assert paths[0] == "organism.el"
    assert set(paths) >= {"README.md", "lineage/gen-0001.el", "state.el"}
    assert all(f.patch for f in compared.diff)
    for bad in (
        lambda: fixture_reader.generation("sample", 6),
        lambda: fixture_reader.lineage("sample", page=2),
        lambda: fixture_reader.history("nope"),
        lambda: fixture_reader.history("../etc"),
    ):
        with pytest.raises(NotFound):
            bad()
    for text in ("0", "-1", "1e3", "٣", "01x", "9999999999", ""):
        with pytest.raises(NotFound):
            parse_generation(text)


@pytest.mark.full
def test_family_groups_lineages_seeded_from_the_same_organism(
    fixture_reader: Reader, tmp_path: Path
) -> None:
    import_bundle(
        sample_bundle(tmp_path), "sample-twin", str(tmp_path / "lineages.git"), claim=lambda: None
    )
    seed = fixture_reader.summary("sample").seed_sha256
    assert seed is not None
    root_organism = _git(tmp_path / "lineages.git", "show", "lineage-sample~9:organism.el")
    assert seed == hashlib.sha256(root_organism.encode()).hexdigest()
    assert [s.name for s in fixture_reader.family(seed).lineages] == ["sample", "sample-twin"]
    with pytest.raises(NotFound):
        fixture_reader.family("0" * 64)


@pytest.mark.full
def test_history_follows_new_commits_and_rewrites(fixture_reader: Reader, tmp_path: Path) -> None:
    repo = tmp_path / "lineages.git"
    before = fixture_reader.history("sample")
    head = before.head
    later = _commit(repo, head, "gen 6: no-change")
    _git(repo, "update-ref", "refs/heads/lineage-sample", later, head)
    # Only the new commit is read: the known history is extended, not re-read.
    assert fixture_reader._extend(before, later) is not None
    extended = fixture_reader.history("sample")
    assert extended.commits[0].sha == later and len(extended.commits) == len(before.commits) + 1
    assert extended.by_generation[6].sha == later
    # A rewritten branch (not a descendant of what was read) is read again in full.
    rewritten = _commit(repo, f"{head}~1", "gen 5: no-change")
    _git(repo, "update-ref", "refs/heads/lineage-sample", rewritten)
    again = fixture_reader.history("sample")
    assert 6 not in again.by_generation and again.by_generation[5].sha == rewritten


@pytest.mark.full
def test_browsing_writes_nothing_to_the_repository_or_the_store(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    write_hostile_lineage(settings)
    repo = Path(settings.lineage_repo_url)
    store_dir = settings.home_dir / "observations"

    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(path): (path.stat().st_size, path.stat().st_mtime_ns)
            for base in (repo, store_dir)
            for path in base.rglob("*")
        }

    before = snapshot()
    reader = Reader(open_store(settings.observations_url, settings), repo)
    reader.summaries()
    reader.lineage("xss")
    reader.generation("xss", 1)
    reader.generation("xss", 2)
    reader.compare("xss", 1, 2)
    reader.journal("xss")
    assert snapshot() == before


def test_git_access_refuses_every_subcommand_outside_the_allowlist(tmp_path: Path) -> None:
    git = ReadOnlyGit(tmp_path)
    for subcommand in ("update-ref", "gc", "fetch", "push", "config", "commit-tree", "repack"):
        with pytest.raises(PermissionError):
            git.run(subcommand)


@pytest.mark.parametrize("backend", ["file", "s3"])
@pytest.mark.full
def test_figures_come_from_the_index_object_on_either_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings: Settings = (
        request.getfixturevalue("s3_settings") if backend == "s3" else Settings(home=tmp_path)
    )
    write_hostile_lineage(settings)
    reader = Reader(
        open_store(settings.observations_url, settings), Path(settings.lineage_repo_url)
    )
    view = reader.lineage("xss")
    assert [r.outcome for r in view.rows] == ["process_exit", "out-of-loop", "changed", "seed"]
    assert view.summary.outcomes == {"died": 1, "changed": 1}
    assert view.summary.observed == 2 and view.summary.backlog == 0
    assert view.metadata is not None and view.summary.kind == "fleet"
    death = reader.generation("xss", 2)
    assert death.observation is not None and PAYLOAD in death.observation.stderr
    assert reader.generation("xss", 1).diff[0].path == "organism.el"
