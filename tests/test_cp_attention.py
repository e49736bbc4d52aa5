"""The reference CP attention and the pure-torch THD split against plain full attention, on 4 gloo ranks.

Every rank builds the same full q, k, v and upstream gradient from one seed, computes full attention
with torch's scaled_dot_product_attention (per sequence for packed batches), then runs the reference
CP attention on its zigzag share inside CP groups of size 1, 2 and 4 and compares forward outputs and
q/k/v gradients at the positions it holds.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.engines.cp_attention import ReferenceCPAttention
from harness.engines.cp_data import (
    local_thd_positions,
    pack_thd,
    padded_cu_seqlens,
    thd_batch_on_this_cp_rank,
    thd_partitioned_indices,
    zigzag_positions,
)

WORLD = 4
HEADS, GROUPS, DIM = 4, 2, 8
TOL = 1e-5  # fp32: max abs error relative to the output / gradient scale
# packed batches: uneven lengths, one shorter than 2*cp, one exactly a multiple of 8
THD_SEQLENS = [13, 3, 32, 21]


def _attention(cp_group) -> ReferenceCPAttention:
    config = types.SimpleNamespace(kv_channels=DIM, hidden_size=HEADS * DIM, num_attention_heads=HEADS)
    return ReferenceCPAttention(config, 1, None, None, pg_collection=types.SimpleNamespace(cp=cp_group))


def _full_sbhd(q, k, v):
    """[s, b, h, d] causal GQA attention -> [s, b, h*d]."""
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                         is_causal=True, enable_gqa=True, scale=DIM ** -0.5)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _inputs(seq: int, batch: int | None, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lead = (seq,) if batch is None else (seq, batch)
    q = torch.randn(*lead, HEADS, DIM, generator=gen)
    k = torch.randn(*lead, GROUPS, DIM, generator=gen)
    v = torch.randn(*lead, GROUPS, DIM, generator=gen)
    grad = torch.randn(*lead, HEADS * DIM, generator=gen)
    return q, k, v, grad


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _err(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _check_sbhd(cp: int, group, rank: int) -> dict[str, float]:
    seq = 32
    q, k, v, grad = _inputs(seq, 2, seed=10 + cp)
    fq, fk, fv = _leaf(q), _leaf(k), _leaf(v)
    full = _full_sbhd(fq, fk, fv)
    full.backward(grad)
    idx = zigzag_positions(seq, cp, rank)
    lq, lk, lv = _leaf(q[idx]), _leaf(k[idx]), _leaf(v[idx])
    out = _attention(group)(lq, lk, lv)
    out.backward(grad[idx])
    return {"out": _err(out, full[idx]), "dq": _err(lq.grad, fq.grad[idx]),
            "dk": _err(lk.grad, fk.grad[idx]), "dv": _err(lv.grad, fv.grad[idx])}


def _check_thd(cp: int, group, rank: int, static_group=None) -> dict[str, float]:
    """static_group given: the CP group travels in packed_seq_params (dynamic CP) and must win over it."""
    cu, cu_padded = padded_cu_seqlens(THD_SEQLENS, cp)
    total = int(cu_padded[-1])
    q, k, v, grad = _inputs(total, None, seed=20 + cp)
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(cu_padded[:-1].tolist(), THD_SEQLENS):
        real[start:start + n] = True
    grad = grad * real[:, None]  # padding outputs carry no loss
    fq, fk, fv = _leaf(q), _leaf(k), _leaf(v)
    full = torch.zeros(total, HEADS * DIM)
    for start, n in zip(cu_padded[:-1].tolist(), THD_SEQLENS):
        s = slice(start, start + n)
        full[s] = _full_sbhd(fq[s].unsqueeze(1), fk[s].unsqueeze(1), fv[s].unsqueeze(1)).squeeze(1)
    full.backward(grad)
    idx = thd_partitioned_indices(cu_padded, cp, rank)
    params = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded,
                                   cp_group=group if static_group is not None else None)
    lq, lk, lv = _leaf(q[idx]), _leaf(k[idx]), _leaf(v[idx])
    attn = _attention(static_group if static_group is not None else group)
    out = attn(lq, lk, lv, packed_seq_params=params)
    out.backward(grad[idx])
    keep = real[idx]
    return {"out": _err(out[keep], full[idx][keep]), "dq": _err(lq.grad, fq.grad[idx]),
            "dk": _err(lk.grad, fk.grad[idx]), "dv": _err(lv.grad, fv.grad[idx])}


def compare(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """On each rank (tests.support.rank_call): the errors of every layout at CP 1, 2 and 4."""
    results = {}
    singles = [dist.new_group([r]) for r in range(world_size)]
    for cp in (1, 2, 4):
        groups = [dist.new_group(list(range(i, i + cp))) for i in range(0, world_size, cp)]
        group, cp_rank = groups[rank // cp], rank % cp
        results[f"sbhd-cp{cp}"] = _check_sbhd(cp, group, cp_rank)
        results[f"thd-cp{cp}"] = _check_thd(cp, group, cp_rank)
        results[f"thd-cp{cp}-params-group"] = _check_thd(cp, group, cp_rank, static_group=singles[rank])
    return results


@pytest.fixture(scope="module")
def cp_results():
    from tests.support.rank_call import on_ranks

    return on_ranks("tests.test_cp_attention:compare", WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sbhd", "thd", "thd-params-group"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_reference_cp_attention_matches_full_attention(cp_results, layout, cp):
    name = f"{layout.split('-')[0]}-cp{cp}" + ("-params-group" if layout.endswith("params-group") else "")
    for rank, res in enumerate(cp_results):
        errs = res[name]
        bad = {k: e for k, e in errs.items() if e > TOL}
        assert not bad, f"{name} rank {rank}: relative max abs error {bad} > {TOL}"


def test_zigzag_positions_cover_the_sequence_once():
    for cp in (1, 2, 4):
        got = torch.cat([zigzag_positions(16, cp, r) for r in range(cp)])
        assert sorted(got.tolist()) == list(range(16))
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_thd_split_pads_each_sequence_and_covers_every_token_once():
    cu, cu_padded = padded_cu_seqlens([5, 8, 1], cp=2)
    assert cu.tolist() == [0, 5, 13, 14] and cu_padded.tolist() == [0, 8, 16, 20]
    idx = torch.cat([thd_partitioned_indices(cu_padded, 2, r) for r in range(2)])
    assert sorted(idx.tolist()) == list(range(20))
    # rank 0 holds chunks 0 and 3 of every sequence
    assert thd_partitioned_indices(cu_padded, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15, 16, 19]
    seq, pos = local_thd_positions(cu_padded, 2, 1)
    assert seq.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2] and pos.tolist() == [2, 3, 4, 5, 2, 3, 4, 5, 1, 2]


def test_pack_and_split_keep_tokens_with_their_labels():
    samples = [{"tokens": torch.arange(n) + 100 * i, "loss_mask": torch.ones(n)} for i, n in enumerate([5, 3])]
    batch, cu, cu_padded = pack_thd(samples, cp=2)
    assert batch["tokens"].shape == (1, 12) and batch["loss_mask"].sum() == 8
    local, params = thd_batch_on_this_cp_rank(dict(batch), cu, cu_padded, cp=2, rank=1)
    assert local["tokens"].tolist() == [[2, 3, 4, 0, 101, 102]]
    assert params.qkv_format == "thd" and params.max_seqlen_q == 8
