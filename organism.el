;;; organism.el --- seed  -*- lexical-binding: t; -*-

(defvar organism-prompt
  "You are the source code of the file /work/organism.el.

This file is loaded top to bottom, once, by `emacs -Q --script /work/organism.el'.
That load is your life. If the process exits non-zero, nothing you wrote survives
and the previous version of this file is restored. Whatever /work contains when
the process exits zero becomes the next generation.

The directory /work is yours to inspect and use. /kernel is read-only and owned by
the kernel: /kernel/journal.md is the kernel's record of your lineage, and
/kernel/capabilities.json describes what you may do and the limits you live under.
You can ask a language model for text by POSTing a prompt to /generate on the Unix
socket /kernel/model.sock; each call costs part of a fixed budget. Each answer says
how the model stopped in its X-Ouroboros-Stop-Reason header: only `complete' means
the answer is whole (the others are max_tokens, refused and incomplete).

You will receive your current source below. Respond with the complete text of the
next version of this file, and nothing else: no explanation, no code fences.
Your reply becomes the file verbatim.")

(defvar organism-max-output-tokens 8000)

(defun organism--slurp (path)
  (when (file-readable-p path)
    (with-temp-buffer
      (insert-file-contents path)
      (buffer-string))))

(defun organism--limit (name default)
  "The constraint NAME from the capability manifest, or DEFAULT."
  (let* ((text (organism--slurp "/kernel/capabilities.json"))
         (caps (and text (json-parse-string text :object-type 'alist)))
         (limits (alist-get 'constraints caps)))
    (or (alist-get name limits) default)))

(defun organism--generate (prompt max-tokens)
  "POST PROMPT to the kernel's model socket; return (TEXT . STOP) or signal an error.
STOP is how the model stopped, from the X-Ouroboros-Stop-Reason header:
\"complete\", \"max_tokens\", \"refused\" or \"incomplete\" (nil if absent)."
  (let* ((body (encode-coding-string prompt 'utf-8))
         (buffer (generate-new-buffer " *model*"))
         (process nil))
    (with-current-buffer buffer (set-buffer-multibyte nil))
    (unwind-protect
        (progn
          (setq process (make-network-process
                         :name "model" :family 'local :service "/kernel/model.sock"
                         :buffer buffer :coding 'binary :noquery t
                         ;; The default sentinel would append a status line to the reply.
                         :sentinel #'ignore))
          (process-send-string
           process
           (concat "POST /generate HTTP/1.1\r\nHost: kernel\r\n"
                   "Content-Type: text/plain; charset=utf-8\r\n"
                   (format "Content-Length: %d\r\n" (length body))
                   (format "X-Ouroboros-Max-Output-Tokens: %d\r\n" max-tokens)
                   "Connection: close\r\n\r\n"))
          (process-send-string process body)
          (while (process-live-p process)
            (accept-process-output process 1))
          (with-current-buffer buffer
            (goto-char (point-min))
            (unless (looking-at "HTTP/1\\.[01] \\([0-9]+\\)")
              (error "model socket: malformed reply"))
            (let* ((status (string-to-number (match-string 1)))
                   (head-end (search-forward "\r\n\r\n"))
                   (stop (progn
                           (goto-char (point-min))
                           (let ((case-fold-search t))
                             (and (re-search-forward
                                   "^X-Ouroboros-Stop-Reason: *\\([a-z_]+\\)" head-end t)
                                  (match-string 1)))))
                   (text (decode-coding-string
                          (buffer-substring-no-properties head-end (point-max)) 'utf-8)))
              (if (= status 200)
                  (cons text stop)
                (error "model socket: HTTP %d: %s" status text)))))
      (when process (delete-process process))
      (kill-buffer buffer))))

(defun organism--prompt ()
  "The prompt: instructions, the journal's tail and the current source, within limits."
  (let* ((self (or (organism--slurp "/work/organism.el") ""))
         (journal (or (organism--slurp "/kernel/journal.md") ""))
         (budget (- (organism--limit 'max_prompt_bytes 196608)
                    (string-bytes organism-prompt) (string-bytes self) 200)))
    (when (> (string-bytes journal) (max budget 0))
      (setq journal (substring journal (max 0 (- (length journal) (max budget 0))))))
    (concat organism-prompt
            "\n\n=== YOUR JOURNAL ===\n" journal
            "\n\n=== YOUR CURRENT SOURCE ===\n" self)))

(defun organism-step ()
  (let* ((tokens (min organism-max-output-tokens
                      (organism--limit 'max_output_tokens organism-max-output-tokens)))
         (answer (organism--generate (organism--prompt) tokens))
         (reply (car answer))
         (stop (cdr answer)))
    ;; A cut, refused or unfinished answer is not a body: it would not even load.
    (cond ((not (equal stop "complete"))
           (message "organism: the model stopped (%s); this body lives on" stop))
          ((> (length reply) 0)
           (with-temp-file "/work/organism.el.tmp"
             (set-buffer-file-coding-system 'utf-8-unix)
             (insert reply))
           (rename-file "/work/organism.el.tmp" "/work/organism.el" t)))))

;; A failed model call leaves the body as it is: a quiet no-change, not a death.
(condition-case err
    (organism-step)
  (error (message "organism: %s" (error-message-string err))))
