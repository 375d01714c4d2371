"""FSDP2 (``fully_shard``) over lowprec layers on gloo (CPU processes) and on NCCL (one GPU per rank,
the FP8 kernels): a sharded training run
equals the same model trained data-parallel without sharding (each rank's local gradient, averaged
over the ranks: the FP8 weight gradient quantizes blocks of a rank's own tokens, so this, not one
process on the whole batch, is the sharded step's reference), and the state dict is DTensors."""

import copy
import datetime
import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import lowprec
from lowprec.nn import SwiGLUMLP, enable_fp8_all_gather

from ..distributed import rank_body
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


def _init_group(rank, world, init_file, backend) -> str:
    """Join the test's process group (NCCL: one GPU per rank); returns the rank's device."""
    device = "cuda" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return device


def _worker(rank, world, init_file, backend="gloo"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import lowprec

    device = _init_group(rank, world, init_file, backend)
    # NCCL: FP32 master weights on the GPU kernels; FSDP's reduce-scatter and the reference's
    # all-reduce may round their averages differently in the last bit
    tol = dict(rtol=1e-4, atol=1e-4) if backend == "nccl" else dict(rtol=1e-6, atol=1e-6)
    with rank_body():
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


def _train_alike(plain, fp8, rank, world, device):
    """Three AdamW steps of both sharded models on the rank's share of the same batches: outputs
    and input gradients bit-identical at every step (the same codes and scales, gathered either way)."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, fp8)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world * 16, 128, generator=g)[rank * 16:(rank + 1) * 16].to(device)
        dy = torch.randn(world * 16, 128, generator=g)[rank * 16:(rank + 1) * 16].to(device)
        ys, dxs = [], []
        for model, opt in zip((plain, fp8), opts):
            xr = x.clone().requires_grad_()
            y = model(xr)
            (y * dy).sum().backward()
            opt.step()
            opt.zero_grad()
            ys.append(y)
            dxs.append(xr.grad)
        assert torch.equal(ys[0], ys[1]) and torch.equal(dxs[0], dxs[1])


def _fp8_gather_worker(rank, world, init_file, backend="gloo"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowprec
    from lowprec.moe import MoE
    from lowprec.nn import FP8AllGatherWeight, FP8GatheredWeight, enable_fp8_all_gather

    device = _init_group(rank, world, init_file, backend)
    with rank_body():
        torch.manual_seed(0)
        # 256 rows: shards of 128 (whole 128x128 blocks: gathered in FP8; the middle one's input
        # gradient multiplies by its transposed codes); 128 rows: shards of 64 (plain); the MoE's
        # expert weights: shards of 2 whole experts (FP8)
        layers = [nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128),
                  MoE(128, 64, num_experts=4, top_k=2)]
        plain = lowprec.convert(nn.Sequential(*layers), min_weight_numel=0).to(device)
        fp8 = copy.deepcopy(plain)
        assert enable_fp8_all_gather(fp8) == 5
        mesh = init_device_mesh(device, (world,))
        for model in (plain, fp8):
            for layer in (model[0], model[2], model[4], model[5]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        assert isinstance(fp8[0].weight.to_local(), FP8AllGatherWeight)
        seen = []
        for layer in (fp8[0], fp8[2], fp8[4]):
            layer.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
        fp8[5].register_forward_pre_hook(lambda m, args: seen.extend([type(m.w1), type(m.w2)]))
        _train_alike(plain, fp8, rank, world, device)
        assert seen[:5] == [FP8GatheredWeight, FP8GatheredWeight, nn.Parameter, FP8GatheredWeight,
                            FP8GatheredWeight], seen
        for name, value in plain.state_dict().items():
            assert torch.equal(fp8.state_dict()[name].full_tensor(), value.full_tensor()), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_all_gather_trains_as_the_plain_one():
    """enable_fp8_all_gather: FP8Linear and MoE expert weights travel as E4M3 codes and 128x128
    scales where a shard holds whole blocks, and training is bit-identical to the plain
    all-gather's."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fp8_gather_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_all_gather_on_nccl():
    """The same on NCCL and the GPU kernels: the codes each rank quantizes from its shard are those
    the plain path's layer quantizes from the gathered weight (whole 128x128 blocks)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fp8_gather_worker, args=(2, os.path.join(tmp, "init"), "nccl"), nprocs=2, join=True)


def _fused_mlp_gather_worker(rank, world, init_file, backend="gloo"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowprec
    from lowprec.nn import FP8GatheredWeight, FP8SwiGLUMLP, SwiGLUMLP, enable_fp8_all_gather

    device = _init_group(rank, world, init_file, backend)
    with rank_body():
        torch.manual_seed(0)
        plain = lowprec.convert(SwiGLUMLP(128, 256), min_weight_numel=0).to(device)  # shards of 128 / 64 rows
        assert isinstance(plain, FP8SwiGLUMLP)
        fp8 = copy.deepcopy(plain)
        assert enable_fp8_all_gather(fp8) == 3
        mesh = init_device_mesh(device, (world,))
        for model in (plain, fp8):
            fully_shard(model, mesh=mesh)
        seen = []
        fp8.register_forward_pre_hook(lambda m, args: seen.extend(
            type(getattr(m, n).weight) for n in ("gate_proj", "up_proj", "down_proj")))
        _train_alike(plain, fp8, rank, world, device)
        # gate / up: 256 rows, shards of 128 (whole blocks, FP8); down: 128 rows, shards of 64 (plain)
        assert seen[:3] == [FP8GatheredWeight, FP8GatheredWeight, nn.Parameter], seen
        for name, value in plain.state_dict().items():
            assert torch.equal(fp8.state_dict()[name].full_tensor(), value.full_tensor()), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp8_all_gather_of_a_fused_swiglu_mlp():
    """enable_fp8_all_gather wraps FP8SwiGLUMLP's three weights (dotted names); training under
    fully_shard is bit-identical to the plain all-gather's."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fused_mlp_gather_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def test_fp8_all_gather_weights_outside_fsdp(tmp_path):
    """Without FSDP the wrapped weight trains as the master weight (same bits through AdamW, and
    under torch.compile), the state dict holds the plain master weight (lowprec.save / load round trip), and a gathered
    weight (codes and scales) multiplies as the weight it was quantized from."""
    import lowprec
    from lowprec.nn import FP8AllGatherWeight, FP8GatheredWeight, enable_fp8_all_gather, fp8_linear

    torch.manual_seed(0)
    plain = lowprec.convert(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)), min_weight_numel=0)
    wrapped = copy.deepcopy(plain)
    assert enable_fp8_all_gather(wrapped) == 2 and enable_fp8_all_gather(wrapped) == 0
    assert isinstance(wrapped[0].weight, FP8AllGatherWeight) and isinstance(wrapped[0].weight, nn.Parameter)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    for _ in range(2):
        x = torch.randn(8, 128, requires_grad=True)
        outs = []
        for model, opt in zip((plain, wrapped), opts):
            xr = x.detach().clone().requires_grad_()
            y = model(xr)
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append((y, xr.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # torch.compile traces the wrapped weights (fullgraph); a function of this test's own, so the
    # compile cache is not that of nn.Sequential.forward, which other tests compile too
    x = torch.randn(8, 128)
    compiled = torch.compile(lambda t: wrapped(t), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), plain(x))
    state = wrapped.state_dict()
    assert type(state["0.weight"]) is torch.Tensor and torch.equal(state["0.weight"], plain[0].weight)
    lowprec.save(state, tmp_path / "m.safetensors")
    fresh = copy.deepcopy(wrapped)
    with torch.no_grad():
        fresh[0].weight.zero_()
    fresh.load_state_dict(lowprec.load(tmp_path / "m.safetensors"))
    assert torch.equal(fresh[0].weight.hp, plain[0].weight)

    w = plain[0].weight.detach()
    q = lowprec.quantize(w, "fp8_block128x128")
    gathered = nn.Parameter(FP8GatheredWeight(q.data.view(torch.uint8), q.scale, w.shape, w.dtype))
    x = torch.randn(4, 128, requires_grad=True)
    y = fp8_linear(x, gathered)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    y_ref = fp8_linear(x_ref, w_ref)
    y_ref.sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad) and torch.equal(gathered.grad, w_ref.grad)
    assert type(gathered.grad) is torch.Tensor


