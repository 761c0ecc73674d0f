"""How a life ends, as the sandbox would report it, built by hand: for the tests that
judge an ending without living it (``test_sandbox``'s classification, the pipeline seam).

``ended`` is a life that ended without a result archive (the sandbox keeps none of a
death); ``published`` is one that ended well and left ``files`` in /work, packed as the
stage packs them (``archive``).
"""

from __future__ import annotations

import io
import tarfile

from worker.instrument.ceilings.base import Figures
from worker.instrument.sandbox import SandboxResult


def figures(result: str = "exited", oom_kills: int = 0) -> Figures:
    """What a ceiling driver reports of a life: ``result`` and its OOM kills."""
    return Figures(
        driver="cgroup2",
        result=result,
        cpu_usage_nsec=1_000_000,
        memory_peak_bytes=1 << 20,
        oom_kills=oom_kills,
        sources={},
    )


def ended(
    exit_status: int | None = 0,
    signal: int | None = None,
    *,
    wall_timeout: bool = False,
    overflow: bool = False,
    result: str = "exited",
    oom_kills: int = 0,
    stderr: bytes = b"",
) -> SandboxResult:
    """A life that ended without an archive for the pipeline."""
    return SandboxResult(
        exit_status=exit_status,
        signal=signal,
        wall_timeout=wall_timeout,
        archive=None,
        archive_bytes=0,
        archive_overflow=overflow,
        stderr=stderr,
        stderr_tail=stderr,
        figures=figures(result, oom_kills),
        duration_seconds=0.01,
    )


def archive(files: dict[str, bytes]) -> bytes:
    """A result archive as the stage writes one: ``tar -C /work --format=gnu -cf - .``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        root = tarfile.TarInfo(".")
        root.type, root.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(root)
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(f"./{path}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def published(files: dict[str, bytes]) -> SandboxResult:
    """A life that ended well and left ``files`` in /work."""
    data = archive(files)
    return ended().model_copy(update={"archive": data, "archive_bytes": len(data)})
