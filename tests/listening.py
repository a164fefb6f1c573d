"""The TCP sockets a process listens on, from /proc alone: its socket inodes
(/proc/<pid>/fd) matched against /proc/<pid>/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

LISTEN = "0A"


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` holds in the LISTEN state."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        text = Path(f"/proc/{pid}/net/{table}").read_text()
        found += [address for inode, address in parse_listeners(text) if inode in inodes]
    return found


def parse_listeners(table: str) -> list[tuple[str, tuple[str, int]]]:
    """(inode, (address, port)) of each LISTEN row of a /proc/net/tcp or tcp6 table."""
    rows = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == LISTEN:
            address, port = fields[1].split(":")
            rows.append((fields[9], (decode_address(address), int(port, 16))))
    return rows


def decode_address(hexadecimal: str) -> str:
    """The kernel writes an address as 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexadecimal)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(packed))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for descriptor in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(match.group(1))
    return inodes


def store_server_pid(launcher_pid: int) -> int | None:
    """The pid of a launcher's store server (`tidal.launcher.store_server`, its child
    through `deathsig`, which execs it), or None while there is none."""
    for children in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        try:
            pids = [int(p) for p in children.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tidal.launcher.store_server" in command:
                return pid
    return None
