"""How many CPUs this process can really use: the CPUs it may run on (its affinity) and the CPU time
its cgroup allows (a quota, as container runtimes set for `--cpus`), whichever is smaller.

os.sched_getaffinity counts the CPUs a process may be scheduled on; in a container that is often the
whole host, while the quota grants a few CPUs' worth of time: threads beyond the quota only take
turns, each waiting for the others. The quota is read from the cgroup files (v2 `cpu.max`: "QUOTA
PERIOD" or "max PERIOD"; v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 for none) of this process's
cgroup and of each cgroup above it (a parent's quota limits its children too); the smallest wins.
"""
from __future__ import annotations

import os
from pathlib import Path

_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2 cpu.max ("200000 100000" = 2 CPUs; "max 100000" = no quota) in CPUs, None for no
    quota or text that is not of that form."""
    parts = (text or "").split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = int(parts[0])
        period = int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota_text: str | None, period_text: str | None) -> float | None:
    """cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us in CPUs, None for no quota (-1) or unreadable."""
    try:
        quota, period = int(quota_text or ""), int(period_text or "")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's cpu controller (None if absent)."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _up_from(mount: Path, path: str | None) -> list[Path]:
    """The cgroup's directory under the mount and each directory above it up to the mount itself. A
    container may see its own cgroup at the mount's root while /proc names the host's path: the path
    then does not exist below the mount, and the root is what is read."""
    dirs = []
    parts = [p for p in (path or "/").split("/") if p]
    for n in range(len(parts), -1, -1):
        d = mount.joinpath(*parts[:n])
        if d.is_dir():
            dirs.append(d)
    return dirs


def cgroup_cpu_quota(root: str | os.PathLike = "/sys/fs/cgroup",
                     proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> float | None:
    """The CPUs' worth of time the cgroup quotas allow this process (the smallest along its cgroup
    and the ones above it, v2 and v1), None when no quota is set or none can be read."""
    root, proc_cgroup = Path(root), Path(proc_cgroup)
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    quotas = []
    for d in _up_from(root, v2_path):
        quotas.append(parse_cpu_max(_read(d / "cpu.max")))
    for name in _V1_CPU_DIRS:
        mount = root / name
        if mount.is_dir():
            for d in _up_from(mount, v1_path):
                quotas.append(parse_cfs(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")))
            break
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """The smaller of the affinity count and the cgroup quota (rounded down, at least 1)."""
    cpus = affinity_cpus()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return cpus
