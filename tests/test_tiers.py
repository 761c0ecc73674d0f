"""The fast tier's selection and enforcement (``support.tiers``), on test files of their
own run by pytest in this process (``pytester``): what ``--fast`` refuses fails the test
that did it and says it belongs in the full tier; what it allows passes."""

from __future__ import annotations

import socket

import pytest
from support.tiers import listening_here


def run(pytester: pytest.Pytester, body: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner="import os, socket, subprocess, multiprocessing\n\n" + body)
    return pytester.runpytest_inprocess("-p", "support.tiers", "-p", "no:cacheprovider", *args)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ('subprocess.run(["true"])', "subprocess"),
        # Were the refusal to fail, the child would leave at once and the run would fail.
        ("os.fork() == 0 and os._exit(0)", "os.fork"),
        ('os.posix_spawn("/bin/true", ["true"], {})', "os.posix_spawn"),
        ('os.execv("/bin/false", ["false"])', "os.execv"),
        ('os.system("true")', "os.system"),
        ("multiprocessing.Process(target=print).start()", "multiprocessing"),
    ],
)
def test_a_fast_test_that_starts_a_process_fails_saying_it_belongs_in_the_full_tier(
    pytester: pytest.Pytester, call: str, named: str
) -> None:
    result = run(pytester, f"def test_spawns():\n    {call}\n", "--fast")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*test_spawns started a process ({named}): it belongs in the full tier*"]
    )


def test_a_refusal_the_code_under_test_swallows_still_fails_the_test(
    pytester: pytest.Pytester,
) -> None:
    body = (
        "def test_quiet():\n"
        "    try:\n"
        '        subprocess.run(["true"])\n'
        "    except Exception:\n"
        "        pass\n"
    )
    result = run(pytester, body, "--fast")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_quiet started a process (subprocess)*full tier*"])


def test_a_connection_to_a_service_outside_this_process_fails_in_the_fast_tier(
    pytester: pytest.Pytester,
) -> None:
    body = 'def test_redis():\n    socket.create_connection(("127.0.0.1", 6379), timeout=1)\n'
    result = run(pytester, body, "--fast")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_redis connected to a service at*full tier*"])


def test_a_server_of_this_process_and_a_socket_pair_are_allowed_in_the_fast_tier(
    pytester: pytest.Pytester,
) -> None:
    body = (
        "def test_own_server():\n"
        '    server = socket.create_server(("127.0.0.1", 0))\n'
        "    client = socket.create_connection(server.getsockname(), timeout=5)\n"
        "    accepted, _ = server.accept()\n"
        '    client.sendall(b"hi")\n'
        '    assert accepted.recv(2) == b"hi"\n'
        "    for s in (client, accepted, server):\n"
        "        s.close()\n"
        "    left, right = socket.socketpair()\n"
        '    left.sendall(b"x")\n'
        '    assert right.recv(1) == b"x"\n'
    )
    run(pytester, body, "--fast").assert_outcomes(passed=1)


def test_fast_deselects_the_full_tier_and_the_whole_suite_runs_both(
    pytester: pytest.Pytester,
) -> None:
    body = (
        "import pytest\n\n"
        "def test_fast():\n    pass\n\n"
        "@pytest.mark.full\ndef test_marked():\n    pass\n\n"
        "@pytest.mark.bwrap\ndef test_sandboxed():\n    pass\n\n"
        "def test_service(redis_url):\n    pass\n\n"
        "@pytest.fixture\ndef redis_url():\n    return 'redis://nowhere'\n"
    )
    run(pytester, body, "--fast").assert_outcomes(passed=1, deselected=3)
    run(pytester, body).assert_outcomes(passed=4)


def test_only_a_listener_of_this_process_counts_as_its_own_whatever_the_bind_watch_saw() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        assert listening_here(("127.0.0.1", port))
        # A port nobody here listens on, and the machine's Redis (another process's).
        assert not listening_here(("127.0.0.1", port + 1 if port < 65535 else port - 1))
        assert not listening_here(("127.0.0.1", 6379))
    finally:
        server.close()
    assert not listening_here(("127.0.0.1", port))
