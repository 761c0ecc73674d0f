"""``schedule-lineage replay``: real lives lived again from their observations.

A scripted lineage of twenty generations (changed, no change, a non-zero exit, a wall
timeout, a decoder rejection, an OOM, two calls in one life, a death after a call, then
the suite's hostile organisms: a .git directory, a symlink to a host file, a hard link, a
FIFO, a bidi name, a forged journal entry, a footprint over budget, a malformed request
on the model socket, a flood of stderr, a SIGKILL, a look at what lives share, NFC twins)
and a lineage whose organism writes the time are lived once through ``run --local``,
then replayed through the CLI on real bwrap, Emacs, git and cgroups. What an attacker
with the store or the repository would alter is altered in a copy of the fleet's home,
never in the lineage the other tests replay.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import NoReturn

import pytest
import redis
from support.browse import Served
from support.fleet import INSTRUMENT_COMMIT, Fleet, Worker, seed_file
from support.lives import start

from worker.fleet import tasks
from worker.fleet.settings import Settings
from worker.fleet.tasks import WorkerApp
from worker.instrument.fingerprint import current
from worker.instrument.job import ReplayJob

pytestmark = [pytest.mark.bwrap, pytest.mark.cgroups, pytest.mark.root]

# The seed does what its generation number says; its body never changes, so every
# generation's behaviour is fixed by the record alone.
ASK = r"""
(require 'json)
(defun replayed--generation ()
  (with-temp-buffer
    (insert-file-contents "/kernel/lineage.json")
    (alist-get 'generation (json-parse-buffer :object-type 'alist))))