def _inference_worker(rank, world, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowprec

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    with rank_body():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64))
        for recipe in ("fp8_block", "nvfp4"):
            model = copy.deepcopy(base)
            lowprec.convert(model, recipe, inference=True, min_weight_numel=0, filter_fn=lambda name, m: name != "4")
            kind = lowprec.nn.FP8InferenceLinear if recipe == "fp8_block" else lowprec.nn.NVFP4InferenceLinear
            assert isinstance(model[0], kind) and isinstance(model[2], kind) and type(model[4]) is nn.Linear
            ref = copy.deepcopy(model)
            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model[4], mesh=mesh)  # the one layer with parameters; the FP8 / NVFP4 buffers stay whole
            fully_shard(model, mesh=mesh)
            x = torch.randn(6, 128, generator=torch.Generator().manual_seed(rank))
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
            state = model.state_dict()
            for name, value in ref.state_dict().items():
                got = state[name]
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                   value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inference_layers_under_fully_shard():
    """FP8InferenceLinear and NVFP4InferenceLinear (buffers, no parameters) in a model under
    fully_shard on 2 ranks: the outputs and state dict of the unsharded model."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_inference_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def _spawn(worker, *args):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(2, os.path.join(tmp, "init"), *args), nprocs=2, join=True)


def _steps_alike(models, rank, world, features, steps, seed=1, loss=lambda y: y.square().sum(), optimizer=None):
    """``steps`` SGD (or ``optimizer``) steps of each model on the same rank-sliced batches; the
    outputs of every model at every step, bit for bit those of the first."""
    opts = [(optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)))(m.parameters()) for m in models]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(world * 8, features, generator=g)[rank * 8:(rank + 1) * 8]
        outs = []
        for model, opt in zip(models, opts):
            y = model(x)
            loss(y).backward()
            opt.step()
            opt.zero_grad()
            outs.append(y)
        for y in outs[1:]:
            torch.testing.assert_close(y, outs[0], rtol=0, atol=0, msg=lambda m, s=step: f"step {s}: {m}")


def _mixed_precision_plain_path_worker(rank, world, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import lowprec
    from lowprec.nn import enable_fp8_all_gather

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        torch.manual_seed(0)
        # 128 rows: shards of 64 rows would split 128x128 blocks, so the plain all-gather
        plain = lowprec.convert(nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)),
                                min_weight_numel=0)
        fp8 = copy.deepcopy(plain)
        assert enable_fp8_all_gather(fp8) == 2
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for model in (plain, fp8):
            fully_shard(model[2], mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
        _steps_alike((plain, fp8), rank, world, 128, 3, loss=lambda y: y.float().square().sum())


def test_fp8_all_gather_plain_path_under_bf16_params_sees_each_step():
    """A weight whose shards would split a block takes the plain all-gather; under a bf16
    param_dtype it kept the first all-gather's bf16 copy (stale weights from the first step)."""
    _spawn(_mixed_precision_plain_path_worker)


