"""cpu_limits.py on fake cgroup trees: the quota of cgroup v2 (cpu.max) and v1 (cfs quota/period),
"no quota" spellings, missing and garbled files, quotas of parent cgroups, and the thread count of
the grammar fill that follows from it."""
import pytest

from splitserve import cpu_limits
from splitserve.structured_output import manager


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("text, cpus", [
    ("400000 100000", 4.0), ("150000 100000\n", 1.5), ("50000 100000", 0.5), ("300000", 3.0),
    ("max 100000", None), ("max", None), ("", None), (None, None), ("lots 100000", None),
    ("0 100000", None), ("100000 0", None),
])
def test_cpu_max(text, cpus):
    assert cpu_limits.parse_cpu_max(text) == cpus


@pytest.mark.parametrize("quota, period, cpus", [
    ("200000", "100000", 2.0), ("-1", "100000", None), ("50000", "100000", 0.5),
    (None, "100000", None), ("200000", None, None), ("x", "100000", None),
])
def test_cfs(quota, period, cpus):
    assert cpu_limits.parse_cfs(quota, period) == cpus


def test_v2_quota_of_this_cgroup_and_the_smallest_above_it(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    write(root / "kubepods" / "cpu.max", "max 100000")
    write(root / "kubepods" / "pod1" / "cpu.max", "300000 100000")
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "600000 100000")  # the parent's 3 limit it
    assert cpu_limits.cgroup_cpu_quota(root, proc) == 3.0
    write(root / "kubepods" / "pod1" / "cpu.max", "max 100000")
    assert cpu_limits.cgroup_cpu_quota(root, proc) == 6.0


def test_a_namespaced_container_reads_the_root_of_its_mount(tmp_path):
    """/proc names a path the mount does not have (the container sees its cgroup as the root)."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "0::/system.slice/docker-abc.scope\n")
    write(root / "cpu.max", "200000 100000")
    assert cpu_limits.cgroup_cpu_quota(root, proc) == 2.0


def test_v1_cfs_quota(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    write(proc, "5:memory:/\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    d = root / "cpu,cpuacct" / "docker" / "abc"
    write(d / "cpu.cfs_quota_us", "250000")
    write(d / "cpu.cfs_period_us", "100000")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    assert cpu_limits.cgroup_cpu_quota(root, proc) == 2.5


def test_no_quota_anywhere_or_nothing_to_read(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    assert cpu_limits.cgroup_cpu_quota(root, proc) is None  # neither file exists
    write(proc, "0::/a\n1:cpu:/a\n")
    write(root / "a" / "cpu.max", "max 100000")
    write(root / "cpu" / "a" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu" / "a" / "cpu.cfs_period_us", "100000")
    assert cpu_limits.cgroup_cpu_quota(root, proc) is None
    write(root / "cpu" / "a" / "cpu.cfs_period_us", "")  # garbled: ignored, not an error
    assert cpu_limits.cgroup_cpu_quota(root, proc) is None


@pytest.mark.parametrize("affinity, quota, usable, threads", [
    (16, None, 16, 8), (64, None, 64, 8), (64, 4.0, 4, 2), (64, 2.5, 2, 1), (64, 0.5, 1, 1),
    (4, 12.0, 4, 2), (1, None, 1, 1),
])
def test_the_fill_uses_half_the_usable_cpus(monkeypatch, affinity, quota, usable, threads):
    monkeypatch.setattr(cpu_limits, "affinity_cpus", lambda: affinity)
    monkeypatch.setattr(cpu_limits, "cgroup_cpu_quota", lambda *a, **k: quota)
    assert cpu_limits.usable_cpus() == usable
    assert manager.fill_threads() == threads
