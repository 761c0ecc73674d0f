"""The syscall filter of every life: which system calls the kernel refuses an organism.

Owns the filter's definition (``RULES``, data: each group with its reason and anchor),
its digest (``DIGEST``: sha256 of the canonical JSON of that definition, which
capabilities.json and every observation carry) and its compilation to the classic BPF
that bwrap loads with ``--seccomp`` just before it execs the staging runner.

The filter is a deny list over an allowing default, as Flatpak's bwrap filter
(flatpak-run.c, ``setup_seccomp``) is, and refuses at least what Docker's default
profile (moby ``profiles/seccomp/default.json``) refuses where it matters to a life:
the kernel's shared state (keyrings, io_uring, perf, BPF, modules, kexec, NUMA policy,
clocks), new mounts and namespaces, other ABIs, sockets of families a life has no use
for. A refused call fails with EPERM, never a kill, so that an organism can adapt.

The digest is of the definition, not of the BPF: the bytes libseccomp emits may change
with its version while the rules do not, and a lineage's physics must not depend on
which worker lived a generation. Trusts libseccomp (through its ctypes binding,
pyseccomp) to compile the rules faithfully; a name this host's libseccomp cannot
resolve is a Refusal, since the worker could not enforce the physics it states.
"""

from __future__ import annotations

import errno
import hashlib
import json
import tempfile
from functools import cache
from typing import Literal

import pyseccomp
from pydantic import BaseModel, ConfigDict

from worker.instrument.errors import Refusal

# How a refused call fails (a name of ``errno``).
Refused = Literal["EPERM", "ENOSYS"]

DOCKER = "Docker default seccomp profile (moby profiles/seccomp/default.json)"
FLATPAK = "Flatpak's bwrap filter (flatpak-run.c setup_seccomp)"
BOTH = f"{DOCKER}; {FLATPAK}"

# Flags of clone(2) that make a namespace. CLONE_NEWTIME (0x80) is left out: in clone's
# first argument those bits are the exit signal, and the kernel accepts the flag only
# from clone3 and unshare, both refused outright.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
AF_UNSPEC, AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 0, 1, 2, 10, 16
NETLINK_ROUTE = 0
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
LOW_32 = 0xFFFFFFFF


