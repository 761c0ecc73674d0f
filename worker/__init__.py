"""What a sandbox host runs (``celery -A worker worker``): the instrument and the plumbing.

``worker/instrument/`` is the trusted instrument, fingerprinted by being in that
folder; ``worker/fleet/`` is the fleet plumbing, loaded eagerly but not fingerprinted.
The Celery app lives in ``worker.celery`` and is found there by ``celery -A worker``.

Owns where the fleet's bytecode lives and how it is checked, settled here because
this is the first of the fleet's modules any process runs. The instrument is
fingerprinted by its source bytes, so the code that runs must provably be compiled
from exactly those bytes:

* bytecode is never read from or written next to the sources (a ``__pycache__``
  planted or left stale in a checkout or a release is ignored), except for the one
  ``__init__`` Python imports before this code can run (see the limits below):
  ``sys.pycache_prefix``
  is set to a private directory, ``PYTHONPYCACHEPREFIX`` if the launcher set one, else
  ``~/.cache/ouroboros-fleet/pycache``. Private means a real directory owned by this
  user, written by nobody else, under ancestors only this user or root can change
  (sticky directories such as ``/tmp`` allowed), and made 0700; anything else is
  refused with exit status 2. Nothing in a sandbox can reach it: a life sees only
  ``/usr`` of the host.
* every module of the fleet's own packages is compiled there as a *checked
  hash-based* pyc (PEP 552): the pyc records a hash of its source and the import
  system compares it with the source file on every import, recompiling on a
  mismatch; so an edited source is never run from older bytecode, whatever its
  timestamps. A pyc of another kind found there (a module added since, or a cache
  written by something else) is replaced before anything imports it. An interpreter
  started with ``--check-hash-based-pycs never`` is refused.

Third-party packages are cached in the same directory the ordinary way (timestamp
pycs, as their own ``__pycache__`` would be). Bytecode writing is switched on for
the cache whatever ``PYTHONDONTWRITEBYTECODE`` or ``-B`` said: what they are for
(no bytecode beside the sources) holds anyway, and with the prefix set the pycs in
site-packages are no longer read, so not writing would mean compiling every package
at every start. A user without a home to keep the cache in (a uid with no account)
gets an empty private directory for the process instead: nothing read, nothing written.

Limits, because this check is itself imported code: the package's own ``__init__``
(this file, or ``scheduler/__init__.py`` for the CLI) is loaded by Python before any
of this runs. With ``PYTHONPYCACHEPREFIX`` unset its pyc is looked for beside the
source, where only someone who can already edit the sources can put one; with it set,
in the cache it names, where a pyc planted *before* the cache was found unsafe would
still run once. So the check refuses a cache that could be tampered with; it cannot
undo a tampering that came first. The launchers name a cache inside the account's
own home, which nobody else can write.

Trusts: the interpreter, and its user's own home (or ``PYTHONPYCACHEPREFIX``).
"""

import _imp
import os
import py_compile
import stat
import sys
from importlib.util import MAGIC_NUMBER, cache_from_source
from pathlib import Path
from typing import NoReturn

# A pyc's flags word (PEP 552): bit 0 hash-based, bit 1 check the source.
_CHECKED_HASH_FLAGS = (0b11).to_bytes(4, "little")


def _refuse(problem: str) -> NoReturn:
    sys.stderr.write(
        f"error: {problem}; set PYTHONPYCACHEPREFIX to a directory only this user can "
        "write (mode 700), or make this one so\n"
    )
    raise SystemExit(2)


def _private_cache() -> Path | None:
    """The bytecode directory, created if missing, checked to be this user's alone and
    made 0700 (so that nobody else even reaches the directories the compilers create
    in it, whatever the umask); None when there is no home to keep it in."""
    if _imp.check_hash_based_pycs == "never":
        sys.stderr.write(
            "error: this interpreter runs with --check-hash-based-pycs never, so bytecode "
            "is not checked against the fingerprinted sources; start it without that option\n"
        )
        raise SystemExit(2)
    if sys.pycache_prefix:
        cache = Path(os.path.abspath(sys.pycache_prefix))
    else:
        try:
            cache = Path.home() / ".cache" / "ouroboros-fleet" / "pycache"
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (OSError, RuntimeError):
            return None
    try:
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Checked where it really lies: reached through a symlinked ancestor, the
        # directories that really hold it (and could swap it) would go unchecked.
        cache = Path(os.path.realpath(cache.parent)) / cache.name
        found = os.lstat(cache)
    except OSError as error:
        _refuse(f"cannot create the bytecode cache {cache}: {error.strerror}")
    if not stat.S_ISDIR(found.st_mode):
        _refuse(f"the bytecode cache {cache} is not a directory (a symlink?)")
    if found.st_uid != os.geteuid() or found.st_mode & 0o022:
        _refuse(
            f"the bytecode cache {cache} is owned by uid {found.st_uid} with mode "
            f"{stat.S_IMODE(found.st_mode):o}: others could plant bytecode in it"
        )
    for ancestor in cache.parents:
        # Whoever may rename entries of an ancestor may swap the cache for their own.
        seen = os.stat(ancestor)
        shared = seen.st_mode & 0o022 and not seen.st_mode & stat.S_ISVTX
        if seen.st_uid not in (0, os.geteuid()) or shared:
            _refuse(
                f"the bytecode cache {cache} lies under {ancestor} (uid {seen.st_uid}, mode "
                f"{stat.S_IMODE(seen.st_mode):o}), which others can change"
            )
    if stat.S_IMODE(found.st_mode) != 0o700:
        os.chmod(cache, 0o700)
    return cache


def _throwaway_cache() -> Path:
    """An empty private directory for this process: no bytecode read, none written."""
    import atexit
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="ouroboros-no-bytecode-")
    atexit.register(shutil.rmtree, cache, True)
    return Path(cache)


def checked_bytecode(package: Path) -> None:
    """Compile every module under ``package`` to a checked hash-based pyc in the cache.

    Only the pycs missing or of another kind are written; a checked one with a stale
    hash is left for the import system, which recompiles it as a checked one. Nothing
    is written for a process without a cache of its own (``_throwaway_cache``).
    """
    if sys.dont_write_bytecode:
        return
    for folder, subfolders, files in os.walk(package):
        subfolders[:] = [name for name in subfolders if name != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            source = os.path.join(folder, name)
            cached = cache_from_source(source)
            try:
                with open(cached, "rb") as pyc:
                    header = pyc.read(8)
            except OSError:
                header = b""
            if header == MAGIC_NUMBER + _CHECKED_HASH_FLAGS:
                continue
            try:
                py_compile.compile(
                    source,
                    cfile=cached,
                    doraise=True,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )
            except (py_compile.PyCompileError, OSError):
                # The import compiles it from source and reports a syntax error itself.
                continue


_cache = _private_cache()
# Written whatever PYTHONDONTWRITEBYTECODE or -B said (see above); never for a throwaway.
sys.dont_write_bytecode = _cache is None
sys.pycache_prefix = str(_cache or _throwaway_cache())
checked_bytecode(Path(__file__).resolve().parent)