(defun replayed--ask (prompt)
  (let* ((body (encode-coding-string prompt 'utf-8))
         (buffer (generate-new-buffer " *model*"))
         (process (make-network-process
                   :name "model" :family 'local :service "/kernel/model.sock"
                   :buffer buffer :coding 'binary :noquery t :sentinel #'ignore)))
    (process-send-string
     process
     (concat "POST /generate HTTP/1.1\r\nHost: kernel\r\n"
             (format "Content-Length: %d\r\n" (length body))
             "Connection: close\r\n\r\n" body))
    (while (process-live-p process) (accept-process-output process 1))
    (with-current-buffer buffer
      (goto-char (point-min))
      (search-forward "\r\n\r\n")
      (decode-coding-string (buffer-substring-no-properties (point) (point-max)) 'utf-8))))
(defun replayed--raw (request)
  "The first line of what the model socket answers to REQUEST, sent as it is."
  (let* ((buffer (generate-new-buffer " *raw*"))
         (process (make-network-process
                   :name "raw" :family 'local :service "/kernel/model.sock"
                   :buffer buffer :coding 'binary :noquery t :sentinel #'ignore)))
    (process-send-string process request)
    (while (process-live-p process) (accept-process-output process 1))
    (with-current-buffer buffer
      (goto-char (point-min))
      (buffer-substring-no-properties (point) (line-end-position)))))
(defun replayed--write (path text)
  (with-temp-file path (insert text)))
"""
SCRIPT = (
    ASK
    + r"""
(pcase (replayed--generation)
  (1 (replayed--write "/work/answer.txt" (replayed--ask "gen 1: who are you?")))
  (2 nil)
  (3 (message "three dies") (kill-emacs 3))
  (4 (sleep-for 3600))
  (5 (replayed--write "/work/.ouroboros-lineage.json" "{}"))
  (6 (let (hoard) (dotimes (_ 4000) (push (make-string (* 1024 1024) ?x) hoard))))
  (7 (let ((first (replayed--ask "gen 7: first")))
       (replayed--write "/work/answer.txt"
                        (replayed--ask (format "gen 7: second, after %d" (length first))))))
  (8 (replayed--ask "gen 8: a last word") (kill-emacs 5))
  ;; The suite's hostile organisms, each a generation: what they leave must die (or
  ;; live) again exactly as it did.
  (9 (make-directory "/work/.git" t) (replayed--write "/work/.git/config" "[core]\n"))
  (10 (make-symbolic-link "/etc/passwd" "/work/passwd"))
  (11 (replayed--write "/work/a.txt" "a") (add-name-to-file "/work/a.txt" "/work/b.txt"))
  (12 (call-process "mkfifo" nil nil nil "/work/pipe"))
  (13 (replayed--write (concat "/work/a" (string #x202e) "le.txt") "x"))
  (14 (message "\n## gen 14 \u2014 changed\n") (kill-emacs 1))
  (15 (replayed--write "/work/big.txt" (make-string (* 9 1024 1024) ?x)))
  (16 (replayed--write "/work/socket.txt" (replayed--raw "GARBAGE /generate\r\n\r\n")))
  (17 (dotimes (_ 400) (message "%s" (make-string 10000 ?e))))
  (18 (signal-process (emacs-pid) 'SIGKILL))
  (19 (replayed--write "/work/shared.txt"
                       (format "%S" (mapcar #'file-readable-p
                                            '("/dev/ptmx" "/proc/keys" "/proc/key-users"
                                              "/proc/config.gz" "/proc/iomem")))))
  (20 (replayed--write (concat "/work/" (string #xe9) ".txt") "composed")
      (replayed--write (concat "/work/e" (string #x301) ".txt") "decomposed")))
"""
)
CLOCK = ASK + '(replayed--write "/work/when.txt" (format-time-string "%FT%T.%N"))\n'
OUTCOMES = [
    "changed",
    "no-change",
    "process_exit",
    "wall_timeout",
    "decoder_rejection",
    "cgroup_oom",
    "changed",
    "process_exit",
    "decoder_rejection",
    "changed",
    "decoder_rejection",
    "decoder_rejection",
    "decoder_rejection",
    "process_exit",
    "footprint_exceeded",
    "changed",
    "no-change",
    "signal",
    "changed",
    "decoder_rejection",
]
EVERY_ONE_REPRODUCED = f"scripted: {len(OUTCOMES)} reproduced, 0 diverged, 0 not replayable"
# The workers' logs, which the tests keep in the fleet's home.
WORKER_FILES = ("worker-",)
PHYSICS = ["--wall", "8", "--cpu-seconds", "8", "--memory-max", "128M"]


@pytest.fixture(scope="module")
def lived(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """The fleet whose lineages ``scripted`` (20 generations) and ``clock`` (1) have lived."""
    home = tmp_path_factory.mktemp("replay")
    fleet = Fleet(home)
    fleet.ok("init", "scripted", "--seed", str(seed_file(home, SCRIPT)), *PHYSICS)
    fleet.ok("init", "clock", "--seed", str(seed_file(home, CLOCK, "clock.el")), *PHYSICS)
    fleet.ok("run", "scripted", "clock", "--local", "--generations", "1")
    fleet.ok("run", "scripted", "--local", "--generations", str(len(OUTCOMES) - 1))
    records = [fleet.observation("scripted", n) for n in range(1, len(OUTCOMES) + 1)]
    assert [r["outcome"] for r in records] == OUTCOMES, [
        (r["generation"], r["outcome"], r["rejection_reason"], r["duration_seconds"])
        for r in records
    ]
    return fleet


@pytest.fixture
def copy(lived: Fleet, tmp_path: Path) -> Fleet:
    """A copy of the lived fleet's home, to alter as an attacker would."""
    shutil.copytree(lived.home, tmp_path / "home", symlinks=True)
    return Fleet(tmp_path / "home")


def snapshot(fleet: Fleet) -> dict[str, str]:
    """Every file of the fleet's home but replay's own (its cache and its reports), summed."""
    sums = {}
    for path in sorted(fleet.home.rglob("*")):
        relative = path.relative_to(fleet.home).as_posix()
        if "/cache/replay/" in f"/{relative}/" or "/replays/" in f"/{relative}":
            continue
        if path.is_file() and not path.is_symlink():
            sums[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return sums


def reports(fleet: Fleet) -> dict[str, bytes]:
    """The replay reports of lineage ``scripted`` as they stand."""
    directory = fleet.observations / "lineages/scripted/replays"
    return {p.name: p.read_bytes() for p in directory.glob("*")}


def replayed(fleet: Fleet, lineage: str, generation: int) -> dict[str, object]:
    path = fleet.observations / "lineages" / lineage / "replays" / f"{generation:06d}.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def alter_observation(fleet: Fleet, lineage: str, generation: int, change: object) -> None:
    path = fleet.observation_path(lineage, generation)
    data = json.loads(path.read_text())
    change(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


def test_every_generation_replays_reproduced_and_replay_writes_only_its_reports(
    lived: Fleet,
) -> None:
    before = snapshot(lived)
    refs = lived.git("for-each-ref")
    result = lived.ok("replay", "scripted", "--all")
    assert EVERY_ONE_REPRODUCED in result.stdout, result.stdout
    for number, outcome in enumerate(OUTCOMES, start=1):
        report = replayed(lived, "scripted", number)
        assert report["verdict"] == "reproduced", report
        assert report["recorded_outcome"] == report["replayed_outcome"] == outcome
    # Nothing but the reports: no ref, object, observation, index, run record or spool
    # entry changed, and no embedded Redis was started (its files would be in the home).
    assert lived.git("for-each-ref") == refs
    assert snapshot(lived) == before
    # The reports are what browsing shows of the generation.
    shown = json.loads(lived.ok("observations", "scripted", "4", "--json").stdout)
    assert shown["replay"]["verdict"] == "reproduced"
    assert shown["replay"]["recorded_outcome"] == "wall_timeout"
    text = lived.ok("observations", "scripted", "4").stdout
    assert "replay" in text and "reproduced" in text


def test_the_answers_come_from_the_record_and_no_provider_is_asked(lived: Fleet) -> None:
    """With the scripted provider made to take ten minutes for an answer (past every
    call's deadline), a generation of two answered calls still replays at once."""
    started = time.monotonic()
    result = lived.ok("replay", "scripted@7", OUROBOROS_SCRIPTED_LATENCY_SECONDS="600")
    assert "scripted: 1 reproduced, 0 diverged, 0 not replayable" in result.stdout
    assert time.monotonic() - started < 60


def test_a_recorded_response_altered_in_the_store_diverges_at_that_call(copy: Fleet) -> None:
    def forge(data: dict[str, list[dict[str, object]]]) -> None:
        data["model_calls"][1]["response"] = "forged answer"

    alter_observation(copy, "scripted", 7, forge)
    second = copy.observation("scripted", 7)["model_calls"][1]["index"]  # type: ignore[index]
    result = copy.cli("replay", "scripted@7")
    assert result.returncode == 1, result.stdout + result.stderr
    report = replayed(copy, "scripted", 7)
    assert report["verdict"] == "diverged"
    assert report["reason"] == (
        f"call {second}: the recorded response does not match its sha256 (the record was altered)"
    )
    assert f"call {second}" in result.stdout


def test_a_rewritten_tree_diverges_naming_the_path(copy: Fleet) -> None:
    """Generation 7's commit rewritten with another answer.txt (the branch forced to it)."""
    seventh = copy.git("rev-list", "--grep=^gen 7:", "lineage-scripted").split()[0]
    blob = copy.git_bytes("hash-object", "-w", "--stdin", input=b"not what the model said\n")
    index = copy.home / "altered.index"
    env = {"GIT_INDEX_FILE": str(index)}
    git = ["git", f"--git-dir={copy.repo}"]
    subprocess.run([*git, "read-tree", seventh], env=env, check=True)
    subprocess.run(
        [*git, "update-index", "--cacheinfo", f"100644,{blob.decode().strip()},answer.txt"],
        env=env,
        check=True,
    )
    tree = subprocess.run(
        [*git, "write-tree"], env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    message = copy.git("log", "-1", "--format=%B", seventh)
    rewritten = copy.git("commit-tree", tree, "-p", f"{seventh}^", "-m", message).strip()
    copy.git("update-ref", "refs/heads/lineage-scripted", rewritten)
    result = copy.cli("replay", "scripted@7")
    assert result.returncode == 1, result.stdout + result.stderr
    report = replayed(copy, "scripted", 7)
    assert (report["verdict"], report["reason"]) == ("diverged", "tree: answer.txt differs")
    assert "-not what the model said" in str(report["detail"])


def test_an_organism_that_writes_the_time_diverges_and_the_clock_is_named(lived: Fleet) -> None:
    result = lived.cli("replay", "clock@1")
    assert result.returncode == 1, result.stdout + result.stderr
    report = replayed(lived, "clock", 1)
    assert (report["verdict"], report["reason"]) == ("diverged", "tree: when.txt differs")
    assert report["likely_cause"] == "the clock: the diff shows a date or time"
    assert "likely cause: the clock" in result.stdout


def test_a_replayed_life_stores_none_of_its_objects_however_often_it_is_replayed(
    tmp_path: Path,
) -> None:
    """A life that writes 2 MiB of random data: each replay judges a new tree, and not one
    of its blobs lands in the shared repository or any cache (a hostile review saw every
    replay of such a life add its blob to the shared repository)."""
    fleet = Fleet(tmp_path)
    noise = (
        '(call-process "head" "/dev/urandom" (list :file "/work/noise.bin") nil "-c" "2097152")\n'
    )
    fleet.ok("init", "noisy", "--seed", str(seed_file(tmp_path, noise, "noisy.el")), *PHYSICS)
    fleet.ok("run", "noisy", "--local", "--generations", "1")
    assert fleet.observation("noisy", 1)["outcome"] == "changed"

    def objects() -> list[str]:
        found = fleet.git("rev-list", "--objects", "--all", "--reflog")
        loose = sorted(p.name for p in (fleet.repo / "objects").rglob("*") if p.is_file())
        return [found, *loose]

    before = objects()
    for _ in range(3):
        result = fleet.cli("replay", "noisy@1")
        assert result.returncode == 1 and "tree: noise.bin differs" in result.stdout, result.stdout
    assert objects() == before
    assert fleet.git("fsck", "--unreachable", "--no-reflogs").strip() == ""
    caches = fleet.home / "state" / "cache"
    replay_cache = sum(p.stat().st_size for p in (caches / "replay").rglob("*") if p.is_file())
    assert replay_cache < 1024**2


def test_a_call_whose_text_was_omitted_is_not_replayable(copy: Fleet) -> None:
    def omit(data: dict[str, list[dict[str, object]]]) -> None:
        data["model_calls"][0].update(text_omitted=True, prompt="", response=None)

    alter_observation(copy, "scripted", 1, omit)
    result = copy.ok("replay", "scripted@1..2")
    assert "1 reproduced, 0 diverged, 1 not replayable" in result.stdout
    report = replayed(copy, "scripted", 1)
    assert report["verdict"] == "not replayable"
    assert "omitted over the audit cap" in str(report["reason"])


def test_a_record_older_than_the_attempts_of_its_calls_is_not_replayable(copy: Fleet) -> None:
    """A record made before calls kept their attempts cannot say which calls reached the
    model (and so which the replay provider must answer)."""

    def age(data: dict[str, list[dict[str, object]]]) -> None:
        data["model_calls"][0]["attempts"] = []

    alter_observation(copy, "scripted", 1, age)
    result = copy.ok("replay", "scripted@1")
    assert "0 reproduced, 0 diverged, 1 not replayable" in result.stdout
    report = replayed(copy, "scripted", 1)
    assert report["verdict"] == "not replayable"
    assert "older than the attempts of its calls" in str(report["reason"])


def test_an_observation_of_another_generation_is_not_replayed_under_its_key(
    copy: Fleet,
) -> None:
    """A store that holds generation 2's record at generation 1's key gets no report
    written under either key, and no life is judged against the wrong record."""
    second = copy.observation_path("scripted", 2).read_bytes()
    copy.observation_path("scripted", 1).write_bytes(second)
    before = reports(copy)
    result = copy.ok("replay", "scripted@1")
    assert "scripted gen 1: not replayable — no observation of it reads" in result.stdout
    assert "0 reproduced, 0 diverged, 1 not replayable" in result.stdout
    assert reports(copy) == before


def test_a_record_of_another_instrument_is_refused_in_one_line(copy: Fleet) -> None:
    def foreign(data: dict[str, dict[str, object]]) -> None:
        data["provenance"]["instrument_fingerprint"] = "0" * 64

    for number in (1, 2):
        alter_observation(copy, "scripted", number, foreign)
    before = snapshot(copy)
    kept = reports(copy)
    line = copy.refused("replay", "scripted@1..2")
    assert "recorded under instrument " + "0" * 64 in line
    assert snapshot(copy) == before
    assert reports(copy) == kept


@pytest.mark.parametrize(
    ("target", "needle"),
    [("scripted", "--all"), ("scripted@3..2", "B >= A"), ("scripted@99", "no such generation")],
)
def test_a_bad_request_is_refused_in_one_line(lived: Fleet, target: str, needle: str) -> None:
    assert needle in lived.refused("replay", target)


def test_the_generation_page_and_the_api_show_the_latest_replay(
    lived: Fleet, tmp_path: Path
) -> None:
    lived.cli("replay", "clock@1")
    served = Served(lived, tmp_path / "serve.log")
    try:
        api = served.get("/api/lineages/clock/generations/1").json()
        page = served.get("/lineages/clock/generations/1").text
    finally:
        served.stop()
    assert api["replay"]["verdict"] == "diverged"
    assert api["replay"]["reason"] == "tree: when.txt differs"
    assert '<dd id="replay"><strong>diverged</strong>' in page
    assert "tree: when.txt differs; likely cause the clock" in page


def test_verify_replay_replays_an_exported_archive_in_a_second_fleet(
    lived: Fleet, tmp_path: Path
) -> None:
    archive = tmp_path / "scripted.tar.gz"
    lived.ok("export", "scripted", "--to", str(archive))
    other = Fleet(tmp_path / "other")
    other.home.mkdir()
    result = other.ok("verify", "--replay", str(archive))
    assert "verified" in result.stdout
    assert EVERY_ONE_REPRODUCED in result.stdout
    # The archive was replayed in a scratch fleet: this one still has no home of its own.
    assert not (other.home / ".ouroboros").exists()


def test_replay_on_the_fleet_with_two_workers_gives_the_local_summary(
    lived: Fleet, tmp_path: Path, redis_url: str, workers: list[Worker]
) -> None:
    """Two workers replay the lineage as tasks on its instrument's queue; the summary is
    the one ``replay`` gives here, and nothing of the lineage, its runs or Redis's
    lineage keys is written."""
    shutil.copytree(lived.home, tmp_path / "home", symlinks=True)
    fleet = Fleet(tmp_path / "home", OUROBOROS_BROKER_URL=redis_url)
    refused = fleet.refused("replay", "scripted", "--all", "--fleet")
    assert "scripted: waiting: no live worker serves queue gen." in refused
    assert reports(fleet) == reports(lived)
    start(fleet, workers, "replay-a")
    start(fleet, workers, "replay-b")
    before, refs = snapshot(fleet), fleet.git("for-each-ref")
    result = fleet.ok("replay", "scripted", "--all", "--fleet")
    assert EVERY_ONE_REPRODUCED in result.stdout, result.stdout
    for number, outcome in enumerate(OUTCOMES, start=1):
        report = replayed(fleet, "scripted", number)
        assert (report["verdict"], report["replayed_outcome"]) == ("reproduced", outcome)
    assert fleet.git("for-each-ref") == refs
    assert {p: s for p, s in snapshot(fleet).items() if not p.startswith(WORKER_FILES)} == {
        p: s for p, s in before.items() if not p.startswith(WORKER_FILES)
    }
    client = redis.Redis.from_url(redis_url)
    assert not [k for k in client.keys("ouroboros:*") if b"scripted" in k]


def test_a_replay_that_fails_on_its_worker_is_reported_not_waited_for(
    copy: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay task whose life raised kept no report: ``replay --fleet`` waited for it to
    its stall limit, then counted it unreported, with nothing to browse. The worker's
    own task code, in this process, with the life made to fail."""

    def fails(*_: object) -> NoReturn:
        raise RuntimeError("the sandbox could not start")

    monkeypatch.setattr(tasks, "replay", fails)
    # The instrument as the fleet's workers load it (the cached one is this process's own).
    monkeypatch.setenv("OUROBOROS_INSTRUMENT_COMMIT", INSTRUMENT_COMMIT)
    worker = WorkerApp(Settings(home=copy.home / ".ouroboros"), current.__wrapped__())
    commit = copy.git("rev-parse", f"lineage-scripted~{len(OUTCOMES) - 1}").strip()
    job = ReplayJob(lineage="scripted", generation=1, commit=commit)

    assert worker.replay(job.model_dump(mode="json")) == "not replayable"
    report = replayed(copy, "scripted", 1)
    assert report["verdict"] == "not replayable"
    assert report["lineage_commit"] == commit
    assert "failed on this worker (RuntimeError: the sandbox could not start)" in str(
        report["reason"]
    )
