#!/bin/sh
# The staging runner: the first and last thing that runs inside the sandbox.
#
# Owns one life's /work: unpacks the committed tree from /kernel/base.tar, runs the
# organism in it, and, only if the organism exits 0, writes the resulting /work as a
# tar to stdout. Its exit status is the organism's (a shell reports a death by signal
# N as 128+N), 70 when the committed tree cannot be unpacked, or tar's when packing fails.
#
# Trusts nothing it runs. Its stdout is the result stream, which the organism must
# never reach:
# - the organism's stdout goes to stderr, so it cannot mix with the tar;
# - this shell is pid 1 of the sandbox and runs from /kernel/sh, a copy of the host's
#   shell that the sandbox may execute but not read, which makes the kernel mark it
#   non-dumpable: the organism (same uid, no capability) cannot open /proc/1/fd/1;
# - every organism process is dead before tar, the one process that holds the stream
#   and could be opened, starts.
# The worker still treats stdout as untrusted bytes, bounded and judged by its decoder.
#
# Usage: /kernel/sh /kernel/stage.sh /path/to/real/emacs
set -u
emacs=$1

cd /work || exit 70
# The sandbox has no capabilities, so ownership cannot be restored (and must not be).
tar -x --no-same-owner -f /kernel/base.tar -C /work </dev/null >&2 || {
    echo "stage: cannot unpack /kernel/base.tar" >&2
    exit 70
}

# Exactly /work/organism.el, never a shadow: `-l` would search suffixes first, so an
# organism.el.elc, organism.el.el or organism.el.el.gz the organism left would be loaded
# instead, for good, since a rollback restores organism.el only. `--script` is batch mode
# loading the file with `load`'s NOSUFFIX (`-scriptload`); errors, exit statuses and
# backtraces are those of `-l` (the backtrace names `-scriptload` for `-l`).
"$emacs" -Q --script /work/organism.el </dev/null >&2
status=$?

# As pid 1, kill -1 reaches every other process in the sandbox at once (the kernel does
# not let a fork slip past it). Then wait until none is left that could still run: a
# killed process finishes its system call (and its queued I/O) before it is gone.
while :; do
    kill -KILL -1 2>/dev/null
    alive=
    for stat in /proc/[0-9]*/stat; do
        [ "$stat" = /proc/1/stat ] && continue
        line=
        read -r line <"$stat" 2>/dev/null || continue
        # The state follows the last ") ": the command name before it is the organism's.
        state=${line##*) }
        case ${state%% *} in
            Z | X | '') ;;
            *) alive=1 ;;
        esac
    done
    [ -z "$alive" ] && break
done

if [ "$status" -ne 0 ]; then
    exit "$status"
fi

# Sorted names and a fixed format keep the archive independent of directory order.
exec tar -C /work --sort=name --format=gnu -cf - .
