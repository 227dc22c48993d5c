"""Which process a loopback TCP connection comes from (Linux /proc): the relay serves only its own children.

A board's relay listens on 127.0.0.1 for its device process's store clients (torch's, which cannot present a
secret). Any local process could connect there and be carried into the job's store with the board's identity,
so the relay asks the kernel who the connecting socket belongs to: the socket's inode from /proc/net/tcp, then
the process holding that inode. It admits the connection only when that process is this one or one of its
descendants (the device process the agent started, and what that one started).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _hex_endpoints(host: str, port: int) -> tuple[str, str]:
    """An IPv4 endpoint as /proc/net/tcp writes it, and as /proc/net/tcp6 writes its IPv4-mapped form (a client
    with an IPv6 socket, torch's store client among them, reaches an IPv4 server that way): each 32-bit word of
    the address in hex, little-endian, then the port."""
    parts = [int(p) for p in host.split(".")]
    word = f"{parts[0] | parts[1] << 8 | parts[2] << 16 | parts[3] << 24:08X}"
    return f"{word}:{port:04X}", f"0000000000000000FFFF0000{word}:{port:04X}"


def socket_inode(local: tuple[str, int], remote: tuple[str, int], proc: Path = PROC) -> int | None:
    """The inode of the TCP socket (IPv4, or IPv6 with mapped addresses) whose local end is the IPv4 endpoint
    `local` and remote end `remote`, or None."""
    mine, theirs = _hex_endpoints(*local), _hex_endpoints(*remote)
    for i, table in enumerate(("tcp", "tcp6")):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[1] == mine[i] and fields[2] == theirs[i]:
                return int(fields[9]) or None
    return None


def _parent(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then the parent's pid


def _descendants(root: int, proc: Path) -> list[int]:
    """`root` and every process below it."""
    found, parents = [root], {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            parent = _parent(int(entry.name), proc)
            if parent is not None:
                parents.setdefault(parent, []).append(int(entry.name))
    i = 0
    while i < len(found):
        found.extend(parents.get(found[i], []))
        i += 1
    return found


def _holds(pid: int, inode: int, proc: Path) -> bool:
    target = f"socket:[{inode}]"
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def from_descendant(peer: tuple[str, int], server: tuple[str, int], root: int | None = None, proc: Path = PROC) -> bool:
    """Whether the connection from `peer` to our `server` end was opened by process `root` (default: this one) or
    a descendant of it. False when it cannot be told (no /proc, an IPv6 peer)."""
    if ":" in peer[0]:
        return False
    inode = socket_inode((peer[0], peer[1]), (server[0], server[1]), proc)
    if inode is None:
        return False
    return any(_holds(pid, inode, proc) for pid in _descendants(os.getpid() if root is None else root, proc))
