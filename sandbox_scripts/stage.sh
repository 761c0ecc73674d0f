#!/bin/sh
# The staging runner: the first and last thing that runs inside the sandbox.
#
# Owns one life's /work: unpacks the committed tree from /kernel/base.tar, runs the
# organism in it, and, only if the organism exits 0, writes the resulting /work as a
# tar to stdout. Its exit status is the organism's (a shell reports a death by signal
# N as 128+N), 70 when the committed tree cannot be unpacked, or tar's when packing fails.
#
# Trusts nothing it runs: the organism's stdout is sent to stderr so that it cannot
# mix with the tar stream, but the worker still treats stdout as untrusted bytes,
# bounded and judged by its decoder.
#
# Usage: sh /kernel/stage.sh /path/to/real/emacs
set -u
emacs=$1

cd /work || exit 70
# The sandbox has no capabilities, so ownership cannot be restored (and must not be).
tar -x --no-same-owner -f /kernel/base.tar -C /work || {
    echo "stage: cannot unpack /kernel/base.tar" >&2
    exit 70
}

"$emacs" -Q --batch -l /work/organism.el </dev/null >&2
status=$?
if [ "$status" -ne 0 ]; then
    exit "$status"
fi

# Sorted names and a fixed format keep the archive independent of directory order.
exec tar -C /work --sort=name --format=gnu -cf - .
