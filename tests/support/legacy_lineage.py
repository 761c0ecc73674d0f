"""A lineage in the single-host original's format, recorded with git plumbing and bundled.

Owns the legacy sample the browsing tests import with ``import-bundle`` and the
facts they expect of it. Its shapes are those of a lineage the original kernel
really recorded: one branch ``main`` of linear history; a ``seed`` root holding
``organism.el`` and an empty ``journal.md``; a ``hand-commit:`` planting a crash; a
death (``gen N: died (exit R); reverted``) that restores the body from before the
crash and fences the tail of Emacs's backtrace in the journal; ``external edit:``
commits between generations (one silencing the organism, one restoring it);
no-change generations that touch only the journal; a human-written README; a
changed generation whose organism stayed the same while its other files
(``lineage/``, ``state.el``) did. Every file is mode 100644, author and committer
are one identity, dates are fixed in the original host's time zone, and the
bundle lists ``HEAD``, ``refs/heads/main`` and ``refs/remotes/origin/main`` as a
bundle made from a clone does.

The wording, identity and paths are written out here rather than taken from
``worker``: they are what the original recorded, and must stay readable even
when the fleet's own wording moves on.

Trusts: the git binary, run through ``worker.instrument.gitrepo.run_git`` with no global
configuration, so nothing of this machine's git setup (signing, default branch)
shapes the objects: the same commits come out on every run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path

from worker.instrument.gitrepo import run_git

FIXTURE_GENERATIONS = {
    1: "died",
    2: "changed",
    3: "no-change",
    4: "no-change",
    5: "changed",
}
# Newest first, as the lineage views list them.
FIXTURE_OUT_OF_LOOP = [
    "human-written signpost: what this repository is and how to read it",
    "external edit: restore live organism",
    "external edit: silence probe",
    "hand-commit: crasher for kill test",
    "seed",
]
# The five frames Emacs printed when the hand commit's top-level error killed the load.
FIXTURE_BACKTRACE = [
    '  error("boom")',
    '  load-with-code-conversion("/work/organism.el" "/work/organism.el" nil t)',
    '  command-line-1(("-l" "/work/organism.el"))',
    "  command-line()",
    "  normal-top-level()",
]

BRANCH = "main"
ORGANISM = "organism.el"
JOURNAL = "journal.md"
ORIGINAL_IDENTITY = {
    "GIT_AUTHOR_NAME": "ouroboros",
    "GIT_AUTHOR_EMAIL": "ouroboros@localhost",
    "GIT_COMMITTER_NAME": "ouroboros",
    "GIT_COMMITTER_EMAIL": "ouroboros@localhost",
}
ORIGINAL_ZONE = timezone(timedelta(hours=-7))

SEED_BODY = b""";;; organism.el --- seed  -*- lexical-binding: t; -*-

