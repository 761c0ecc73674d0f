"""One sandbox life lived by an unprivileged worker: run as a script, never imported by tests.

The test that starts it has already put this process in cgroup v1 directories delegated
to its uid (as a systemd ``Delegate=yes`` service or a container gets them) and dropped
it to that uid. It reads a JSON job on stdin (kernel files and physics), lives the life
exactly as the pipeline does (identity from the pool, kernel directory, scope, bwrap)
and prints a JSON account of it on stdout.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import tarfile

from worker.instrument.ceilings import select_ceiling
from worker.instrument.identity import IdentityPool
from worker.instrument.physics import Physics
from worker.instrument.sandbox import kernel_directory, resolve_emacs, run_sandbox


def main() -> None:
    job = json.load(sys.stdin)
    files = {name: base64.b64decode(data) for name, data in job["files"].items()}
    pool = IdentityPool(job["uid_base"], job["uid_count"])
    probed = pool.probe()
    ceiling = select_ceiling("cgroup1")
    with pool.hold() as identity, kernel_directory(files, identity) as kernel:
        result = run_sandbox(
            kernel, Physics(**job["physics"]), ceiling, "unprivileged", resolve_emacs(), identity
        )
    published: dict[str, str] = {}
    if result.archive is not None:
        with tarfile.open(fileobj=io.BytesIO(result.archive)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    published[member.name.removeprefix("./")] = base64.b64encode(data).decode()
    json.dump(
        {
            "probed": probed.describe(),
            "identity": [identity.uid, identity.gid, identity.drop],
            "death": result.death(),
            "archive": base64.b64encode(result.archive or b"").decode(),
            "files": published,
            "stderr": result.stderr.decode("utf-8", errors="replace"),
            "driver": result.figures.driver,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
