"""DDP and FSDP2 on one machine (gloo, 2 processes) with backend="hot"."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from tests import tolerances as tol
from tests.data import make
from tests.models import MLP

WORLD = 2
OPTIONS = {"policy": "hot", "strict": True, "rank": 16}


WRAPPINGS = ("ddp_of_compiled", "compiled_ddp", "fsdp2")


class Net(nn.Module):
    """User-defined classes throughout: Dynamo skips frames inside torch.nn after a graph break."""

    def __init__(self):
        super().__init__()
        self.body = MLP(32, 64, 32)
        self.head = MLP(32, 64, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _batch(rank: int) -> torch.Tensor:
    return make("smooth", 2 * 48, 32, seed=rank).reshape(2, 48, 32)


def _reference_grads() -> dict[str, torch.Tensor]:
    """fp64 eager gradients of the mean loss over both ranks' batches (what DDP averages to)."""
    torch.manual_seed(0)
    model = Net().double()
    loss = sum(model(_batch(r).double()).square().mean() for r in range(WORLD)) / WORLD
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _train_step(rank: int, wrapping: str) -> tuple[dict[str, torch.Tensor], int]:

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    if wrapping == "ddp_of_compiled":
        model = nn.parallel.DistributedDataParallel(torch.compile(net, backend="hot", options=OPTIONS))
    elif wrapping == "compiled_ddp":
        model = torch.compile(nn.parallel.DistributedDataParallel(net), backend="hot", options=OPTIONS)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(net.body)
        fully_shard(net.head)
        fully_shard(net)
        model = torch.compile(net, backend="hot", options=OPTIONS)
    before = torch._dynamo.utils.counters["hot"]["sites_rewritten"]
    model(_batch(rank)).square().mean().backward()
    rewritten = torch._dynamo.utils.counters["hot"]["sites_rewritten"] - before
    grads = {}
    for name, p in net.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    return grads, rewritten


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results = {}
        for wrapping in WRAPPINGS:
            # No compile caches: the wrappings compile the same graphs, and a cache hit would skip
            # the pass whose rewrite count this test checks.
            with torch._inductor.config.patch(force_disable_caches=True):
                grads, rewritten = _train_step(rank, wrapping)
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, grads)
            results[wrapping] = (gathered, rewritten)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dist") / "results.pt")
    mp.start_processes(_worker, args=(_free_port(), out), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


@pytest.mark.parametrize("wrapping", WRAPPINGS)
def test_distributed_grads_match_across_ranks_and_single_process(distributed_results, wrapping):
    gathered, rewritten = distributed_results[wrapping]
    assert rewritten > 0, "the HOT pass rewrote nothing in the distributed graphs"
    reference = _reference_grads()
    scale = max(r.norm() for r in reference.values())
    for name, ref in reference.items():
        assert torch.equal(gathered[0][name], gathered[1][name]), name
        if ref.norm() > 1e-9 * scale:
            err = ((gathered[0][name].double() - ref).norm() / ref.norm()).item()
            assert err < tol.E2E_GRAD, (name, err)