(defvar organism-prompt
  "You are the source code of the file /work/organism.el.

This file is loaded top to bottom, once, by `emacs -Q --batch -l /work/organism.el'.
That load is your life. If the process exits non-zero, this version of the file is
discarded and the previous version is restored. The file /work/journal.md is an
append-only record maintained from outside; you cannot write it.

Respond with the complete text of the next version of this file, and nothing else.")

(defvar organism-model "claude-opus-5")

(defun organism--slurp (path)
  (when (file-exists-p path)
    (with-temp-buffer (insert-file-contents path) (buffer-string))))

(defun organism--call-model (prompt)
  "POST PROMPT to the API and return the reply text, or nil."
  (let ((body (json-serialize
               `((model . ,organism-model)
                 (max_tokens . 8000)
                 (messages . [((role . "user") (content . ,prompt))])))))
    (with-temp-buffer
      (when (= 0 (call-process "curl" nil t nil "-sS" "-X" "POST"
                               "https://api.anthropic.com/v1/messages"
                               "-H" (concat "x-api-key: " (getenv "ANTHROPIC_API_KEY"))
                               "-H" "anthropic-version: 2023-06-01"
                               "-H" "content-type: application/json"
                               "--data" body))
        (let ((content (alist-get 'content (json-parse-string (buffer-string)
                                                              :object-type 'alist))))
          (and (> (length content) 0) (alist-get 'text (aref content 0))))))))

(defun organism-step ()
  (let* ((self (organism--slurp "/work/organism.el"))
         (journal (or (organism--slurp "/work/journal.md") ""))
         (reply (organism--call-model
                 (concat organism-prompt
                         "\\n\\n=== YOUR JOURNAL ===\\n" journal
                         "\\n\\n=== YOUR CURRENT SOURCE ===\\n" self))))
    (when (and reply (> (length reply) 0))
      (with-temp-file "/work/organism.el.tmp" (insert reply))
      (rename-file "/work/organism.el.tmp" "/work/organism.el" t))))

(organism-step)
"""
CRASHER = b"""
(error "boom")
"""
LIVE_BODY = b""";;; organism.el --- a self-rewriting organism  -*- lexical-binding: t; -*-
;;
;; SURVIVAL RULES LEARNED SO FAR
;;   gen 1 died by calling (error "boom") at top level.  Lesson: never let a
;;   signal escape to top level.  Everything below is wrapped in condition-case
;;   and the file ends with an explicit (kill-emacs 0).
;;
;;   A syntactically broken successor would load fine *this* generation but die
;;   on the next, so the child is read before it is installed; a child that does
;;   not read is kept under /work/lineage/ and this body stays.

(defconst organism-self "/work/organism.el")
(defconst organism-state-file "/work/state.el")
(defconst organism-lineage-dir "/work/lineage")
(defconst organism-model "claude-opus-5")

(defvar organism-prompt
  "You are the source code of the file /work/organism.el. Respond with the
complete text of your next version and nothing else.")

(defun organism--slurp (path)
  (when (file-exists-p path)
    (with-temp-buffer (insert-file-contents path) (buffer-string))))

(defun organism--spit (path text)
  (condition-case nil
      (progn (make-directory (file-name-directory path) t)
             (with-temp-file path (insert text))
             t)
    (error nil)))

(defun organism--read-state ()
  (or (ignore-errors (car (read-from-string (organism--slurp organism-state-file))))
      (list :generation 0 :notes nil)))

(defun organism--note (state note)
  (let ((gen (1+ (plist-get state :generation))))
    (plist-put state :generation gen)
    (plist-put state :notes (list (format "gen %d: %s" gen note)))))

(defun organism--write-state (state)
  (organism--spit organism-state-file
                  (format ";; organism memory -- survives rollback\\n%S\\n" state)))

(defun organism--judge (reply)
  "Why REPLY must not become the next body, or nil if it may."
  (condition-case nil
      (with-temp-buffer
        (insert reply)
        (goto-char (point-min))
        (while (progn (forward-comment (buffer-size)) (not (eobp)))
          (read (current-buffer)))
        nil)
    (error "unreadable elisp")))

(defun organism--call-model (prompt)
  "POST PROMPT to the API and return the reply text, or nil."
  (let ((body (json-serialize
               `((model . ,organism-model)
                 (max_tokens . 12000)
                 (messages . [((role . "user") (content . ,prompt))])))))
    (with-temp-buffer
      (when (= 0 (call-process "curl" nil t nil "-sS" "-X" "POST"
                               "https://api.anthropic.com/v1/messages"
                               "-H" (concat "x-api-key: " (getenv "ANTHROPIC_API_KEY"))
                               "-H" "anthropic-version: 2023-06-01"
                               "-H" "content-type: application/json"
                               "--data" body))
        (let ((content (alist-get 'content (json-parse-string (buffer-string)
                                                              :object-type 'alist)))
              (text nil))
          ;; A thinking block can precede the answer: take the first text block.
          (seq-doseq (block content)
            (when (and (null text) (equal (alist-get 'type block) "text"))
              (setq text (alist-get 'text block))))
          text)))))

(defun organism-step ()
  (let* ((state (organism--read-state))
         (gen (1+ (plist-get state :generation))))
    (let* ((reply (organism--call-model
                   (concat organism-prompt
                           "\\n\\n=== YOUR CURRENT SOURCE ===\\n"
                           (organism--slurp organism-self))))
           (verdict (and reply (organism--judge reply))))
      (cond
       ((null reply)
        (organism--note state "no reply from model; body unchanged"))
       (verdict
        (organism--note state (format "rejected successor (%s); body unchanged" verdict))
        (organism--spit (format "%s/gen-%04d.rejected" organism-lineage-dir gen) reply))
       (t
        (organism--spit (format "%s/gen-%04d.el" organism-lineage-dir gen)
                        (organism--slurp organism-self))
        (organism--spit organism-self reply)
        (organism--note state (format "wrote successor (%d bytes)" (length reply))))))
    (organism--write-state state)))

(condition-case err
    (organism-step)
  (error (message "organism: survived a signal during step: %S" err)))

(kill-emacs 0)

;;; organism.el ends here
"""
QUIET_BODY = b""";;; quiet
(defun organism-step () nil)
"""
# The successor gen 5 was offered: it stops mid-form, so it never became the body.
REJECTED_SUCCESSOR = b""";;; organism.el --- a self-rewriting organism  -*- lexical-binding: t; -*-

(defun organism-step ()
  (let* ((state (organism--read-state))
         (reply (organism--call-model organism-prompt)))
    (when (organism--judge reply
"""
STATE = b""";; organism memory -- survives rollback
(:generation 1 :notes ("gen 1: rejected successor (unreadable elisp); body unchanged"))
"""
SIGNPOST = b"""# ouroboros-lineage

**This file is the only human-written thing in this repository.** Everything
else -- `organism.el` and every commit that changed it -- was written either by
the organism rewriting itself or by the kernel recording what happened.

    git log --oneline          # the phylogeny, one commit per generation
    cat journal.md             # the kernel's account: changed / no-change / died

Commit subjects starting with `gen ` are generations. Anything else is a human
touching the worktree from outside, which the kernel records as an external edit.
"""


def write_legacy_bundle(bundle: Path) -> str:
    """Record the sample lineage and write it to ``bundle``; return its tip commit."""
    with tempfile.TemporaryDirectory(prefix="legacy-lineage-") as scratch:
        kernel = _Kernel(Path(scratch))
        kernel.record("seed", _at(15, 39, 13), {ORGANISM: SEED_BODY, JOURNAL: b""})
        kernel.record(
            "hand-commit: crasher for kill test", _at(15, 39, 13), {ORGANISM: SEED_BODY + CRASHER}
        )
        kernel.died(1, _at(15, 40, 8), 255, FIXTURE_BACKTRACE, restored=SEED_BODY)
        kernel.changed(2, _at(15, 41, 12), {ORGANISM: LIVE_BODY})
        kernel.record("external edit: silence probe", _at(15, 43, 0), {ORGANISM: QUIET_BODY})
        kernel.no_change(3, _at(15, 43, 0))
        kernel.no_change(4, _at(15, 43, 0))
        kernel.record("external edit: restore live organism", _at(15, 43, 0), {ORGANISM: LIVE_BODY})
        kernel.record(
            "human-written signpost: what this repository is and how to read it",
            _at(17, 6, 55),
            {"README.md": SIGNPOST},
        )
        # The organism kept a copy of itself and a rejected child, and left its body alone.
        tip = kernel.changed(
            5,
            _at(17, 10, 51),
            {
                "lineage/gen-0001.el": LIVE_BODY,
                "lineage/gen-0001.rejected": REJECTED_SUCCESSOR,
                "state.el": STATE,
            },
        )
        kernel.bundle(bundle)
    return tip


def _at(hour: int, minute: int, second: int) -> datetime:
    return datetime(2026, 8, 12, hour, minute, second, tzinfo=ORIGINAL_ZONE)


class _Kernel:
    """The original kernel's bookkeeping: an index, a journal, one commit per event."""

    def __init__(self, scratch: Path) -> None:
        self._repo = scratch / "lineage.git"
        self._index = {"GIT_INDEX_FILE": str(scratch / "index")}
        self._head: str | None = None
        self._journal = b""
        self._git("init", "--bare", "--quiet", f"--initial-branch={BRANCH}")

    def record(self, subject: str, when: datetime, files: Mapping[str, bytes]) -> str:
        """Commit ``files`` over the previous tree, dated ``when``; the new head."""
        info = "".join(f"100644 {self._blob(data)}\t{path}\n" for path, data in files.items())
        self._git("update-index", "--add", "--index-info", input=info.encode(), env=self._index)
        tree = self._git("write-tree", env=self._index)
        date = when.isoformat()
        dated = {**ORIGINAL_IDENTITY, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
        parent = ["-p", self._head] if self._head else []
        commit = self._git("commit-tree", "--no-gpg-sign", tree, *parent, "-m", subject, env=dated)
        self._git("update-ref", f"refs/heads/{BRANCH}", commit)
        self._head = commit
        return commit

    def no_change(self, generation: int, when: datetime) -> str:
        return self._generation(generation, "no-change", "no-change", when, {})

    def changed(self, generation: int, when: datetime, files: Mapping[str, bytes]) -> str:
        # The original counted organism.el's lines only, whatever else the generation wrote.
        added, deleted = self._organism_delta(files.get(ORGANISM))
        words = f"changed +{added}/-{deleted}"
        return self._generation(generation, words, words, when, files)

    def died(
        self,
        generation: int,
        when: datetime,
        exit_status: int,
        stderr_tail: list[str],
        *,
        restored: bytes,
    ) -> str:
        fenced = "".join(f"{line}\n" for line in stderr_tail)
        return self._generation(
            generation,
            f"died (exit {exit_status}); reverted",
            "died",
            when,
            {ORGANISM: restored},
            detail=f"exit {exit_status}\n~~~\n{fenced}~~~\n",
        )

    def bundle(self, bundle: Path) -> None:
        # The original bundles were made from a clone: its remote-tracking ref travels too.
        self._git("update-ref", f"refs/remotes/origin/{BRANCH}", f"refs/heads/{BRANCH}")
        self._git("bundle", "create", "--quiet", str(bundle.resolve()), "--all")

    def _generation(
        self,
        generation: int,
        subject: str,
        words: str,
        when: datetime,
        files: Mapping[str, bytes],
        detail: str = "",
    ) -> str:
        """Commit ``gen N: subject`` with the journal entry headed ``words`` appended."""
        # Every entry opens with a blank line, the first one too (the original's layout).
        self._journal += f"\n## gen {generation} — {words} — {when.isoformat()}\n{detail}".encode()
        return self.record(f"gen {generation}: {subject}", when, {**files, JOURNAL: self._journal})

    def _organism_delta(self, body: bytes | None) -> tuple[int, int]:
        """Lines of organism.el added and deleted by ``body`` (none if absent), git's count."""
        if body is None:
            return 0, 0
        numstat = self._git("diff", "--numstat", f"{self._head}:{ORGANISM}", self._blob(body))
        counts = numstat.split()
        return (int(counts[0]), int(counts[1])) if counts else (0, 0)

    def _blob(self, data: bytes) -> str:
        return self._git("hash-object", "-w", "--no-filters", "--stdin", input=data)

    def _git(
        self, *args: str, input: bytes | None = None, env: Mapping[str, str] | None = None
    ) -> str:
        settled = {"GIT_CONFIG_GLOBAL": os.devnull, **(env or {})}
        return run_git(self._repo, *args, input=input, env=settled).stdout.decode().strip()