class _TiedLinears(nn.Module):
    def __init__(self, size=128):
        super().__init__()
        from lowprec.nn import FP8Linear

        self.a = FP8Linear(size, size, bias=False, recipe="fp8_block")
        self.b = FP8Linear(size, size, bias=False, recipe="fp8_block")
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        from lowprec.nn import FP8Linear

        self.emb = nn.Embedding(256, 128)
        self.head = FP8Linear(128, 256, bias=False, recipe="fp8_block")
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


@pytest.mark.parametrize("cls", [_TiedLinears, _TiedHead])
def test_enable_fp8_all_gather_keeps_tied_weights_tied(cls):
    """One wrapper per tied weight (a new parameter per owner made two, each stepped by the
    optimizer); a weight tied to an embedding keeps the plain all-gather."""
    from lowprec.nn import enable_fp8_all_gather

    torch.manual_seed(0)
    plain = cls()
    wrapped = copy.deepcopy(plain)
    enable_fp8_all_gather(wrapped)
    assert len(list(wrapped.parameters())) == len(list(plain.parameters())) == 1
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 128, generator=g) if cls is _TiedLinears else torch.randint(0, 256, (8,), generator=g)
        outs = []
        for model, opt in zip((plain, wrapped), opts):
            y = model(x)
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y)
        assert torch.equal(outs[0], outs[1])


