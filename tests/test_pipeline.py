"""The generation contract end to end, through ``schedule-lineage init`` and ``run --local``.

These carry over every behaviour the single-host original's test asserted, on real
bwrap, Emacs, git and cgroups: lineage creation, refusals before any sandbox starts,
the fixed commit and journal wording, death rollback, and observations.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.fleet import SMALL_PHYSICS, Fleet
from support.lives import make_lineage, push_hand_commit, run_one

from scheduler.reader import open_reader
from worker.fleet import embedded_redis
from worker.fleet.settings import Settings
from worker.instrument import syscall_filter
from worker.instrument.fingerprint import PACKAGE_ROOT
from worker.instrument.sandbox import KERNEL_PARENT, KERNEL_PREFIX, OWNER_SUFFIX

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root]


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path)


def test_init_commits_canonical_seed_with_pinned_metadata(fleet: Fleet) -> None:
    fleet.ok("init", "alpha")
    assert fleet.show("alpha", "organism.el") == (PACKAGE_ROOT / "organism.el").read_text()
    assert fleet.show("alpha", "journal.md") == ""
    assert fleet.subjects("alpha") == ["seed"]
    meta = json.loads(fleet.show("alpha", ".ouroboros-lineage.json"))
    assert meta["schema"] == "ouroboros-fleet-lineage/v1"
    assert meta["instrument_commit"] == "a" * 40
    assert len(meta["instrument_fingerprint"]) == 64
    assert meta["physics"]["wall_seconds"] == 600
    assert meta["physics"]["cpu_seconds"] == 120
    assert meta["physics"]["memory_max_bytes"] == 1024**3
    assert meta["physics"]["budget_usd"] == "1.00"
    stored = json.loads((fleet.observations / "lineages/alpha/metadata.json").read_text())
    assert stored == meta


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["Bad_Name"], "invalid lineage name"),
        (["ok", "--seed", "/nonexistent/seed.el"], "cannot read seed"),
        (["ok", "--wall", "600", "--cpu-seconds", "5"], "under 1% of wall"),
        (["ok", "--memory-max", "lots"], "--memory-max-bytes"),
    ],
)
def test_init_refuses_bad_input_with_one_clear_line(
    fleet: Fleet, args: list[str], needle: str
) -> None:
    result = fleet.cli("init", *args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert not (fleet.repo / "refs/heads/lineage-ok").exists()


def test_init_refuses_to_reuse_an_existing_lineage(fleet: Fleet) -> None:
    fleet.ok("init", "alpha")
    result = fleet.cli("init", "alpha")
    assert result.returncode == 2
    assert "already exists" in result.stderr
    assert fleet.subjects("alpha") == ["seed"]


def test_init_refuses_a_dirty_instrument_checkout(fleet: Fleet, tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    shutil.copytree(PACKAGE_ROOT / "worker", checkout / "worker", symlinks=True)
    shutil.copytree(PACKAGE_ROOT / "scheduler", checkout / "scheduler")
    shutil.copytree(PACKAGE_ROOT / "sandbox_scripts", checkout / "sandbox_scripts")
    shutil.copy2(PACKAGE_ROOT / "organism.el", checkout / "organism.el")
    git = ["git", "-C", str(checkout)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run(
        [*git, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True
    )
    (checkout / "organism.el").write_text(";; edited\n")
    env = {k: v for k, v in fleet.env.items() if k != "OUROBOROS_INSTRUMENT_COMMIT"}
    result = subprocess.run(
        [sys.executable, "-m", "scheduler", "init", "alpha"],
        env={**env, "PYTHONPATH": str(checkout)},
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert "uncommitted tracked changes" in result.stderr


def test_scripted_generation_changes_and_next_generation_sees_new_body(fleet: Fleet) -> None:
    fleet.ok("init", "alpha", *SMALL_PHYSICS)
    first = run_one(fleet, "alpha")
    assert "alpha gen 1: changed" in first.stdout
    body1 = fleet.show("alpha", "organism.el")
    run_one(fleet, "alpha")
    body2 = fleet.show("alpha", "organism.el")
    assert body1 != body2
    subjects = fleet.subjects("alpha")
    assert subjects[0].startswith("gen 2: changed (organism +")
    assert subjects[1].startswith("gen 1: changed (organism +")
    observation = fleet.observation("alpha", 2)
    assert observation["outcome"] == "changed"
    assert observation["provider"] == "scripted"
    calls = observation["model_calls"]
    assert len(calls) == 1 and calls[0]["status"] == 200
    # The second life was given the body the first one wrote.
    assert body1 in calls[0]["prompt"]
    assert observation["provenance"]["ceiling_driver"] == "cgroup1"
    # The life lived under the filter whose digest its capabilities.json disclosed.
    assert observation["provenance"]["syscall_filter"] == syscall_filter.DIGEST
    assert observation["cpu_usage_nsec"] > 0
    assert observation["memory_peak_bytes"] > 0
    assert observation["figure_sources"]
    journal = fleet.show("alpha", "journal.md")
    assert "## gen 1 — changed — organism +" in journal
    assert "## gen 2 — changed — organism +" in journal


def test_canonical_seed_never_takes_an_answer_cut_at_the_token_limit_as_its_body(
    fleet: Fleet,
) -> None:
    # The scripted stand-in answers with the seed's own source, over 4 KiB: 100 tokens
    # (400 bytes) cut it mid-form. Taken as the body, it would kill the next life with
    # end-of-file; the socket says max_tokens, so the seed keeps the body it has.
    fleet.ok("init", "alpha", *SMALL_PHYSICS, "--max-output-tokens", "100")
    seed = fleet.show("alpha", "organism.el")

    run_one(fleet, "alpha")
    run_one(fleet, "alpha")

    assert fleet.subjects("alpha") == ["gen 2: no-change", "gen 1: no-change", "seed"]
    assert fleet.show("alpha", "organism.el") == seed
    for generation in (1, 2):
        observation = fleet.observation("alpha", generation)
        [call] = observation["model_calls"]
        assert (call["status"], call["stop_reason"]) == (200, "max_tokens")
        assert len(call["response"].encode()) <= 400
        assert "the model stopped (max_tokens); this body lives on" in observation["stderr"]


def test_no_change_has_no_zero_zero_diffstat(fleet: Fleet) -> None:
    make_lineage(fleet, "quiet", '(message "alive")\n')
    run_one(fleet, "quiet")
    journal = fleet.show("quiet", "journal.md")
    assert "## gen 1 — no-change — " in journal
    assert "+0/-0" not in journal
    assert fleet.subjects("quiet")[0] == "gen 1: no-change"
    assert fleet.observation("quiet", 1)["outcome"] == "no-change"


def test_other_file_change_gets_unambiguous_journal_message(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "memo",
        '(with-temp-file "/work/state.el" (insert "(:generation 1)\\n"))\n',
    )
    run_one(fleet, "memo")
    assert "changed — organism unchanged; 1 other paths" in fleet.show("memo", "journal.md")
    assert fleet.subjects("memo")[0] == "gen 1: changed (organism unchanged; 1 other paths)"
    assert fleet.show("memo", "state.el") == "(:generation 1)\n"


def test_gitignore_cannot_hide_successful_hereditary_files(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "hider",
        '(with-temp-file "/work/.gitignore" (insert "hidden.txt\\n"))\n'
        '(with-temp-file "/work/hidden.txt" (insert "still hereditary\\n"))\n',
    )
    run_one(fleet, "hider")
    files = fleet.files("hider")
    assert ".gitignore" in files
    assert "hidden.txt" in files


def test_death_never_publishes_speculative_result_and_rolls_body_back(fleet: Fleet) -> None:
    make_lineage(fleet, "mortal", '(message "fine")\n')
    good = fleet.show("mortal", "organism.el")
    # An out-of-loop commit makes the body lethal, as a human might.
    lethal = good + '(with-temp-file "/work/unpublished.txt" (insert "no"))\n(kill-emacs 9)\n'
    push_hand_commit(fleet, "mortal", {"organism.el": lethal}, "external edit: lethal")
    run_one(fleet, "mortal")
    assert fleet.subjects("mortal")[0] == "gen 1: died (exit 9); staged writes discarded"
    assert "unpublished.txt" not in fleet.files("mortal")
    assert fleet.show("mortal", "organism.el") == good
    journal = fleet.show("mortal", "journal.md")
    assert "## gen 1 — died — " in journal
    assert "exit 9\n~~~\n" in journal
    observation = fleet.observation("mortal", 1)
    assert observation["outcome"] == "process_exit"
    assert observation["exit_status"] == 9
    assert observation["lineage_commit"] == fleet.git("rev-parse", "lineage-mortal").strip()


def test_death_error_reaches_observer_but_journal_keeps_five_lines(fleet: Fleet) -> None:
    frames = "".join(f'(message "  frame-{i}()")\n' for i in range(12))
    make_lineage(
        fleet,
        "talker",
        '(message "Error: wrong-type-argument (stringp nil)")\n' + frames + "(kill-emacs 255)\n",
    )
    run_one(fleet, "talker")
    journal = fleet.show("talker", "journal.md")
    assert "frame-7()" in journal
    assert "frame-11()" in journal
    assert "frame-6()" not in journal
    assert "wrong-type-argument" not in journal
    observation = fleet.observation("talker", 1)
    assert "wrong-type-argument" in observation["stderr"]
    assert observation["exit_status"] == 255


def test_cgroup_oom_is_distinguished_from_generic_signal_death(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "glutton",
        "(let (hoard) (dotimes (_ 4000) (push (make-string (* 1024 1024) ?x) hoard)))\n",
        "--memory-max",
        "128M",
    )
    run_one(fleet, "glutton")
    observation = fleet.observation("glutton", 1)
    assert observation["outcome"] == "cgroup_oom"
    assert observation["oom_kills"] >= 1
    assert fleet.subjects("glutton")[0].startswith("gen 1: died (exit ")


def test_unknown_provider_is_refused_before_any_sandbox(fleet: Fleet) -> None:
    fleet.ok("init", "alpha")
    result = fleet.cli("run", "alpha", "--generations", "1", "--local", "--provider", "unknown")
    assert result.returncode == 2
    assert "OUROBOROS_MODEL_PROVIDER" in result.stderr
    assert fleet.subjects("alpha") == ["seed"]


def test_missing_selected_key_is_refused_naming_the_variable(fleet: Fleet) -> None:
    fleet.ok("init", "alpha")
    result = fleet.cli(
        "run", "alpha", "--generations", "1", "--local", "--provider", "openai", "--model", "gpt-5"
    )
    assert result.returncode == 2
    assert "OPENAI_API_KEY" in result.stderr
    assert fleet.subjects("alpha") == ["seed"]


def test_scope_failure_is_preflight_not_an_organism_death(fleet: Fleet, tmp_path: Path) -> None:
    fleet.ok("init", "alpha")
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    for name in ("systemd-run", "systemctl"):
        tool = fakebin / name
        tool.write_text("#!/bin/sh\nexit 1\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    result = fleet.cli(
        "run",
        "alpha",
        "--generations",
        "1",
        "--local",
        "--ceiling",
        "systemd",
        PATH=f"{fakebin}:{fleet.env['PATH']}",
    )
    assert result.returncode == 2
    assert "aggregate resource scope" in result.stderr
    assert fleet.subjects("alpha") == ["seed"]


def test_changed_trusted_runtime_cannot_continue_existing_lineage(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.ok("init", "alpha")
    changed = tmp_path / "changed-instrument"
    for part in ("worker", "scheduler", "sandbox_scripts"):
        shutil.copytree(PACKAGE_ROOT / part, changed / part, symlinks=True)
    shutil.copy2(PACKAGE_ROOT / "organism.el", changed / "organism.el")
    with (changed / "sandbox_scripts" / "stage.sh").open("a") as runner:
        runner.write("\n# changed physics\n")
    result = fleet.cli("run", "alpha", "--generations", "1", "--local", PYTHONPATH=str(changed))
    assert result.returncode == 2, result.stderr
    assert "start a new lineage" in result.stderr
    assert fleet.subjects("alpha") == ["seed"]


def test_different_instrument_commit_cannot_continue_lineage(fleet: Fleet) -> None:
    fleet.ok("init", "alpha")
    result = fleet.cli(
        "run", "alpha", "--generations", "1", "--local", OUROBOROS_INSTRUMENT_COMMIT="b" * 40
    )
    assert result.returncode == 2
    assert "instrument commit differs" in result.stderr


def test_numbering_counts_gen_subjects_not_history_positions(fleet: Fleet) -> None:
    make_lineage(fleet, "counted", '(message "alive")\n')
    run_one(fleet, "counted")
    push_hand_commit(fleet, "counted", {"notes.txt": "by hand\n"}, "external edit: notes")
    run_one(fleet, "counted")
    assert fleet.subjects("counted") == [
        "gen 2: no-change",
        "external edit: notes",
        "gen 1: no-change",
        "seed",
    ]
    assert fleet.observation("counted", 2)["generation"] == 2


def test_a_hand_commit_titled_gen_notes_is_no_generation_for_writer_or_readers(
    fleet: Fleet,
) -> None:
    make_lineage(fleet, "noted", '(message "alive")\n')
    run_one(fleet, "noted")
    push_hand_commit(fleet, "noted", {"notes.txt": "by hand\n"}, "gen notes")
    run_one(fleet, "noted")
    assert fleet.subjects("noted")[:2] == ["gen 2: no-change", "gen notes"]
    assert fleet.observation("noted", 2)["generation"] == 2
    # The scheduler's status and the browser's reader use the same rule as the writer.
    try:
        (status,) = json.loads(fleet.ok("status", "noted", "--json").stdout)
    finally:
        embedded_redis.stop(Settings(home=fleet.home / ".ouroboros"))
    assert status["generation"] == 2
    summary = open_reader(Settings(home=fleet.home / ".ouroboros")).lineage("noted").summary
    assert (summary.generations, summary.out_of_loop) == (2, 2)  # the seed and the hand commit


def test_result_holding_a_kernel_owned_path_dies_as_decoder_rejection(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "forger",
        '(with-temp-file "/work/journal.md" (insert "## gen 99 — forged\\n"))\n'
        '(with-temp-file "/work/extra.txt" (insert "speculative"))\n',
    )
    run_one(fleet, "forger")
    assert fleet.subjects("forger")[0] == "gen 1: died (exit 0); staged writes discarded"
    assert "extra.txt" not in fleet.files("forger")
    assert "forged" not in fleet.show("forger", "journal.md")
    observation = fleet.observation("forger", 1)
    assert observation["outcome"] == "decoder_rejection"
    assert "journal.md" in observation["rejection_reason"]


def test_result_holding_a_git_directory_dies_as_decoder_rejection(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "smuggler",
        '(make-directory "/work/.git/hooks" t)\n'
        '(with-temp-file "/work/.git/hooks/post-checkout" (insert "#!/bin/sh\\n"))\n',
    )
    run_one(fleet, "smuggler")
    observation = fleet.observation("smuggler", 1)
    assert observation["outcome"] == "decoder_rejection"
    assert not any(path.startswith(".git") for path in fleet.files("smuggler"))


def test_results_git_fsck_would_refuse_die_as_decoder_rejections(fleet: Fleet) -> None:
    """A .git after a backslash, or a .gitattributes line of 2,048 bytes or more, is a
    tree git fsck --strict refuses: committed, it would bar the lineage from
    import-bundle, from clones with transfer.fsckObjects and from a shared repository
    with receive.fsckObjects. Such a life dies as a decoder rejection, and the branch
    stays one git fsck --strict accepts."""
    make_lineage(fleet, "backslasher", '(with-temp-file "/work/a\\\\.git" (insert "x"))\n')
    make_lineage(
        fleet,
        "attributer",
        '(with-temp-file "/work/.gitattributes" (insert (make-string 3000 ?x) "\\n"))\n',
    )
    for lineage, reason in (
        (
            "backslasher",
            "member './a\\\\.git': 'a\\\\.git' holds a .git after a backslash, "
            "a separator on Windows: git fsck refuses it (hasDotgit)",
        ),
        (
            "attributer",
            "member './.gitattributes': a .gitattributes (or a name git reads so) with a "
            "line of 2048 bytes or more: git fsck refuses it (gitattributesLineLength)",
        ),
    ):
        run_one(fleet, lineage)
        assert fleet.subjects(lineage)[0] == "gen 1: died (exit 0); staged writes discarded"
        observation = fleet.observation(lineage, 1)
        assert observation["outcome"] == "decoder_rejection"
        assert observation["rejection_reason"] == reason
        assert fleet.files(lineage) == [".ouroboros-lineage.json", "journal.md", "organism.el"]
        fleet.git("fsck", "--strict", "--no-dangling", "--no-progress", f"lineage-{lineage}")


def test_stderr_cannot_forge_a_journal_entry(fleet: Fleet) -> None:
    make_lineage(
        fleet,
        "forger2",
        '(message "~~~")\n'
        '(message "## gen 1 — changed — organism +1/-0; 1 paths — 2020-01-01T00:00:00+00:00")\n'
        '(message "exit 0")\n'
        "(kill-emacs 3)\n",
    )
    run_one(fleet, "forger2")
    journal = fleet.show("forger2", "journal.md")
    assert [line for line in journal.splitlines() if line.startswith("## ")] == [
        line for line in journal.splitlines() if line.startswith("## gen 1 — died — ")
    ]
    rows = json.loads(fleet.ok("journal", "forger2", "--json").stdout)
    entries = [row["entry"] for row in rows if row["entry"] is not None]
    assert [(e["generation"], e["words"], e["exit_status"]) for e in entries] == [(1, "died", 3)]


def test_reusing_the_name_of_a_deleted_lineage_is_refused(fleet: Fleet) -> None:
    fleet.ok("init", "phoenix")
    fleet.ok("run", "phoenix", "--generations", "1", "--local")
    fleet.git("update-ref", "-d", "refs/heads/lineage-phoenix")
    result = fleet.cli("init", "phoenix")
    assert result.returncode == 2
    assert "still holds records of an earlier lineage phoenix" in result.stderr


def test_other_local_users_cannot_reach_the_kernel_or_the_model_socket(fleet: Fleet) -> None:
    make_lineage(fleet, "private", "(sleep-for 4)\n")
    life = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "run", "private", "--generations", "1", "--local"],
        env=fleet.env,
        cwd=fleet.home,
    )
    try:
        kernel = wait_for_kernel_dir(life.pid)
        # Neither an ordinary user nor the uid another concurrent life would get.
        for uid in (65534, kernel.stat().st_uid + 1):
            other = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            read = subprocess.run([*other, "cat", str(kernel / "base.tar")], capture_output=True)
            assert read.returncode != 0 and b"Permission denied" in read.stderr
            connect = subprocess.run(
                [*other, "/usr/bin/python3", "-c", CONNECT, str(kernel / "model.sock")],
                capture_output=True,
                text=True,
            )
            assert connect.returncode != 0 and "Permission denied" in connect.stderr
    finally:
        assert life.wait(timeout=120) == 0
    assert fleet.observation("private", 1)["model_calls"] == []


CONNECT = """
import socket, sys
client = socket.socket(socket.AF_UNIX)
client.connect(sys.argv[1])
print("connected")
"""


def wait_for_kernel_dir(pid: int) -> Path:
    for _ in range(600):
        for owner in KERNEL_PARENT.glob(f"{KERNEL_PREFIX}*{OWNER_SUFFIX}"):
            kernel = owner.with_name(owner.name.removesuffix(OWNER_SUFFIX))
            with contextlib.suppress(OSError):
                if owner.read_text() == str(pid) and (kernel / "model.sock").exists():
                    return kernel
        time.sleep(0.05)
    raise AssertionError("the generation never prepared its kernel directory")


def test_a_symlink_to_a_host_path_is_published_as_a_symlink_never_followed(fleet: Fleet) -> None:
    make_lineage(fleet, "linker", '(make-symbolic-link "/etc/passwd" "/work/passwd")\n')
    run_one(fleet, "linker")
    assert fleet.subjects("linker")[0] == "gen 1: changed (organism unchanged; 1 other paths)"
    listing = fleet.git("ls-tree", "lineage-linker", "passwd").split()
    assert listing[0] == "120000"
    assert fleet.git("cat-file", "blob", listing[2]) == "/etc/passwd"
