"""FSDP2 (``fully_shard``) over lowprec layers on gloo (CPU processes) and on NCCL (one GPU per rank,
the FP8 kernels): a sharded training run
equals the same model trained data-parallel without sharding (each rank's local gradient, averaged
over the ranks: the FP8 weight gradient quantizes blocks of a rank's own tokens, so this, not one
process on the whole batch, is the sharded step's reference), and the state dict is DTensors."""

import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..hopper import gpu


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        from lowprec.moe import MoE

        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)
        self.moe = MoE(128, 64, num_experts=4, top_k=2)

    def forward(self, x):
        return self.moe(self.down(torch.relu(self.up(x))))


def _worker(rank, world, init_file, backend="gloo"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import lowprec

    device = "cuda" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    # NCCL: FP32 master weights on the GPU kernels; FSDP's reduce-scatter and the reference's
    # all-reduce may round their averages differently in the last bit
    tol = dict(rtol=1e-4, atol=1e-4) if backend == "nccl" else dict(rtol=1e-6, atol=1e-6)
    try:
        torch.manual_seed(0)
        model = lowprec.convert(_Block(), min_weight_numel=0).to(device)
        assert isinstance(model.up, lowprec.nn.FP8Linear)
        ref = copy.deepcopy(model)
        mesh = init_device_mesh(device, (world,))
        for layer in (model.up, model.down, model.moe):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(world * 12, 128, generator=g).to(device)
            dy = torch.randn(world * 12, 128, generator=g).to(device)
            mine = slice(rank * 12, (rank + 1) * 12)
            y = model(x[mine])
            (y * dy[mine]).sum().backward()
            opt.step()
            opt.zero_grad()
            y_ref = ref(x[mine])
            (y_ref * dy[mine]).sum().backward()
            for p in ref.parameters():  # data parallel: the local gradients averaged
                dist.all_reduce(p.grad)
                p.grad /= world
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(y, y_ref, **tol)
        state = model.state_dict()
        assert isinstance(state["up.weight"], DTensor) and isinstance(state["moe.w1"], DTensor)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name].full_tensor(), value, **tol)
    finally:
        dist.barrier()  # no rank leaves while another still runs a collective (full_tensor above)
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fully_shard_trains_as_data_parallel():
    """FP8Linear layers and an FP8 MoE under fully_shard on 2 ranks, three SGD steps."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fully_shard_on_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), "nccl"), nprocs=2, join=True)