def _tied_worker(rank, world, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lowprec.nn import FP8GatheredWeight, enable_fp8_all_gather

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        torch.manual_seed(0)
        plain = _TiedLinears(256)  # shards of 128 rows: the FP8 all-gather
        fp8 = copy.deepcopy(plain)
        enable_fp8_all_gather(fp8)
        mesh = init_device_mesh("cpu", (world,))
        for model in (plain, fp8):
            fully_shard(model, mesh=mesh)
        seen = []
        fp8.a.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
        _steps_alike((plain, fp8), rank, world, 256, 3, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
        assert seen[0] is FP8GatheredWeight and fp8.a.weight is fp8.b.weight


def test_tied_weights_under_fully_shard_with_fp8_all_gather():
    _spawn(_tied_worker)


def _make_sharded(fp8_all_gather, mesh):
    from torch.distributed.fsdp import fully_shard

    import lowprec
    from lowprec.moe import MoE
    from lowprec.nn import enable_fp8_all_gather

    model = lowprec.convert(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128), MoE(128, 64, 4, 2)),
                            min_weight_numel=0)
    if fp8_all_gather:
        enable_fp8_all_gather(model)
    fully_shard(model, mesh=mesh)
    return model


def _dcp_worker(rank, world, init_file, ckpt, fresh_fp8):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = _make_sharded(True, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        opt.step()
        dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
        torch.manual_seed(1)
        fresh = _make_sharded(fresh_fp8, mesh)
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=ckpt)
        set_model_state_dict(fresh, state)
        saved, loaded = model.state_dict(), fresh.state_dict()
        for name, value in saved.items():
            assert torch.equal(loaded[name].full_tensor(), value.full_tensor()), name
        with torch.no_grad():
            assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("fresh_fp8", [True, False])
def test_distributed_checkpoint_of_a_sharded_fp8_all_gather_model(fresh_fp8):
    """The checkpoint holds plain tensors (it pickled FP8AllGatherWeight: dcp.load's weights-only
    unpickler refused it) and loads into a fresh sharded model, with or without the FP8 all-gather."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dcp_worker, args=(2, os.path.join(tmp, "init"), os.path.join(tmp, "ckpt"), fresh_fp8), nprocs=2,
                 join=True)


def _uneven_worker(rank, world, init_file, case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import lowprec
    from lowprec.moe import MoE
    from lowprec.nn import enable_fp8_all_gather

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        torch.manual_seed(0)
        kwargs, features = {}, 128
        if case == "3 experts":
            plain = MoE(128, 64, num_experts=3, top_k=2)
        elif case == "1 expert":
            plain = MoE(128, 64, num_experts=1, top_k=1)
        else:  # the matrices sharded along their columns
            plain, features = lowprec.convert(nn.Sequential(nn.Linear(256, 256)), min_weight_numel=0), 256
            kwargs = dict(shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
        fp8 = copy.deepcopy(plain)
        assert enable_fp8_all_gather(fp8) > 0
        mesh = init_device_mesh("cpu", (world,))
        for model in (plain, fp8):
            fully_shard(model, mesh=mesh, **kwargs)
        _steps_alike((plain, fp8), rank, world, features, 2)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(fp8.state_dict()[name].full_tensor(), value.full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["3 experts", "1 expert", "column shards"])
def test_fp8_all_gather_of_unevenly_or_column_sharded_weights(case):
    """Every rank picks the same path from the full shape and pads a short shard as FSDP does (it
    raised FSDP's padded-size assertion on the short rank while the other hung, or failed a view)."""
    _spawn(_uneven_worker, case)


def _sharded_fp8_linear(world, **fsdp_options) -> nn.Module:
    """One 128 -> 256 FP8Linear under fully_shard on this process group's CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowprec

    torch.manual_seed(0)
    model = lowprec.convert(nn.Sequential(nn.Linear(128, 256)), min_weight_numel=0)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), **fsdp_options)
    return model


def _enable_after_shard_worker(rank, world, init_file, forward_first):
    from lowprec.nn import enable_fp8_all_gather

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        model = _sharded_fp8_linear(world)
        if forward_first:
            model(torch.randn(4, 128))
        with pytest.raises(ValueError, match="before fully_shard"):
            enable_fp8_all_gather(model)
        model(torch.randn(4, 128)).sum().backward()  # left as it was: it still trains


@pytest.mark.parametrize("forward_first", [False, True])
def test_enable_fp8_all_gather_after_fully_shard_is_a_clear_error(forward_first):
    """Not an AttributeError inside FSDP's lazy init, nor a segfault after a forward."""
    _spawn(_enable_after_shard_worker, forward_first)


def _reuse_worker(rank, world, init_file, reshard_after_forward):
    from lowprec.nn import fp8_linear, reuse_quantized_weights

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        model = _sharded_fp8_linear(world, reshard_after_forward=reshard_after_forward)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
        with reuse_quantized_weights():
            for _ in range(2):  # two steps of two micro-batches
                for _ in range(2):
                    model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            y_inside = model(x)
        state = model.state_dict()  # the stepped weights, gathered: an independent forward
        w, b = state["0.weight"].full_tensor(), state["0.bias"].full_tensor()
        torch.testing.assert_close(y_inside, fp8_linear(x, w, b, model[0].recipe), rtol=0, atol=0)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_reuse_quantized_weights_sees_an_optimizer_step_under_fsdp(reshard_after_forward):
    """FSDP2 refills the unsharded weight without a version bump: the block reused the FP8 copy
    of the weight before the step."""
    _spawn(_reuse_worker, reshard_after_forward)


@pytest.mark.parametrize("kw", [{"recipe": "fp8_rowwise"}, {"recipe": "fp8_block", "fuse_mlp": False},
                                {"recipe": "fp8_rowwise", "filter_fn": lambda n, m: "down" not in n}])
def test_state_dict_plain_after_unfusing_a_gathered_mlp(tmp_path, kw):
    """The state dict holds the master weights themselves (enable_fp8_all_gather's promise), also
    after convert() unfuses the MLP whose layers' weights were wrapped."""
    model = torch.nn.Sequential(SwiGLUMLP(128, 256))
    lowprec.convert(model, min_weight_numel=0)
    assert enable_fp8_all_gather(model) == 3
    lowprec.convert(model, min_weight_numel=0, **kw)
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values()), {k: type(v).__name__ for k, v in sd.items()}
    lowprec.save(sd, tmp_path / "m.safetensors")
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert list(torch.load(buf, weights_only=True)) == list(sd)


