"""Lineages spread over several shared repositories ("homes"), on real bare repositories.

A fleet of three homes (``default``, ``a`` and ``b``, each a bare repository made by
``init``): lineages placed by the rendezvous rule and by ``--home``, each recorded in
its root; real lives, on a real worker and by ``run --local``, landing every
generation exactly once in the lineage's home and nowhere else; ``status``, the
journal and the reader listing every home's lineages; a fork from one home into
another; an export from one fleet's home imported into another home of a second
fleet; ``move``; ``repack`` over every home; and the refusals: a bad
``OUROBOROS_LINEAGE_REPOS``, a lineage whose home this host is not configured with,
and a name found in two homes.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from support.fleet import INSTRUMENT_COMMIT, SMALL_PHYSICS, Fleet, Worker, wait_for

from scheduler.reader import Reader
from worker.fleet.assembly import Pipelines
from worker.fleet.homes import Homes, rendezvous, search_order
from worker.fleet.settings import Settings, load_settings
from worker.instrument.errors import Refusal
from worker.instrument.store import open_store

HOMES = ("a", "b", "default")
T = TypeVar("T", bound=Callable[..., Any])


def names_for_every_home(stem: str, each: int = 1) -> dict[str, list[str]]:
    """``each`` lineage names the rule places in every home, as ``init`` will place them."""
    found: dict[str, list[str]] = {home: [] for home in HOMES}
    number = 0
    while any(len(names) < each for names in found.values()):
        number += 1
        name = f"{stem}{number}"
        home = rendezvous(name, HOMES)
        if len(found[home]) < each:
            found[home].append(name)
    return found


def homes_env(root: Path) -> dict[str, str]:
    """Homes ``a`` and ``b`` beside the default one, under ``root`` (made by ``init``)."""
    (root / "homes").mkdir(parents=True, exist_ok=True)
    repos = {home: str(root / "homes" / f"{home}.git") for home in ("a", "b")}
    return {"OUROBOROS_LINEAGE_REPOS": json.dumps(repos)}


def repo_of(fleet: Fleet, home: str) -> Path:
    if home == "default":
        return fleet.repo
    return Path(json.loads(fleet.env["OUROBOROS_LINEAGE_REPOS"])[home])


def branches(fleet: Fleet, home: str) -> dict[str, str]:
    """The lineage branches of ``home``'s repository: name -> head."""
    out = subprocess.run(
        ["git", f"--git-dir={repo_of(fleet, home)}", "for-each-ref", "refs/heads/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    heads = {}
    for line in out.splitlines():
        sha, _, ref = line.partition(" commit\t")
        heads[ref.removeprefix("refs/heads/lineage-")] = sha
    return heads


def where(fleet: Fleet) -> dict[str, list[str]]:
    """Every lineage of the fleet, with the homes whose repository holds its branch."""
    found: dict[str, list[str]] = {}
    for home in HOMES:
        for name in branches(fleet, home):
            found.setdefault(name, []).append(home)
    return found


def git(fleet: Fleet, home: str, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={repo_of(fleet, home)}", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def root_meta(fleet: Fleet, home: str, name: str) -> dict[str, object]:
    root = git(fleet, home, "rev-list", "--max-parents=0", f"lineage-{name}").split()[0]
    return json.loads(git(fleet, home, "show", f"{root}:.ouroboros-lineage.json"))


def subjects(fleet: Fleet, home: str, name: str) -> list[str]:
    return git(fleet, home, "log", "--format=%s", f"lineage-{name}").splitlines()


def generation_subjects(fleet: Fleet, home: str, name: str) -> list[int]:
    """The generation number of every ``gen N:`` commit of the lineage, oldest first."""
    numbers = [s.split(":")[0].removeprefix("gen ") for s in subjects(fleet, home, name)]
    return sorted(int(n) for n in numbers if n.isdigit())


def living(test: T) -> T:
    """The marks of a test whose lineages live in real sandboxes (minutes at most)."""
    for mark in (pytest.mark.full, pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root):
        test = mark(test)
    return pytest.mark.timeout(600)(test)


@pytest.fixture
def spread(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path / "fleet", **homes_env(tmp_path / "fleet"))


# -- the rule, the setting (fast) -----------------------------------------------------


def test_the_rule_is_stable_and_a_new_home_takes_lineages_only_for_itself() -> None:
    names = [f"lineage{n}" for n in range(400)]
    three = {name: rendezvous(name, HOMES) for name in names}
    # Every home gets a fair share, and the order the homes are given in changes nothing.
    assert all(60 < list(three.values()).count(home) < 200 for home in HOMES)
    assert three == {name: rendezvous(name, reversed(HOMES)) for name in names}
    four = {name: rendezvous(name, (*HOMES, "c")) for name in names}
    assert {three[n] for n in names if four[n] != three[n]} != set()
    assert all(four[n] in (three[n], "c") for n in names)
    # Found by asking the rule's choice first, then the others by name.
    assert search_order("lineage7", HOMES)[0] == three["lineage7"]
    assert sorted(search_order("lineage7", HOMES)) == list(HOMES)


def test_homes_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUROBOROS_HOME", str(tmp_path))
    monkeypatch.delenv("OUROBOROS_LINEAGE_REPO", raising=False)
    monkeypatch.delenv("OUROBOROS_LINEAGE_REPOS", raising=False)
    assert Settings().lineage_homes == {"default": str(tmp_path / "lineages.git")}
    monkeypatch.setenv("OUROBOROS_LINEAGE_REPO", "/srv/old.git")
    monkeypatch.setenv("OUROBOROS_LINEAGE_REPOS", '{"b": "ssh://h/b.git", "a": "/srv/a.git"}')
    homes = load_settings().lineage_homes
    assert list(homes) == ["a", "b", "default"] and homes["default"] == "/srv/old.git"
    monkeypatch.setenv("OUROBOROS_LINEAGE_REPOS", '{"default": "/srv/new.git"}')
    assert load_settings().lineage_repo_url == "/srv/new.git"
    for bad, said in [
        ("{a", "not JSON"),
        ('{"A": "/srv/a.git"}', "A.[key]"),
        ('{"' + "x" * 33 + '": "/srv/a.git"}', "[key]"),
        ('{"a": ""}', "a:"),
        ('{"a": "/srv/a b.git"}', "a:"),
        ('["/srv/a.git"]', "dictionary"),
        ('{"a": "/srv/a.git", "a": "/srv/b.git"}', "'a' is given twice"),
    ]:
        monkeypatch.setenv("OUROBOROS_LINEAGE_REPOS", bad)
        with pytest.raises(Refusal) as refused:
            load_settings()
        assert str(refused.value).startswith("OUROBOROS_LINEAGE_REPOS:"), bad
        assert said in str(refused.value) and "\n" not in str(refused.value)
    # One repository spelled two ways is one home: a move between the two would delete
    # the lineage's only branch.
    monkeypatch.setenv("OUROBOROS_LINEAGE_REPO", str(tmp_path / "one.git"))
    for twins, said in [
        ({"a": "/srv/a.git", "b": "/srv/./x/../a.git/"}, "homes a and b are one repository"),
        ({"a": f"file://{tmp_path}/one.git"}, "homes a and default are one repository"),
        ({"a": "ssh://git@H/srv/a.git", "b": "git@h:/srv/a.git/"}, "ssh://git@h:22/srv/a.git"),
        ({"a": "ssh://h:22/~/a.git", "b": "h:a.git"}, "homes a and b are one repository"),
        ({"a": f"file://localhost{tmp_path}/one.git"}, "homes a and default are one"),
    ]:
        monkeypatch.setenv("OUROBOROS_LINEAGE_REPOS", json.dumps(twins))
        with pytest.raises(Refusal, match=re.escape(said)):
            load_settings()
    monkeypatch.setenv("OUROBOROS_LINEAGE_REPOS", '{"a": "h:/srv/a.git", "b": "h:srv/a.git"}')
    assert list(load_settings().lineage_homes) == ["a", "b", "default"]


# -- real repositories and lives ------------------------------------------------------


@pytest.mark.full
def test_a_bad_homes_setting_is_refused_in_one_line(spread: Fleet) -> None:
    for bad in ("{a", '{"Bad_Name": "/srv/x.git"}'):
        line = spread.refused("status", OUROBOROS_LINEAGE_REPOS=bad)
        assert line.startswith("error: OUROBOROS_LINEAGE_REPOS:"), line
    line = spread.refused("init", "x", "--home", "nowhere")
    assert "no home 'nowhere' in OUROBOROS_LINEAGE_REPOS" in line


@pytest.mark.full
def test_init_places_each_lineage_by_the_rule_or_home_and_records_it(spread: Fleet) -> None:
    chosen = names_for_every_home("spread", each=2)
    names = [name for home in HOMES for name in chosen[home]]
    for name in names:
        spread.ok("init", name)
    spread.ok("init", "pinned", "--home", "b")
    found = where(spread)
    for home in HOMES:
        for name in chosen[home]:
            assert found[name] == [home]
            meta = root_meta(spread, home, name)
            # The default home is not written, so its roots read as before homes existed.
            assert meta.get("home") == (None if home == "default" else home)
    assert found["pinned"] == ["b"] and root_meta(spread, "b", "pinned")["home"] == "b"
    # A name is taken fleet-wide, whatever home the rule would give it now.
    line = spread.refused("init", "pinned", "--home", "a")
    assert "lineage pinned already exists" in line
    listed = {
        row["lineage"]: row["home"] for row in json.loads(spread.ok("status", "--json").stdout)
    }
    assert listed == {**{n: h for h in HOMES for n in chosen[h]}, "pinned": "b"}


@living
def test_lives_on_a_worker_land_each_generation_once_in_their_home_only(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.env.update(homes_env(fleet.home))
    chosen = {home: names[0] for home, names in names_for_every_home("live").items()}
    for name in chosen.values():
        fleet.ok("init", name, *SMALL_PHYSICS)
    workers.append(Worker(fleet, "w1", concurrency=2))
    workers[-1].wait_ready()
    fleet.ok("run", *chosen.values(), "--generations", "3", "--wait", timeout=400)
    for home, name in chosen.items():
        assert where(fleet)[name] == [home]
        assert generation_subjects(fleet, home, name) == [1, 2, 3]
        assert fleet.observation_numbers(name) == [1, 2, 3]
        committed = git(fleet, home, "rev-list", f"lineage-{name}").split()
        observed = {fleet.observation(name, n)["lineage_commit"] for n in (1, 2, 3)}
        assert observed <= set(committed)
        # No object of another home's lineage leaked into this home's repository.
        for other, other_name in chosen.items():
            if other != home:
                assert f"lineage-{other_name}" not in git(fleet, home, "for-each-ref")
    statuses = {row["lineage"]: row for row in json.loads(fleet.ok("status", "--json").stdout)}
    assert {name: statuses[name]["generation"] for name in chosen.values()} == dict.fromkeys(
        chosen.values(), 3
    )
    assert {statuses[name]["home"] for name in chosen.values()} == set(HOMES)
    for name in chosen.values():
        assert "gen 3:" in fleet.ok("journal", name).stdout
    settings = Settings(
        home=fleet.home / ".ouroboros",
        lineage_repos={h: str(repo_of(fleet, h)) for h in ("a", "b")},
    )
    reader = Reader(
        open_store(settings.observations_url, settings),
        fleet.repo,
        [repo_of(fleet, "a"), repo_of(fleet, "b")],
    )
    assert set(reader.heads()) == set(chosen.values())
    for name in chosen.values():
        assert reader.lineage(name).summary.generations == 3


@living
def test_fork_from_one_home_into_another_then_live_there(spread: Fleet) -> None:
    spread.ok("init", "parent", "--home", "a", *SMALL_PHYSICS)
    spread.ok("run", "parent", "--generations", "2", "--local")
    spread.ok("fork", "child", "--from", "parent@1", "--home", "b")
    assert where(spread)["child"] == ["b"] and where(spread)["parent"] == ["a"]
    meta = root_meta(spread, "b", "child")
    assert meta["home"] == "b"
    assert meta["parent"]["lineage"] == "parent" and meta["parent"]["generation"] == 1  # type: ignore[index]
    # The seed's tree, and only it, was copied to b: the parent's commits stay in a.
    parent_tree = git(spread, "a", "rev-parse", "lineage-parent~1^{tree}").strip()
    assert git(spread, "b", "cat-file", "-t", parent_tree).strip() == "tree"
    parent_head = git(spread, "a", "rev-parse", "lineage-parent").strip()
    missing = subprocess.run(
        ["git", f"--git-dir={repo_of(spread, 'b')}", "cat-file", "-e", parent_head],
        capture_output=True,
    )
    assert missing.returncode != 0
    spread.ok("run", "child", "--generations", "1", "--local")
    assert generation_subjects(spread, "b", "child") == [1]
    assert "lineage-child" not in git(spread, "a", "for-each-ref")
    # The genealogy reads across homes.
    status = {row["lineage"]: row for row in json.loads(spread.ok("status", "--json").stdout)}
    assert status["child"]["generation"] == 1 and status["parent"]["generation"] == 2
    assert status["child"]["genealogy"]["parent"]["lineage"] == "parent"


@living
def test_export_from_one_home_and_import_into_another_home_of_another_fleet(
    tmp_path: Path, spread: Fleet
) -> None:
    spread.ok("init", "travel", "--home", "a", *SMALL_PHYSICS)
    spread.ok("run", "travel", "--generations", "2", "--local")
    archive = tmp_path / "travel.tar.gz"
    spread.ok("export", "travel", "--to", str(archive))
    spread.ok("verify", str(archive))
    other = Fleet(tmp_path / "other", **homes_env(tmp_path / "other"))
    other.ok("init", "first", "--home", "a")  # makes the other fleet's homes
    done = other.ok("import", str(archive), "--home", "b").stdout
    assert str(repo_of(other, "b")) in done
    assert where(other)["travel"] == ["b"]
    assert generation_subjects(other, "b", "travel") == [1, 2]
    # Importing again changes nothing, and leaves it in its home.
    again = other.ok("import", str(archive)).stdout
    assert "already there" in again and where(other)["travel"] == ["b"]
    other.ok("run", "travel", "--generations", "1", "--local")
    assert generation_subjects(other, "b", "travel") == [1, 2, 3]
    assert "lineage-travel" not in git(other, "a", "for-each-ref")
    assert "travel" in other.ok("observations", "travel").stdout


@living
def test_move_takes_a_lineage_to_another_home_where_it_lives_on(spread: Fleet) -> None:
    spread.ok("init", "mover", "--home", "a", *SMALL_PHYSICS)
    spread.ok("run", "mover", "--generations", "1", "--local")
    head = branches(spread, "a")["mover"]
    assert "already lives in home a" in spread.refused("move", "mover", "--to", "a")
    assert "no home 'c'" in spread.refused("move", "mover", "--to", "c")
    done = spread.ok("move", "mover", "--to", "default").stdout
    assert f"moved lineage mover (branch lineage-mover at {head[:12]}) from home a" in done
    assert where(spread)["mover"] == ["default"] and branches(spread, "default")["mover"] == head
    spread.ok("run", "mover", "--generations", "1", "--local")
    assert generation_subjects(spread, "default", "mover") == [1, 2]
    assert where(spread)["mover"] == ["default"]
    assert spread.observation_numbers("mover") == [1, 2]
    # A move cut short (the branch copied, not yet deleted) is refused by every command
    # and finished by moving again.
    git(spread, "b", "fetch", "-q", str(spread.repo), "lineage-mover:lineage-mover")
    line = spread.refused("run", "mover", "--generations", "1", "--local")
    assert "lineage mover is in homes" in line and "default" in line and "b" in line
    spread.ok("move", "mover", "--to", "b")
    assert where(spread)["mover"] == ["b"]


@living
def test_a_worker_goes_on_with_a_lineage_moved_while_its_run_was_stopped(
    fleet: Fleet, workers: list[Worker]
) -> None:
    fleet.env.update(homes_env(fleet.home))
    fleet.ok("init", "roamer", "--home", "a", *SMALL_PHYSICS)
    workers.append(Worker(fleet, "w1"))
    workers[-1].wait_ready()
    fleet.ok("run", "roamer", "--generations", "1", "--wait", timeout=300)
    fleet.ok("run", "roamer", "--generations", "1000")
    line = fleet.refused("move", "roamer", "--to", "b")
    assert "lineage roamer has an active run" in line and "cancel roamer" in line
    fleet.ok("cancel", "roamer")

    def stopped() -> bool:
        row = json.loads(fleet.ok("status", "roamer", "--json").stdout)[0]
        return row["in_flight"] is None

    wait_for(stopped, 120, "the cancelled run's last generation to land")
    landed = generation_subjects(fleet, "a", "roamer")
    fleet.ok("move", "roamer", "--to", "b")
    # The worker remembered home a for roamer: it finds the branch gone and looks again.
    fleet.ok("run", "roamer", "--generations", "2", "--wait", timeout=300)
    assert where(fleet)["roamer"] == ["b"]
    assert generation_subjects(fleet, "b", "roamer") == [*landed, len(landed) + 1, len(landed) + 2]
    assert fleet.observation_numbers("roamer") == list(range(1, len(landed) + 3))
    assert "cannot advance here" not in workers[-1].text()


@pytest.mark.full
def test_repack_packs_every_home(spread: Fleet) -> None:
    chosen = names_for_every_home("packed")
    for names in chosen.values():
        spread.ok("init", names[0])
    done = spread.ok("repack").stdout
    for home in HOMES:
        assert f"{repo_of(spread, home)}: " in done
        count = git(spread, home, "count-objects", "-v")
        assert "\ncount: 0\n" in f"\n{count}"


@pytest.mark.full
def test_a_lineage_of_a_home_this_host_lacks_is_refused_naming_it(spread: Fleet) -> None:
    chosen = names_for_every_home("lost")
    name = chosen["b"][0]
    spread.ok("init", name)
    only_a = json.dumps({"a": str(repo_of(spread, "a"))})
    for command in (["run", name, "--generations", "1", "--local"], ["export", name]):
        line = spread.refused(*command, OUROBOROS_LINEAGE_REPOS=only_a)
        assert f"lineage {name} lives in home 'b'" in line
        assert "OUROBOROS_LINEAGE_REPOS" in line


@pytest.mark.full
def test_one_name_made_at_once_in_three_homes_is_made_in_one(tmp_path: Path, spread: Fleet) -> None:
    spread.ok("init", "first")  # makes the homes
    (tmp_path / "source").mkdir()
    source = Fleet(tmp_path / "source")
    source.ok("init", "carried")
    archive = tmp_path / "carried.tar.gz"
    source.ok("export", "carried", "--to", str(archive))
    bundle = tmp_path / "carried.bundle"
    subprocess.run(
        ["git", f"--git-dir={source.repo}", "bundle", "create", str(bundle), "lineage-carried"],
        check=True,
        capture_output=True,
    )
    attempts = {
        "made": [["init", "made", "--home", home] for home in HOMES],
        "carried": [["import", str(archive), "--home", home] for home in HOMES],
        "bundled": [["import-bundle", str(bundle), "bundled", "--home", home] for home in HOMES],
    }
    for name, commands in attempts.items():
        with ThreadPoolExecutor(len(commands)) as pool:
            done = list(pool.map(lambda argv: spread.cli(*argv), commands))
        said = [d.stdout + d.stderr for d in done]
        # One makes it; each other is refused, or (an import) finds it made and says so.
        made = [d for d in done if d.returncode == 0 and "already there" not in d.stdout]
        assert len(made) == 1 and all(d.returncode in (0, 2) for d in done), said
        for refused in (d for d in done if d.returncode == 2):
            line = refused.stderr.strip()
            assert "\n" not in line and "Traceback" not in line, line
            assert f"lineage {name} is claimed for home" in line or "already" in line
        assert len(where(spread)[name]) == 1, where(spread)
    # The claim is for its home: the same import into that home again passes.
    (home,) = where(spread)["carried"]
    assert "already there" in spread.ok("import", str(archive), "--home", home).stdout


@pytest.mark.full
def test_a_move_cut_short_over_three_homes_is_finished_by_moving_again(spread: Fleet) -> None:
    spread.ok("init", "spilled", "--home", "a")
    for home in ("b", "default"):
        git(
            spread,
            home,
            "fetch",
            "-q",
            str(repo_of(spread, "a")),
            "lineage-spilled:lineage-spilled",
        )
    assert where(spread)["spilled"] == ["a", "b", "default"]
    done = spread.ok("move", "spilled", "--to", "default").stdout
    assert "from home a and b to home default" in done
    assert where(spread)["spilled"] == ["default"]


@living
def test_a_worker_lacking_the_home_a_lineage_lives_in_says_so(spread: Fleet) -> None:
    # Made in a (its root says so), moved to b, which this worker's host lacks.
    spread.ok("init", "elsewhere", "--home", "a")
    spread.ok("move", "elsewhere", "--to", "b")
    settings = Settings(
        home=spread.home / ".ouroboros",
        lineage_repos={"a": str(repo_of(spread, "a"))},
        instrument_commit=INSTRUMENT_COMMIT,
    )
    with pytest.raises(Refusal) as refused:
        Pipelines(settings).of("elsewhere")
    said = str(refused.value)
    assert "lineage elsewhere is in none of this host's homes (a, default)" in said, said
    assert "OUROBOROS_LINEAGE_REPOS" in said and "init" not in said


@pytest.mark.full
def test_a_home_made_one_with_another_after_load_loses_no_branch(spread: Fleet) -> None:
    spread.ok("init", "kept", "--home", "a")
    settings = Settings(
        home=spread.home / ".ouroboros",
        lineage_repos={h: str(repo_of(spread, h)) for h in ("a", "b")},
    )
    # b becomes a symlink to a once the settings have been accepted.
    b = repo_of(spread, "b")
    b.rename(b.with_name("b-real.git"))
    b.symlink_to(repo_of(spread, "a"))
    homes = Homes(settings, "scheduler", open_store(settings.observations_url, settings))
    with pytest.raises(Refusal, match="homes a and b are now one repository; nothing was deleted"):
        homes.move("kept", "b")
    assert "lineage-kept" in git(spread, "a", "for-each-ref")


@pytest.mark.full
def test_a_claim_this_fleet_did_not_write_is_named(spread: Fleet) -> None:
    spread.ok("init", "first")
    claims = spread.observations / "claims"
    (claims / "planted.json").write_bytes(b"not a claim")
    line = spread.refused("init", "planted")
    assert "the store's claim of lineage planted (claims/planted.json) is not one" in line
    assert "planted" not in where(spread)
