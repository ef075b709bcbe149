"""The RAM fulcrum sizes and checks against is a container's where a cgroup limits memory:
/proc/meminfo shows the host's, and a KV cache sized from it got the process OOM-killed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum import LLM
from fulcrum.worker import memory

MIB = 1 << 20


def _fake_cgroups(monkeypatch, tmp_path: Path, proc_cgroup: str,
                  files: dict) -> None:
    """/proc/self/cgroup and the cgroup mount, as `files` ({relative path: text}) write them."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "proc_cgroup")


def test_a_cgroup_v2_limit_leaves_its_room_dropping_inactive_page_cache(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "0::/pod/ctr\n", {
        "pod/memory.max": "max\n", "pod/memory.current": str(100 * MIB),
        "pod/ctr/memory.max": str(2048 * MIB), "pod/ctr/memory.current": str(1536 * MIB),
        "pod/ctr/memory.stat": f"anon 1\ninactive_file {256 * MIB}\nactive_file 5\n"})
    assert memory.available_cpu_memory() == 768 * MIB


def test_the_tightest_cgroup_above_the_process_counts(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "0::/pod/ctr\n", {
        "pod/memory.max": str(1024 * MIB), "pod/memory.current": str(1000 * MIB),
        "pod/ctr/memory.max": "max\n", "pod/ctr/memory.current": str(900 * MIB)})
    assert memory.available_cpu_memory() == 24 * MIB


def test_a_cgroup_v1_limit_seen_from_inside_its_container(monkeypatch, tmp_path):
    # The path names the host's view; inside, the mount is the container's own cgroup.
    _fake_cgroups(monkeypatch, tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n", {
        "memory/memory.limit_in_bytes": str(4096 * MIB),
        "memory/memory.usage_in_bytes": str(1536 * MIB),
        "memory/memory.stat": f"hierarchical_memory_limit {2048 * MIB}\n"
                              f"total_inactive_file {64 * MIB}\n"})
    assert memory.available_cpu_memory() == (2048 - 1536 + 64) * MIB


def test_a_cgroup_using_more_than_its_limit_leaves_no_room(monkeypatch, tmp_path):
    """A limit lowered below the usage (docker update --memory): no room, not a negative
    amount ("more than the -0.0 GiB of RAM available")."""
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"memory.max": str(1024 * MIB),
                                                      "memory.current": str(1536 * MIB)})
    assert memory.available_cpu_memory() == 0


def test_without_a_limit_the_systems_available_memory_counts(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"memory.max": "max\n",
                                                      "memory.current": str(MIB)})
    assert memory.available_cpu_memory() == memory._system_available()


def test_the_cpu_kv_cache_is_sized_within_the_containers_limit(monkeypatch, tmp_path, llama_dir):
    """The cache is 90% (gpu_memory_utilization) of what the cgroup leaves, not of the
    host's memory (64 MiB here, what max_num_seqs requests could ever use)."""
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"memory.max": str(1024 * MIB),
                                                      "memory.current": str(1014 * MIB)})
    engine = LLM(str(llama_dir)).llm_engine
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, block size, KV heads, head dim, fp32
    assert engine.executor.num_blocks * per_block <= 9 * MIB
    assert engine.executor.num_blocks * per_block > 8 * MIB


def test_weights_larger_than_the_containers_room_are_refused(monkeypatch, tmp_path, llama_dir):
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"memory.max": str(1024 * MIB),
                                                      "memory.current": str(1024 * MIB - 1000)})
    with pytest.raises(ValueError, match=r"more than the 0\.0 GiB of RAM available"):
        LLM(str(llama_dir))