def test_state_dict_keep_vars_gives_the_wrapped_parameters():
    """state_dict(keep_vars=True) (torch.jit.trace, transformers' loading: they mark or collect the
    parameters themselves) holds the parameters, as for a plain model: the plain-tensor rewrite is
    for savers; it gave a detached copy without grad or requires_grad."""
    model = lowprec.convert(nn.Sequential(nn.Linear(128, 128), SwiGLUMLP(128, 256)), min_weight_numel=0)
    assert enable_fp8_all_gather(model) == 4
    model(torch.randn(4, 128)).sum().backward()
    sd = model.state_dict(keep_vars=True)
    params = dict(model.named_parameters())
    assert all(sd[name] is p for name, p in params.items()), {k: type(v).__name__ for k, v in sd.items()}
    assert sd["0.weight"].requires_grad and sd["0.weight"].grad is not None
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())  # plain for savers, as before


def test_data_assignment_to_a_wrapped_weight_is_seen():
    """``weight.data = t`` on a wrapped weight (a cast back included) makes ``t`` the master weight
    (was: the wrapper took t's shape and dtype but every op, the layer's forward too, read the old
    one)."""
    from lowprec.nn import FP8AllGatherWeight, fp8_linear

    torch.manual_seed(0)
    layer = lowprec.convert(nn.Linear(256, 128, bias=False), "fp8_block")
    assert enable_fp8_all_gather(layer) == 1
    x = torch.randn(4, 256)
    new = torch.randn(128, 256)
    layer.weight.data = new
    assert torch.equal(layer(x), fp8_linear(x, new, recipe=layer.recipe))
    layer.weight.data = new.half()
    assert isinstance(layer.weight, FP8AllGatherWeight) and layer.weight.hp.dtype == torch.float16
    assert torch.equal(layer.weight.float(), new.half().float()) and layer.weight.requires_grad


def test_fp8_all_gather_on_a_one_rank_mesh_trains_as_unsharded():
    # FSDP2 skips the all-gather on one rank and hands on only the first all-gather input
    from torch.distributed.fsdp import fully_shard

    from lowprec.nn import FP8Linear

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = nn.Sequential(FP8Linear(128, 256, recipe="fp8_block"), nn.ReLU(),
                                  FP8Linear(256, 128, recipe="fp8_block"))
            ref = copy.deepcopy(model)
            x = torch.randn(8, 128)
            assert enable_fp8_all_gather(model) == 2
            fully_shard(model)
            for _ in range(2):  # the second unshard refills the first one's buffers
                y, y_ref = model(x), ref(x)
                torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
                y.square().mean().backward()
                y_ref.square().mean().backward()
                for p, q in zip(model.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=0)
                    with torch.no_grad():
                        p.sub_(0.1 * p.grad)
                        q.sub_(0.1 * q.grad)
                    p.grad = q.grad = None
        finally:
            dist.destroy_process_group()


