"""How much RAM this process may still take: what sizes the CPU KV cache, and what the
weights and the cache are checked against before they are allocated.

The system's available memory (/proc/meminfo) is not the whole answer in a container: a
memory limit (docker --memory, a Kubernetes pod's limits) is a cgroup's, which /proc/meminfo
does not show, so a cache sized from the host's memory got the process killed by the
cgroup's OOM killer. The room a cgroup leaves is its limit less its usage, page cache that
can be dropped (inactive files) not counted as used, as `docker stats` counts it; for the
process's cgroup and every one above it (cgroup v2), or as the kernel sums them (v1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")


def in_this_ram(device_type: str, backend: Optional[str]) -> bool:
    """Whether a model's ranks hold their weights in this machine's RAM: on CPU, with every
    rank a process here (one, or spawned: "uni", "mp", or None, which resolves to one of
    them); Ray and external launchers place ranks elsewhere."""
    return device_type == "cpu" and backend in (None, "uni", "mp")


def available_cpu_memory() -> int:
    """Bytes of RAM this process may still take: the system's available memory, or less
    where a cgroup's memory limit leaves less; none (0) where a cgroup uses more than its
    limit (`docker update --memory` lowered it below the usage)."""
    rooms = [room for room in (_cgroup_v2_room(), _cgroup_v1_room()) if room is not None]
    return max(0, min([_system_available(), *rooms]))


def _system_available() -> int:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_paths(controller: str) -> Iterator[str]:
    """The process's cgroup paths for `controller` ("" names cgroup v2's unified one)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            yield path


def _cgroup_dirs(mount: Path, path: str) -> Iterator[Path]:
    """The process's cgroup folder under `mount` and those above it, nearest first. Inside
    a container the mount is usually the container's own cgroup, named "/" or named by a
    path the container cannot see: then the mount itself."""
    folder = mount / path.lstrip("/")
    if not folder.is_dir():
        folder = mount
    while True:
        yield folder
        if folder == mount:
            return
        folder = folder.parent


def _cgroup_v2_room() -> Optional[int]:
    rooms = []
    for path in _cgroup_paths(""):
        for folder in _cgroup_dirs(CGROUP_ROOT, path):
            limit = _read_int(folder / "memory.max")
            usage = _read_int(folder / "memory.current")
            if limit is not None and usage is not None:
                inactive = _read_stat(folder / "memory.stat").get("inactive_file", 0)
                rooms.append(limit - usage + inactive)
    return min(rooms, default=None)


def _cgroup_v1_room() -> Optional[int]:
    mount = CGROUP_ROOT / "memory"
    for path in _cgroup_paths("memory"):
        folder = next(_cgroup_dirs(mount, path))
        stat = _read_stat(folder / "memory.stat")
        limit = stat.get("hierarchical_memory_limit", _read_int(folder / "memory.limit_in_bytes"))
        usage = _read_int(folder / "memory.usage_in_bytes")
        if limit is not None and usage is not None:
            return limit - usage + stat.get("total_inactive_file", 0)
    return None


def _read_int(file: Path) -> Optional[int]:
    """A cgroup file's number; None where the file is missing or says "max" (no limit)."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_stat(file: Path) -> Dict[str, int]:
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {pair[0]: int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}
