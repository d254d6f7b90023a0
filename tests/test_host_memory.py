"""The memory a process may use, read from real cgroup files laid out as the kernel does."""

from __future__ import annotations

from pathlib import Path

from cacheseek import host_memory
from cacheseek.host_memory import memory_limit

V1_UNLIMITED = "9223372036854771712\n"  # (what cgroup v1 says of a group with no limit)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_limit_set_on_a_cgroup_above_the_process_own_is_the_limit(tmp_path):
    """A Slurm job's limit is set on the job's group, and its tasks run in groups below it
    (memory.max "max", limit_in_bytes unlimited); a systemd slice's MemoryMax holds for
    every service in it. Only the process's own group and the hierarchy's root were read:
    such a limit was missed, and a CPU tier over it built (the job killed once it filled)."""
    physical, _ = memory_limit(proc_cgroup=tmp_path / "none", cgroup_root=tmp_path / "none")
    assert physical > 3 << 30  # (the machine's memory: every limit below is lower)
    job = "system.slice/slurmstepd.scope/job_7"
    v2 = tmp_path / "v2"
    _tree(v2, {"proc": f"0::/{job}/step_0/user/task_0\n",
               f"fs/{job}/step_0/user/task_0/memory.max": "max\n",
               f"fs/{job}/step_0/memory.max": "max\n",
               f"fs/{job}/memory.max": f"{2 << 30}\n",
               "fs/system.slice/memory.max": f"{3 << 30}\n"})
    assert memory_limit(proc_cgroup=v2 / "proc", cgroup_root=v2 / "fs") == (
        2 << 30, f"the limit of its cgroup, {v2 / 'fs' / job / 'memory.max'}")

    v1 = tmp_path / "v1"
    slurm = "slurm/uid_1000/job_7"
    _tree(v1, {"proc": f"12:pids:/{slurm}\nnot a cgroup line\n4:memory:/{slurm}/step_0/task_0\n",
               f"fs/memory/{slurm}/step_0/task_0/memory.limit_in_bytes": V1_UNLIMITED,
               f"fs/memory/{slurm}/step_0/memory.limit_in_bytes": V1_UNLIMITED,
               f"fs/memory/{slurm}/memory.limit_in_bytes": f"{1 << 30}\n",
               "fs/memory/memory.limit_in_bytes": V1_UNLIMITED})
    assert memory_limit(proc_cgroup=v1 / "proc", cgroup_root=v1 / "fs") == (
        1 << 30, f"the limit of its cgroup, {v1 / 'fs' / 'memory' / slurm / 'memory.limit_in_bytes'}")


def test_a_v1_container_sees_its_pods_limit_in_its_groups_stat(tmp_path):
    """In a cgroup v1 container, /sys/fs/cgroup/memory is the container's own group (the path
    /proc/self/cgroup names is the host's, not there), and a limit on the pod above it is
    said only by memory.stat's hierarchical_memory_limit."""
    _tree(tmp_path, {"proc": "4:memory:/kubepods/pod1/abc\n",
                     "fs/memory/memory.limit_in_bytes": V1_UNLIMITED,
                     "fs/memory/memory.stat": f"cache 0\nrss 0\nhierarchical_memory_limit {3 << 30}\n"})
    assert memory_limit(proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs") == (
        3 << 30, f"the limit of its cgroup, {tmp_path / 'fs' / 'memory' / 'memory.stat'}")


def test_a_cpu_budget_over_the_address_space_rlimit_as_leaves_is_a_problem(monkeypatch):
    # Under ``ulimit -v`` the CPU tier's chunks past the limit cannot be mapped (mmap ENOMEM):
    # said at the start, where the machine's memory would have let it through.
    import resource

    GiB = 1 << 30
    vm = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmSize:")).split()[1]) * 1024
    monkeypatch.setattr(host_memory, "memory_limit", lambda: (1 << 50, "the machine's memory"))
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda which: (vm + 2 * GiB, resource.RLIM_INFINITY))
    space = host_memory.address_space_left()
    assert space is not None and GiB < space[0] <= 2 * GiB and space[1] == vm + 2 * GiB  # less what is mapped now
    problem = host_memory.cpu_budget_problem(4 * GiB, GiB // 2)
    assert problem is not None and "RLIMIT_AS" in problem, problem
    assert host_memory.cpu_budget_problem(GiB // 2, GiB // 16) is None
    monkeypatch.setattr(host_memory.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert host_memory.address_space_left() is None and host_memory.cpu_budget_problem(4 * GiB, GiB) is None
