"""Audit metrics: the payload of a known batch, and two-process (gloo) aggregation by family."""

from __future__ import annotations

import pytest

from engine.trainer import metrics as m
from engine.types import GenerationResult


def result(n: int, reason: str, triggered: int) -> GenerationResult:
    return GenerationResult("", "", tuple(range(n)), (), reason, None, meta={"repeat_terminate_triggered": triggered})


def test_known_batch_payload():
    batch = [result(3, "stop", 1), result(10, "length", 0), result(5, "stop", 1), result(10, "length", 0)]
    got = m.rollout_metrics(batch, guard_active=True, dropped_invalid=2, seconds=1.5)
    assert got[m.ACTIVE] == 1.0 and got[m.TRIGGERED] == 2.0 and got[m.P99] == 10.0
    assert got[m.TRUNCATED_RATE] == 0.5 and got[m.DROPPED] == 2.0 and got[m.SECONDS] == 1.5
    assert m.rollout_metrics([], guard_active=False)[m.TRUNCATED_RATE] == 0.0


def test_p99_nearest_rank():
    assert m.p99([]) == 0.0 and m.p99([7]) == 7.0 and m.p99(list(range(1, 201))) == 198.0


def test_aggregate_is_local_without_a_process_group():
    payload = m.rollout_metrics([result(4, "stop", 1)], guard_active=True)
    assert m.aggregate(payload) == payload


def _rank_main(rank: int, world: int, init_file: str, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    if rank == 0:  # guard on, 1 of 2 truncated, one trigger, p99 = 12, dropped 1, 2.0 s
        batch = [result(12, "length", 1), result(4, "stop", 0)]
        payload = m.rollout_metrics(batch, guard_active=True, dropped_invalid=1, seconds=2.0)
    else:  # guard off, 3 of 3 truncated, p99 = 30, dropped 2, 5.0 s
        batch = [result(30, "length", 0)] * 3
        payload = m.rollout_metrics(batch, guard_active=False, dropped_invalid=2, seconds=5.0)
    queue.put((rank, m.aggregate(payload)))
    dist.destroy_process_group()


def test_two_process_gloo_aggregation(tmp_path):
    torch_mp = pytest.importorskip("torch.multiprocessing", reason="aggregation uses torch.distributed")
    ctx = torch_mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1], "every rank must see the same global values"
    g = got[0]
    assert g[m.ACTIVE] == 1.0  # max of flags
    assert g[m.TRIGGERED] == 1.0  # counters sum
    assert g[m.DROPPED] == 3.0
    assert g[m.P99] == 30.0  # max of rank-local p99s
    assert g[m.SECONDS] == 5.0  # wall time: max
    assert g[m.TRUNCATED_RATE] == pytest.approx(4 / 5)  # (1 + 3) / (2 + 3), not the mean of 0.5 and 1.0


@pytest.mark.parametrize(("backend", "expected"), [
    ("gloo", "cpu"), ("GLOO", "cpu"), ("mpi", "cpu"),
    ("nccl", "cuda:3"), ("cuda:nccl", "cuda:3"),
    ("cpu:gloo,cuda:nccl", "cpu"),  # a mixed group reduces CPU tensors through gloo
])
def test_reduce_device_follows_the_group_backend(monkeypatch, backend, expected):
    torch = pytest.importorskip("torch", reason="the device choice asks torch.cuda for the current device")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert m.reduce_device(backend) == expected


def test_aggregate_puts_its_tensors_where_the_group_backend_wants_them(monkeypatch):
    """An NCCL-only group: every reduced tensor must be built on the device ``reduce_device`` names."""
    dist = pytest.importorskip("torch.distributed", reason="aggregation uses torch.distributed")
    seen_devices, asked = [], []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen_devices.append(str(t.device)))
    monkeypatch.setattr(m, "reduce_device", lambda backend: asked.append(backend) or "cpu")
    payload = m.rollout_metrics([result(4, "stop", 1)], guard_active=True)
    assert m.aggregate(payload)[m.TRIGGERED] == 1.0
    assert asked == ["nccl"] and seen_devices == ["cpu", "cpu"]
