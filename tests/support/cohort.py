"""A cohort of replicates that have lived, written with the worker's own git and store code.

Each lineage's generations are real commits with the fleet's subjects and journal
entries (so every page, the generation page included, reads them as the fleet's) and
observations with their index, so a cohort's grid can be walked without a sandbox;
``write_lives`` gives any existing lineage (a fork, say) such generations.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from support.browse import create_test_lineage, sample_observation
from worker.fleet.assembly import lineage_cache, observation_store
from worker.fleet.settings import Settings
from worker.instrument import journal
from worker.instrument.gitrepo import Entry
from worker.instrument.names import JOURNAL_PATH, ORGANISM_PATH
from worker.instrument.records import DEATHS, IndexEntry, LineageIndex
from worker.instrument.store_keys import generation_key, index_key

SEED = b";; seed\n"


def write_cohort(settings: Settings, label: str, plans: dict[str, list[str]]) -> None:
    """Lineages ``plans`` (name -> the outcome of each generation) in cohort ``label``."""
    for name, outcomes in plans.items():
        create_test_lineage(settings, name, SEED, label)
        write_lives(settings, name, outcomes)


def write_lives(settings: Settings, name: str, outcomes: list[str], grow: int = 1) -> None:
    """Generations of existing lineage ``name``, one per outcome, after its head (a fork's
    seed, say); each change adds ``grow`` lines to organism.el and each death's stderr
    holds the backtrace head naming its generation (``void-function gen-N``)."""
    cache, store = lineage_cache(settings), observation_store(settings)
    head = cache.fetch(name)
    assert head is not None
    body = cache.read_blob(head, ORGANISM_PATH) or SEED
    start = datetime(2026, 4, 1, tzinfo=UTC)
    log, observations = b"", []
    for number, outcome in enumerate(outcomes, start=1):
        when = start + timedelta(minutes=number)
        stderr = ""
        if outcome == "changed":
            body += "".join(f";; gen {number}.{line}\n" for line in range(grow)).encode()
            summary = journal.changed_summary((grow, 0), 1)
            log = journal.append(log, journal.entry_changed(number, summary, when))
            subject = journal.subject_changed(number, summary)
        elif outcome in DEATHS:
            stderr = (
                f"Loading organism\nDebugger entered--Lisp error: (void-function gen-{number})\n"
            )
            log = journal.append(log, journal.entry_died(number, 255, stderr, when))
            subject = journal.subject_died(number, 255)
        else:
            log = journal.append(log, journal.entry_no_change(number, when))
            subject = journal.subject_no_change(number)
        tree = dict(
            cache.tree(head),
            **{
                ORGANISM_PATH: Entry("100644", cache.hash_bytes(body)),
                JOURNAL_PATH: Entry("100644", cache.hash_bytes(log)),
            },
        )
        commit = cache.commit(head, tree, subject)
        assert cache.push_cas(name, commit, head)
        observation = sample_observation(name, number, head, commit, outcome, when, stderr)
        store.put_once(
            generation_key(name, number), observation.model_dump_json(by_alias=True).encode()
        )
        observations.append(observation)
        head = commit
    index = LineageIndex(lineage=name, generations=[IndexEntry.of(o) for o in observations])
    store.put(index_key(name), index.model_dump_json().encode())
