"""What a warm rank gives back after a case (harness/platform/parallel.py): its process groups, newest first and in
the same order on every rank, and on a GPU rank the caching allocator's blocks and peaks (CUDA stood in)."""

from __future__ import annotations

import torch


def test_groups_are_destroyed_newest_first_and_only_the_cases(monkeypatch):
    """Destroying NCCL communicators has been a collective call in some NCCL versions: every rank must destroy its
    groups in one order, which a set's (by object id) is not."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from harness.platform import parallel

    groups = [object() for _ in range(12)]
    monkeypatch.setattr(c10d, "_world", type("World", (), {"pg_map": {g: None for g in groups}})())
    destroyed: list = []
    monkeypatch.setattr(dist, "destroy_process_group", destroyed.append)
    parallel.destroy_groups_since(set(groups[:2]))
    assert destroyed == groups[:1:-1]


def test_a_gpu_rank_empties_the_allocator_cache_and_restarts_its_peaks_after_a_case(monkeypatch):
    from harness.platform import parallel

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset_peak_memory_stats"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU rank: no CUDA to ask
    parallel.release_memory()
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    parallel.release_memory()
    assert calls == ["empty_cache", "reset_peak_memory_stats"]
