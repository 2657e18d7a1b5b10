"""maxsim.distributed on 2-3 gloo processes (CPU) against one process on the
concatenated batch: scores, loss and gradients."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(world: int):
    g = torch.Generator().manual_seed(0)
    sizes_q = [3, 2, 4][:world]
    sizes_d = [2, 4, 3][:world]  # ranks may hold different numbers of documents
    Q = [torch.nn.functional.normalize(torch.randn(n, 7, 16, generator=g), dim=-1) for n in sizes_q]
    D = [torch.nn.functional.normalize(torch.randn(n, 11, 16, generator=g), dim=-1) for n in sizes_d]
    M = [torch.rand(n, 11, generator=g) > 0.2 for n in sizes_d]
    return Q, D, M


def _loss(scores, rank_offset):
    labels = torch.arange(scores.shape[0]) + rank_offset
    labels = labels.clamp(max=scores.shape[1] - 1)
    return torch.nn.functional.cross_entropy(scores / 0.1, labels, reduction="sum")


def _worker(rank: int, world: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import kernels

        ms = kernels.get_local_kernel(ROOT)
        Q, D, M = _data(world)
        q = Q[rank].clone().requires_grad_()
        d = D[rank].clone().requires_grad_()
        s = ms.distributed.contrastive_scores(q, d, d_mask=M[rank])
        loss = _loss(s, sum(x.shape[0] for x in Q[:rank]))
        loss.backward()
        torch.save({"scores": s.detach(), "loss": loss.detach(), "gq": q.grad, "gd": d.grad},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_contrastive_scores_match_single_process(ms, tmp_path, world):
    mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    Q, D, M = _data(world)
    q_all = torch.cat(Q).requires_grad_()
    d_all = torch.cat(D).requires_grad_()
    s_all = ms.maxsim(q_all, d_all, d_mask=torch.cat(M))
    total = 0
    off = 0
    for r in range(world):
        total = total + _loss(s_all[off: off + Q[r].shape[0]], off)
        off += Q[r].shape[0]
    total.backward()
    qoff = doff = 0
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        nq, nd = Q[r].shape[0], D[r].shape[0]
        torch.testing.assert_close(res["scores"], s_all.detach()[qoff: qoff + nq], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["gq"], q_all.grad[qoff: qoff + nq], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res["gd"], d_all.grad[doff: doff + nd], rtol=1e-4, atol=1e-5)
        qoff += nq
        doff += nd


def test_needs_a_process_group(ms):
    with pytest.raises(RuntimeError, match="process group"):
        ms.distributed.contrastive_scores(torch.randn(1, 2, 4), torch.randn(1, 3, 4))
