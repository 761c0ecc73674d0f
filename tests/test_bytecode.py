"""The code run is the code fingerprinted: bytecode only from the private, checked cache.

Each test runs a fresh interpreter over a copy of the package (``copy_instrument``),
so it can plant, edit and misconfigure freely: a pyc planted beside a source is never
run, an edited source is never run from older bytecode (whatever its size and
timestamps), the cache holds checked hash-based pycs only, and a cache others could
write to, or an interpreter that skips the checks, is refused with exit status 2.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.fleet import copy_instrument

from worker.instrument.fingerprint import PACKAGE_ROOT

# Full tier: each check runs an interpreter of its own.
pytestmark = pytest.mark.full

CACHED = """
import sys
import worker.instrument.names as names
from worker.instrument.fingerprint import current
current()
print(sys.pycache_prefix)
print(getattr(names, "PLANTED", False))
for name, module in sorted(sys.modules.items()):
    if name.startswith("worker.instrument"):
        print(module.__file__, module.__cached__)
"""


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    return copy_instrument(PACKAGE_ROOT, tmp_path / "instrument")


def python(copy: Path, code: str, *options: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy), "HOME": str(copy.parent / "home")}
    return subprocess.run(
        [sys.executable, *options, "-c", code],
        env={**base, **env},
        cwd=copy.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def pycs(root: Path) -> list[Path]:
    return sorted(root.rglob("*.pyc"))


def test_the_instrument_runs_from_checked_pycs_in_a_private_cache(copy: Path) -> None:
    cache = copy.parent / "cache"
    done = python(copy, CACHED, PYTHONPYCACHEPREFIX=str(cache))
    assert done.returncode == 0, done.stderr
    prefix, planted, *modules = done.stdout.splitlines()
    assert prefix == str(cache) and planted == "False"
    assert len(modules) > 15
    for line in modules:
        source, cached = line.split()
        assert Path(cached).is_relative_to(cache), line
        header = Path(cached).read_bytes()[:16]
        # PEP 552: flags 0b11 (hash-based, checked), then the hash of exactly these bytes.
        assert header[4:8] == (0b11).to_bytes(4, "little"), line
        assert header[8:16] == importlib.util.source_hash(Path(source).read_bytes()), line
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert not pycs(copy), "no bytecode beside the sources"


def test_the_default_cache_is_in_the_users_home(copy: Path) -> None:
    done = python(copy, CACHED)
    assert done.returncode == 0, done.stderr
    cache = copy.parent / "home" / ".cache" / "ouroboros-fleet" / "pycache"
    assert done.stdout.splitlines()[0] == str(cache)
    assert len(pycs(cache)) > 15
    # Only the package's own __init__ runs before it can choose the cache (the
    # launchers name the cache in PYTHONPYCACHEPREFIX so that it goes there too).
    assert [p.relative_to(copy) for p in pycs(copy)] == [
        Path("worker", "__pycache__", f"__init__.{sys.implementation.cache_tag}.pyc")
    ]


def test_a_pyc_planted_beside_the_source_is_never_run(copy: Path) -> None:
    source = copy / "worker" / "instrument" / "names.py"
    planted = copy.parent / "planted.py"
    planted.write_bytes(source.read_bytes() + b"\nPLANTED = True\n")
    # An unchecked hash-based pyc is run without looking at the source at all.
    py_compile.compile(
        str(planted),
        cfile=importlib.util.cache_from_source(str(source)),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    done = python(copy, CACHED, PYTHONPYCACHEPREFIX=str(copy.parent / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "False"


def test_an_edited_source_never_runs_from_older_bytecode(copy: Path) -> None:
    probe = copy / "worker" / "instrument" / "probe.py"
    probe.write_text("VALUE = 1\n")
    code = "from worker.instrument.probe import VALUE; print(VALUE)"
    cache = copy.parent / "cache"
    assert python(copy, code, PYTHONPYCACHEPREFIX=str(cache)).stdout == "1\n"
    before = probe.stat()

    def edit(text: str) -> None:
        # Same size, same timestamps: a timestamp pyc would still be taken as current.
        probe.write_text(text)
        os.utime(probe, ns=(before.st_atime_ns, before.st_mtime_ns))

    edit("VALUE = 2\n")
    assert python(copy, code, PYTHONPYCACHEPREFIX=str(cache)).stdout == "2\n"
    # Nor from a timestamp pyc found in the cache: it is replaced before any import.
    cached = Path(cache, *probe.parent.parts[1:], f"probe.{sys.implementation.cache_tag}.pyc")
    edit("VALUE = 1\n")
    py_compile.compile(
        str(probe), cfile=str(cached), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP
    )
    edit("VALUE = 3\n")
    assert python(copy, code, PYTHONPYCACHEPREFIX=str(cache)).stdout == "3\n"


@pytest.mark.parametrize(
    ("layout", "complaint"),
    [
        ("writable", "others could plant bytecode in it"),
        ("symlink", "is not a directory"),
        ("shared-parent", "which others can change"),
    ],
)
def test_a_cache_others_could_write_is_refused(copy: Path, layout: str, complaint: str) -> None:
    cache = copy.parent / "cache"
    if layout == "writable":
        cache.mkdir()
        cache.chmod(0o777)
    elif layout == "symlink":
        (copy.parent / "elsewhere").mkdir(mode=0o700)
        cache.symlink_to(copy.parent / "elsewhere")
    else:
        shared = copy.parent / "shared"
        shared.mkdir()
        shared.chmod(0o777)  # no sticky bit: anyone may rename what is in it
        cache = shared / "cache"
    done = python(copy, "import worker", PYTHONPYCACHEPREFIX=str(cache))
    assert done.returncode == 2, done.stderr
    assert complaint in done.stderr and "PYTHONPYCACHEPREFIX" in done.stderr
    assert "Traceback" not in done.stderr
    assert not pycs(copy)


def test_an_interpreter_that_skips_the_checks_is_refused(copy: Path) -> None:
    done = python(
        copy,
        "import worker",
        "--check-hash-based-pycs",
        "never",
        PYTHONPYCACHEPREFIX=str(copy.parent / "cache"),
    )
    assert done.returncode == 2
    assert "--check-hash-based-pycs never" in done.stderr and "Traceback" not in done.stderr


def test_without_a_home_nothing_is_read_or_written(copy: Path) -> None:
    scratch = copy.parent / "tmp"
    scratch.mkdir()
    done = python(copy, CACHED, HOME="/proc/no-such-home", TMPDIR=str(scratch))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(str(scratch / "ouroboros-no-bytecode-"))
    assert not list(scratch.iterdir()), "the throw-away cache is removed at exit"
    assert [p.name for p in pycs(copy)] == [f"__init__.{sys.implementation.cache_tag}.pyc"]


@pytest.mark.root
def test_a_cache_reached_through_a_symlink_is_checked_where_it_lies(copy: Path) -> None:
    # This user's own directory, but inside one another uid owns: that uid may swap it.
    foreign = copy.parent / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    (foreign / "mine").mkdir(mode=0o700)
    link = copy.parent / "link"
    link.symlink_to(foreign / "mine")
    done = python(copy, "import worker", PYTHONPYCACHEPREFIX=str(link / "cache"))
    assert done.returncode == 2, done.stderr
    assert f"lies under {foreign} (uid 65534" in done.stderr
    assert "Traceback" not in done.stderr
