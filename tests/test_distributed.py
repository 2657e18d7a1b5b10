"""maxsim.distributed on 2-3 gloo processes (CPU), and on NCCL when the
machine has the GPUs, against one process on the concatenated batch: scores,
loss and gradients; sharded search against search on the whole corpus."""

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


BACKENDS = [("gloo", 2), ("gloo", 3)]
if torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available():
    BACKENDS.append(("nccl", 2))


def _worker(rank: int, world: int, port: int, out_dir: str, backend: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        import kernels

        ms = kernels.get_local_kernel(ROOT)
        Q, D, M = _data(world)
        q = Q[rank].clone().to(dev).requires_grad_()
        d = D[rank].clone().to(dev).requires_grad_()
        s = ms.distributed.contrastive_scores(q, d, d_mask=M[rank].to(dev))
        loss = _loss(s.cpu(), sum(x.shape[0] for x in Q[:rank]))
        loss.backward()
        # sharded search: rank r holds shard r of the search corpus
        docs, off, queries = _search_data()
        lo, hi = _shard(world, rank)
        shard_docs = docs[off[lo]:off[hi]].to(dev)
        shard_off = (off[lo:hi + 1] - off[lo]).to(dev)
        ss, si = ms.distributed.search(queries.to(dev), (shard_docs, shard_off), 9)
        torch.save({"scores": s.detach().cpu(), "loss": loss.detach(), "gq": q.grad.cpu(), "gd": d.grad.cpu(),
                    "search": (ss.cpu(), si.cpu())}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _search_data():
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 20, (50,), generator=g)
    lens[7] = lens[3]
    off = torch.zeros(51, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    docs = torch.nn.functional.normalize(torch.randn(int(off[-1]), 16, generator=g), dim=-1)
    docs[off[7]:off[8]] = docs[off[3]:off[4]]  # an exact tie across the shard border
    queries = torch.nn.functional.normalize(torch.randn(4, 6, 16, generator=g), dim=-1)
    return docs, off, queries


def _shard(world: int, rank: int):
    cuts = [0, 5, 30, 50] if world == 3 else [0, 5, 50]  # unequal shards
    return cuts[rank], cuts[rank + 1]


@pytest.mark.parametrize("backend,world", BACKENDS)
def test_contrastive_scores_match_single_process(ms, tmp_path, backend, world):
    mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path), backend), nprocs=world, join=True,
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
    # sharded search == search over the whole corpus (exact ids, ties to the lower id)
    docs, off, queries = _search_data()
    ref_s, ref_i = ms.search(queries, (docs, off), 9)
    for r in range(world):
        ss, si = torch.load(tmp_path / f"rank{r}.pt")["search"]
        assert torch.equal(si, ref_i)
        torch.testing.assert_close(ss, ref_s, rtol=1e-5, atol=1e-5)


def test_needs_a_process_group(ms):
    with pytest.raises(RuntimeError, match="process group"):
        ms.distributed.contrastive_scores(torch.randn(1, 2, 4), torch.randn(1, 3, 4))
    with pytest.raises(RuntimeError, match="process group"):
        ms.distributed.search(torch.randn(1, 2, 4), (torch.randn(3, 4), torch.tensor([0, 3])), 1)