class Condition(BaseModel):
    """One comparison of an argument; a rule's call is refused when all of its hold.

    ``masked_eq``: ``(argument & mask) == value``; ``ne`` and ``ge``: the argument's
    whole 64 bits against ``value``, unsigned.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    argument: int
    op: Literal["masked_eq", "ne", "ge"]
    value: int
    mask: int = LOW_32


class Rule(BaseModel):
    """One refused call, or one refused form of it (every condition of ``when`` holds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    syscall: str
    when: tuple[Condition, ...] = ()
    refused: Refused = "EPERM"


class Group(BaseModel):
    """Rules refused for one reason, with the filter that anchors them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    reason: str
    anchor: str
    rules: tuple[Rule, ...]


class Unreviewed(BaseModel):
    """System call numbers newer than the calls this filter was reviewed against.

    Every one of them fails as the kernel fails a call it does not have, until a review
    adds it to a group or lets it through: a kernel newer than the filter must not hand
    a life a new door (Linux 6.15's open_tree_attr does what open_tree does). Numbers
    from 424 on are the same on every architecture (Linux 5.1 unified them), so one
    range serves each; 512 is where the x32 numbers, refused as another ABI, begin.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    first: int
    last: int
    refused: Refused = "ENOSYS"
    reviewed_against: str


class Definition(BaseModel):
    """The whole filter: its groups, the calls newer than it, and another ABI's calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: Literal["allow"] = "allow"
    other_abis: Refused = "EPERM"
    groups: tuple[Group, ...]
    unreviewed: Unreviewed


def _plain(*names: str) -> tuple[Rule, ...]:
    return tuple(Rule(syscall=name) for name in names)


def _low_32_is(argument: int, value: int) -> Condition:
    # Arguments are compared as 64 bits while the kernel reads an int argument's low 32
    # only: a value with high bits set must not slip past an equality.
    return Condition(argument=argument, op="masked_eq", value=value)


def _personality_changes() -> tuple[Rule, ...]:
    """personality(2) refused for every value but PER_LINUX and the 0xffffffff query.

    A deny list can only name what it refuses: a 32-bit value is neither all zeros nor
    all ones exactly when two neighbouring bits differ, so one rule per neighbouring
    pair and order of its bits covers every other value (the kernel reads 32 bits).
    """
    return tuple(
        Rule(
            syscall="personality",
            when=(Condition(argument=0, op="masked_eq", value=differing, mask=0b11 << bit),),
        )
        for bit in range(31)
        for differing in (0b01 << bit, 0b10 << bit)
    )


def _socket_families() -> tuple[Rule, ...]:
    """socket(2) of any family but AF_UNIX, AF_INET, AF_INET6 and NETLINK_ROUTE, and
    socketpair(2) of any but AF_UNIX.

    A life needs AF_UNIX for the model socket; AF_INET and AF_INET6 reach only its own
    empty network namespace; glibc's resolver asks NETLINK_ROUTE which addresses exist.
    socketpair runs a family's create code as socket does (a hostile review reached
    VSOCK's and netlink's that way, and on a modular kernel that loads their modules);
    only AF_UNIX makes pairs.
    """
    kept = {AF_UNSPEC, AF_UNIX, AF_INET, AF_INET6, AF_NETLINK}
    below = tuple(
        Rule(syscall="socket", when=(_low_32_is(0, family),))
        for family in range(AF_NETLINK)
        if family not in kept
    )
    # Every family above AF_NETLINK, and every value with high bits set.
    above = Rule(syscall="socket", when=(Condition(argument=0, op="ge", value=AF_NETLINK + 1),))
    netlink = Rule(
        syscall="socket",
        when=(_low_32_is(0, AF_NETLINK), Condition(argument=2, op="ne", value=NETLINK_ROUTE)),
    )
    pairs = Rule(syscall="socketpair", when=(Condition(argument=0, op="ne", value=AF_UNIX),))
    return (*below, above, netlink, pairs)


def _namespace_clones() -> tuple[Rule, ...]:
    return tuple(
        Rule(syscall="clone", when=(Condition(argument=0, op="masked_eq", value=flag, mask=flag),))
        for flag in CLONE_NAMESPACE_FLAGS.values()
    )


DEFINITION = Definition(
    groups=(
        Group(
            name="keyrings",
            reason=(
                "the kernel's keyrings are shared with the host: request_key runs "
                "/sbin/request-key as host root through the usermode helper, and keys "
                "outlive the life (a life also has a session keyring of its own)"
            ),
            anchor=BOTH,
            rules=_plain("add_key", "keyctl", "request_key"),
        ),
        Group(
            name="io_uring",
            reason="a second syscall surface that a filter cannot see into",
            anchor=DOCKER,
            rules=_plain("io_uring_setup", "io_uring_enter", "io_uring_register"),
        ),
        Group(
            name="kernel_introspection",
            reason=(
                "perf, BPF, userfaultfd and kcmp expose kernel state or widen race windows "
                "of kernel exploits; a life needs none"
            ),
            anchor=DOCKER,
            rules=_plain(
                "perf_event_open", "bpf", "userfaultfd", "kcmp", "lookup_dcookie", "syslog"
            ),
        ),
        Group(
            name="secret_memory",
            reason="memfd_secret memory is hidden from the kernel's own accounting and dumps",
            anchor=DOCKER,
            rules=_plain("memfd_secret"),
        ),
        Group(
            name="kernel_code",
            reason="loading modules or another kernel changes the host",
            anchor=BOTH,
            rules=_plain(
                "init_module",
                "finit_module",
                "delete_module",
                "create_module",
                "query_module",
                "get_kernel_syms",
                "kexec_load",
                "kexec_file_load",
            ),
        ),
        Group(
            name="mounts",
            reason="the sandbox's file system is the instrument's: no mount may change it",
            anchor=BOTH,
            rules=_plain(
                "mount",
                "umount",
                "umount2",
                "pivot_root",
                "chroot",
                "fsopen",
                "fsconfig",
                "fsmount",
                "fspick",
                "move_mount",
                "open_tree",
                "mount_setattr",
            ),
        ),
        Group(
            name="namespaces",
            reason=(
                "a new namespace would hand the organism capabilities again; clone3 fails "
                "with ENOSYS so that libc falls back to clone, whose flags the filter reads"
            ),
            anchor=BOTH,
            rules=(
                *_plain("unshare", "setns"),
                *_namespace_clones(),
                Rule(syscall="clone3", refused="ENOSYS"),
            ),
        ),
        Group(
            name="personality",
            reason=(
                "other personalities change the memory layout and permissions "
                "(READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE); PER_LINUX and the query are kept"
            ),
            anchor=BOTH,
            rules=_personality_changes(),
        ),
        Group(
            name="socket_families",
            reason=(
                "a life talks to the model socket (AF_UNIX) and nothing else: VSOCK, "
                "packet, netlink other than routing, Bluetooth and the rest reach "
                "host-wide kernel code"
            ),
            anchor=FLATPAK,
            rules=_socket_families(),
        ),
        Group(
            name="other_processes",
            reason=(
                "reading or steering another process: the staging runner holds the "
                "result stream, and gdb and strace are in /usr"
            ),
            anchor=FLATPAK,
            rules=_plain(
                "ptrace",
                "process_vm_readv",
                "process_vm_writev",
                "pidfd_getfd",
                "process_madvise",
            ),
        ),
        Group(
            name="terminal_input",
            reason="faking input to a terminal (TIOCSTI, TIOCLINUX)",
            anchor=FLATPAK,
            rules=(
                Rule(syscall="ioctl", when=(_low_32_is(1, TIOCSTI),)),
                Rule(syscall="ioctl", when=(_low_32_is(1, TIOCLINUX),)),
            ),
        ),
        Group(
            name="numa",
            reason="memory policy and page moves act beyond the life's memory ceiling",
            anchor=DOCKER,
            rules=_plain(
                "mbind",
                "set_mempolicy",
                "set_mempolicy_home_node",
                "get_mempolicy",
                "migrate_pages",
                "move_pages",
            ),
        ),
        Group(
            name="host_administration",
            reason="host-wide settings: clocks, swap, quotas, accounting, reboot, I/O ports",
            anchor=DOCKER,
            rules=_plain(
                "settimeofday",
                "clock_settime",
                "clock_adjtime",
                "stime",
                "swapon",
                "swapoff",
                "quotactl",
                "quotactl_fd",
                "acct",
                "reboot",
                "iopl",
                "ioperm",
                "vhangup",
                "fanotify_init",
                "open_by_handle_at",
                "nfsservctl",
                "uselib",
                "ustat",
                "sysfs",
                "_sysctl",
                "vm86",
                "vm86old",
            ),
        ),
    ),
    # 457 is statmount (6.8): listmount, the lsm_* calls, mseal, the *xattrat calls,
    # open_tree_attr and file_getattr/file_setattr came after it, none of them used by
    # the libc or the Emacs a life runs.
    unreviewed=Unreviewed(
        first=457, last=511, reviewed_against="Linux 6.7 (up to futex_requeue, 456)"
    ),
)


def canonical(definition: Definition = DEFINITION) -> bytes:
    """The definition as canonical JSON: the bytes ``DIGEST`` is taken of."""
    return json.dumps(
        definition.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
    ).encode()


DIGEST = "sha256:" + hashlib.sha256(canonical()).hexdigest()

_OPERATORS = {"masked_eq": pyseccomp.MASKED_EQ, "ne": pyseccomp.NE, "ge": pyseccomp.GE}


@cache
def compiled() -> bytes:
    """``DEFINITION`` as the classic BPF program bwrap's ``--seccomp`` reads."""
    syscall_filter = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    # The native ABI only: a call through the x32 or i386 entry points is refused.
    syscall_filter.set_attr(
        pyseccomp.Attr.ACT_BADARCH, pyseccomp.ERRNO(_errno(DEFINITION.other_abis))
    )
    # A binary tree over syscall numbers: every allowed call (nearly all of a life's)
    # passes a few comparisons instead of one per refused call.
    syscall_filter.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, _BINARY_TREE)
    for group in DEFINITION.groups:
        for rule in group.rules:
            if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, rule.syscall) == _UNKNOWN:
                raise Refusal(
                    f"this worker's libseccomp does not know the system call {rule.syscall}, "
                    "which the syscall filter refuses; upgrade libseccomp2"
                )
            arguments = [_argument(condition) for condition in rule.when]
            syscall_filter.add_rule(pyseccomp.ERRNO(_errno(rule.refused)), rule.syscall, *arguments)
    unreviewed = DEFINITION.unreviewed
    for number in range(unreviewed.first, unreviewed.last + 1):
        syscall_filter.add_rule(pyseccomp.ERRNO(_errno(unreviewed.refused)), number)
    with tempfile.TemporaryFile() as program:
        syscall_filter.export_bpf(program)
        program.seek(0)
        return program.read()


_UNKNOWN = -1
_BINARY_TREE = 2


def _errno(name: Refused) -> int:
    return int(getattr(errno, name))


def _argument(condition: Condition) -> pyseccomp.Arg:
    operator = _OPERATORS[condition.op]
    if condition.op == "masked_eq":
        return pyseccomp.Arg(condition.argument, operator, condition.mask, condition.value)
    return pyseccomp.Arg(condition.argument, operator, condition.value)
