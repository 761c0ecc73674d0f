"""What the tests share, and the benchmarks with them: nothing here is a test.

* ``fleet``: the fleet harness (an isolated fleet home driven as a user drives it,
  real workers, private Redis, moto's S3 server) and the machine's Redis;
* ``browse``, ``legacy_lineage``: the sample lineages the read side is tested on;
* ``unprivileged_worker``: one life lived by an unprivileged worker, run as a script;
* ``vm_guest``, ``vm_fleet``, ``vm_container`` (with ``vm_container.sh``): the booted
  guest of the VM test;
* ``standins/``: stand-in ``systemd-run`` and ``systemctl`` executables.

The tests import it as ``support`` (``tests/`` is on ``sys.path`` under pytest);
``bench/common.py`` puts ``tests/`` on ``sys.path`` to import it too.
"""