def _inplace_output_worker(rank, world, init_file):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        torch.manual_seed(0)
        model = lowprec.convert(nn.Sequential(nn.Linear(128, 128), SwiGLUMLP(128, 256)), "fp8_block",
                                min_weight_numel=0)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        x = torch.randn(16, 128)
        for layer in model:
            out = layer(x)
            out += 1.0  # in place on a sharded module's output (a residual add), fine for nn.Linear
            out.sum().backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_an_in_place_op_on_a_sharded_layers_output_keeps_its_gradients():
    """FSDP2 hooks a sharded module's output for its backward: an output that is a view (an
    in-place op on it drops the hook) left the weights without their sharded gradients."""
    _spawn(_inplace_output_worker)


def _gathered_models():
    from lowprec.moe import MoE

    return {"linear": lambda: nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)),
            "fused mlp": lambda: nn.Sequential(SwiGLUMLP(128, 256)),
            "moe": lambda: nn.Sequential(MoE(128, 64, num_experts=4, top_k=2))}


@pytest.mark.parametrize("kind", ["linear", "fused mlp", "moe"])
def test_load_state_dict_assign_keeps_the_fp8_all_gather(kind):
    """load_state_dict(assign=True) (a meta-device skeleton filled from a checkpoint) made the plain
    loaded tensors the parameters: the FP8 all-gather was silently off. The loaded weights are wrapped;
    the caller's state dict is left as it was, and the model trains as the one it was saved from."""
    from lowprec.nn import FP8AllGatherWeight

    torch.manual_seed(0)
    trained = lowprec.convert(_gathered_models()[kind](), min_weight_numel=0)
    wrapped_before = enable_fp8_all_gather(trained)
    state = {name: value.detach().clone() for name, value in trained.state_dict().items()}
    with torch.device("meta"):
        skeleton = lowprec.convert(_gathered_models()[kind](), min_weight_numel=0)
    assert enable_fp8_all_gather(skeleton) == wrapped_before > 0
    skeleton.load_state_dict(state, assign=True)
    gathered = {name for name, p in skeleton.named_parameters() if isinstance(p, FP8AllGatherWeight)}
    assert gathered == {name for name, p in trained.named_parameters() if isinstance(p, FP8AllGatherWeight)}
    assert all(type(value) is torch.Tensor for value in state.values())
    assert all(type(value) is torch.Tensor for value in skeleton.state_dict().values())
    x = torch.randn(8, 128)
    for model in (trained, skeleton):
        model(x).square().sum().backward()
    for (name, p), q in zip(skeleton.named_parameters(), trained.parameters()):
        assert not p.is_meta and torch.equal(p, q) and torch.equal(p.grad, q.grad), name


def _load_assign_worker(rank, world, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lowprec.nn import FP8AllGatherWeight, FP8GatheredWeight

    _init_group(rank, world, init_file, "gloo")
    with rank_body():
        torch.manual_seed(0)
        plain = lowprec.convert(_gathered_models()["linear"](), min_weight_numel=0)  # shards of 128 rows: FP8
        fp8 = copy.deepcopy(plain)
        enable_fp8_all_gather(fp8)
        mesh = init_device_mesh("cpu", (world,))
        for model in (plain, fp8):
            fully_shard(model, mesh=mesh)
        fp8.load_state_dict({name: value.detach().clone() for name, value in fp8.state_dict().items()}, assign=True)
        assert isinstance(fp8[0].weight.to_local(), FP8AllGatherWeight)
        seen = []
        fp8[0].register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
        _steps_alike((plain, fp8), rank, world, 128, 2)
        assert seen == [FP8GatheredWeight] * 2, seen


def test_load_state_dict_assign_under_fully_shard_keeps_the_fp8_all_gather():
    """The sharded state dict (DTensors over plain shards) loaded with assign=True: the shards are
    wrapped again, and the next steps gather FP8 codes, bit-identical to the plain all-gather."""
    _spawn(_load_assign_worker)
