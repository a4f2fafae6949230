"""The 8-bit wire of cquant's Ulysses exchange (CQUANT_ULYSSES_WIRE=int8, cquant.ulysses_wire): its
logit-error estimate against the 8-bit attention's, its output against float64 attention on 2 and
4 processes (gloo on the CPU, NCCL a process a GPU), and the calls where its bound fails or it cannot
carry them, which must cross in full precision: diffusers' template's output to the bit."""

import os
import secrets
import types

import numpy as np
import pytest

import cquant
from attention_oracle import attention_rows_f64, cosine, rel_l2
from helpers import spawn_ranks
from tolerances import ATTN_INT8_BOUND_REL, ATTN_INT8_MIN_COSINE, ULYSSES_WIRE_REL_L2

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

from cquant import ulysses, ulysses_wire  # noqa: E402
from cquant.bench.models import enable_parallelism  # noqa: E402

CPU_WORLDS = (2, 4)
SPAWN_TIMEOUT_S = 300
# (B, S, H, D, dtype) of the calls on each device; on 2 ranks each holds 2 heads (1 and 2 head groups
# differ), on 4 ranks one
CPU_SHAPES = {"f32": (2, 64, 4, 64, torch.float32), "bf16": (1, 96, 4, 32, torch.bfloat16)}
GPU_SHAPES = {"flux": (1, 4608, 24, 128, torch.bfloat16)}  # Flux at 1024x1024
CHECK_ROWS = 256  # query rows checked against float64 attention where a call has more


def _inputs(shape, seed, kind):
    """q, k, v [B, S, H, D]: randn, keys with a per-channel offset common to every token and values
    with channel means ("offset": E about 0.4 of the bound), the same keys with the offsets of the
    two halves apart ("split": E over the bound, as for the one-GPU 8-bit attention), or a NaN in q."""
    b, s, h, d, dtype = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    k += 8.0 * torch.randn(1, 1, h, d, generator=g)
    v += torch.randn(1, 1, h, d, generator=g)
    if kind == "split":
        k[:, s // 2:] += 24.0 * torch.randn(1, 1, h, d, generator=g)
    elif kind == "nan":
        q[0, 1, 0, 3] = float("nan")
    return tuple(t.to(dtype) for t in (q, k, v))


def _parallel_config(rank, device, world):
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ulysses_degree=world)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, world, device, mesh=mesh)
    return config


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=[8, 12, 12]).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 64, 8, generator=g),
                  encoder_hidden_states=torch.randn(1, 16, 32, generator=g),
                  pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.rand(1, generator=g),
                  img_ids=torch.randn(64, 3, generator=g), txt_ids=torch.randn(16, 3, generator=g))
    return model, inputs


def _worker(rank, init_file, out_dir, seed, device_type, world):
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("cpu:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cquant.register_attention_backends()
    config = _parallel_config(rank, device, world)
    results = {}

    def call(name, q, k, v, wire, return_lse=False, chunks=1, exchange="cquant"):
        os.environ.update({ulysses.SETTING: exchange, ulysses_wire.SETTING: wire, ulysses.CHUNKS_SETTING: str(chunks)})
        before = dict(ulysses_wire.calls)
        try:
            out = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": return_lse}, backend="cquant",
                                        parallel_config=config)
        finally:
            for key in (ulysses.SETTING, ulysses_wire.SETTING, ulysses.CHUNKS_SETTING):
                del os.environ[key]
        out = out[0] if return_lse else out
        results[name] = (out.cpu(), {w: ulysses_wire.calls[w] - before[w] for w in before})

    try:
        for shape_name, shape in (GPU_SHAPES if device_type == "cuda" else CPU_SHAPES).items():
            for kind in ("offset", "split", "nan"):
                q, k, v = (t.tensor_split(world, dim=1)[rank].to(device) for t in _inputs(shape, seed, kind))
                call((shape_name, kind, "template"), q, k, v, "bf16", exchange="diffusers")
                for chunks in (1, 2):
                    call((shape_name, kind, "int8", chunks), q, k, v, "int8", chunks=chunks)
                if kind == "offset":
                    call((shape_name, kind, "int8", "lse"), q, k, v, "int8", return_lse=True)
                    call((shape_name, kind, "int8", "auto"), q, k, v, "int8", exchange="auto")
        if device_type == "cpu":  # a whole (tiny) model, eagerly under inference mode, as is and fused
            from diffusers import ContextParallelConfig

            for case, fused in (("flux", False), ("flux_fused", True)):
                model, inputs = _tiny_flux()
                model.set_attention_backend("cquant")
                if fused:  # the single-stream block's MLP then runs beside the wire's all-to-alls
                    cquant.optimize(model)
                with torch.inference_mode():
                    one = model(**inputs, return_dict=False)[0]
                enable_parallelism(model, ContextParallelConfig(ulysses_degree=world))
                os.environ.update({ulysses.SETTING: "cquant", ulysses_wire.SETTING: "int8"})
                before = ulysses_wire.calls["int8"]
                try:
                    with torch.inference_mode():
                        parallel = model(**inputs, return_dict=False)[0].clone()  # the gather's result, waited for
                finally:
                    for key in (ulysses.SETTING, ulysses_wire.SETTING):
                        del os.environ[key]
                results[case] = (one, parallel, ulysses_wire.calls["int8"] - before)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn_run(d, device_type, world):
    seed = int(os.environ.get("CQUANT_TEST_SEED", secrets.randbits(32)))
    print(f"random seed: {seed} (repeat with CQUANT_TEST_SEED={seed})")
    spawn_ranks(_worker, (str(d / "init"), str(d), seed, device_type, world), world, SPAWN_TIMEOUT_S,
                f"8-bit wire run ({device_type}, {world} ranks)")
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return seed, {case: [r[case] for r in ranks] for case in ranks[0]}


@pytest.fixture(scope="module", params=CPU_WORLDS, ids=lambda n: f"{n}ranks")
def cpu_runs(tmp_path_factory, request):
    return _spawn_run(tmp_path_factory.mktemp("wire_cpu"), "cpu", request.param)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and cquant._C.built_with_cuda()):
        pytest.skip("needs 2 CUDA GPUs and a libcquant built with CUDA")
    world = 4 if torch.cuda.device_count() >= 4 else 2  # GPU_SHAPES' 24 heads split evenly either way
    return _spawn_run(tmp_path_factory.mktemp("wire_gpu"), "cuda", world)


def _whole(per_rank):
    return torch.cat([out for out, _ in per_rank], dim=1)


def _counts(per_rank):
    counts = [c for _, c in per_rank]
    assert all(c == counts[0] for c in counts)  # every rank takes the same exchange
    return counts[0]


def _check_runs(runs, shapes, auto_takes):
    seed, results = runs
    for name, shape in shapes.items():
        q, k, v = _inputs(shape, seed, "offset")
        rows = torch.arange(shape[1])
        if shape[1] > CHECK_ROWS:  # float64 attention of every row of a Flux call takes minutes
            rows = torch.randperm(shape[1], generator=torch.Generator().manual_seed(seed))[:CHECK_ROWS].sort().values
        ref = attention_rows_f64(q, k, v, shape[3] ** -0.5, rows)[0].numpy()
        for chunks in (1, 2):
            per_rank = results[name, "offset", "int8", chunks]
            assert _counts(per_rank) == {"int8": 1, "full": 0}
            out = _whole(per_rank)[:, rows].double().numpy()
            assert rel_l2(out, ref) <= ULYSSES_WIRE_REL_L2, (name, chunks, seed)
            assert cosine(out, ref) >= ATTN_INT8_MIN_COSINE, (name, chunks, seed)
        # under auto an eager call on CUDA takes the wire too, whatever the transport (on the CPU auto
        # leaves every call to the template)
        auto = results[name, "offset", "int8", "auto"]
        assert _counts(auto) == {"int8": int(auto_takes), "full": 0}
        expected = results[name, "offset", "int8", 1] if auto_takes else results[name, "offset", "template"]
        assert torch.equal(_whole(auto), _whole(expected))
        # the lse crosses in fp32 beside the output: such calls keep the full-precision exchange
        assert _counts(results[name, "offset", "int8", "lse"]) == {"int8": 0, "full": 0}
        assert torch.equal(_whole(results[name, "offset", "int8", "lse"]), _whole(results[name, "offset", "template"]))
        # where the bound fails (keys whose means differ along the sequence; a NaN) the call crosses in
        # full precision: the template's output to the bit (NaN where it has NaN)
        for kind in ("split", "nan"):
            template = _whole(results[name, kind, "template"])
            for chunks in (1, 2):
                per_rank = results[name, kind, "int8", chunks]
                assert _counts(per_rank) == {"int8": 0, "full": 1}, (name, kind, chunks)
                assert torch.equal(_whole(per_rank).nan_to_num(7.0), template.nan_to_num(7.0)), (name, kind, chunks)


@pytest.mark.raises_in_torch_op
def test_wire_on_cpu_processes(cpu_runs):
    _check_runs(cpu_runs, CPU_SHAPES, auto_takes=False)


@pytest.mark.raises_in_torch_op
@pytest.mark.parametrize("case", ["flux", "flux_fused"])
def test_wire_runs_a_model(cpu_runs, case):
    """A tiny Flux, as diffusers builds it and with cquant's fused blocks (whose single-stream MLP
    runs while the codes travel), under Ulysses with the 8-bit wire: the one process's output."""
    seed, results = cpu_runs
    taken = results[case][0][2]
    assert taken == 2  # the double-stream and the single-stream block
    for one, parallel, _ in results[case]:  # the model gathers its output on every rank
        assert rel_l2(parallel.double().numpy(), one.double().numpy()) <= ULYSSES_WIRE_REL_L2


@pytest.mark.cuda
def test_wire_on_gpus(gpu_runs):
    _check_runs(gpu_runs, GPU_SHAPES, auto_takes=True)


def _head_stats(x, mean=None):
    """[B, H, 2]: each head's largest row scale and decoded-row norm over the tokens of x [B, S, H, D]
    (less mean [B, H, D]), as the wire's encode gives them."""
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales, norms = torch.empty(x.shape[:-1]), torch.empty(x.shape[:-1])
    cquant.ops.wire_encode(x, codes, scales, mean=None if mean is None else mean[:, None].expand(x.shape), norms=norms)
    return torch.stack((scales.amax(1), norms.amax(1)), -1)


def _one_rank_stats(q, k):
    kmean = k.mean(dim=1, dtype=torch.float32)
    return torch.cat((_head_stats(q), _head_stats(k, kmean), kmean), -1)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_logit_error_is_the_8bit_attentions_estimate(d):
    """On one rank the wire's E is the 8-bit attention's with a scale a row (q_block = k_block = 1),
    up to its bound on a decoded row's norm: |x| + sq sqrt(D) / 2 where the codes give |x| +- that,
    and |x| >= amax = 127 sq, so at most (1 + r) / (1 - r) times E, r = sqrt(D) / 254."""
    g = torch.Generator().manual_seed(d)
    q, k = (torch.randn(2, 96, 3, d, generator=g) for _ in range(2))
    k += 5.0 * torch.randn(1, 1, 3, d, generator=g)
    scale = d ** -0.5
    ref = torch.from_numpy(np.asarray(cquant.ops.attention_int8_logit_error(q, k, scale, 1, 1)))
    e = ulysses_wire.logit_error(torch, _one_rank_stats(q, k)[None], scale)
    r = d ** 0.5 / 254
    assert (e >= ref * (1 - ATTN_INT8_BOUND_REL)).all() and (e <= ref * (1 + r) / (1 - r)).all()


def test_logit_error_counts_the_ranks_key_means():
    """Keys whose mean differs between the ranks' halves: the rounding of q shifts one half's logits
    against the other's, a term the one-rank statistics do not have (and the one-GPU 8-bit
    attention sees in its smoothed keys): E over 2 ranks stays within the one-rank E of the whole."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 128, 2, 64, generator=g) for _ in range(2))
    k[:, 64:] += 8.0 * torch.randn(1, 1, 2, 64, generator=g)
    halves = torch.stack([_one_rank_stats(q[:, i * 64:(i + 1) * 64], k[:, i * 64:(i + 1) * 64]) for i in range(2)])
    without_means = halves.clone()
    without_means[..., 4:] = 0
    e, local = ulysses_wire.logit_error(torch, halves, 0.125), ulysses_wire.logit_error(torch, without_means, 0.125)
    whole = ulysses_wire.logit_error(torch, _one_rank_stats(q, k)[None], 0.125)
    assert (e > 2 * local).all() and (e <= whole).all()


def test_wire_setting(monkeypatch):
    monkeypatch.delenv(ulysses_wire.SETTING, raising=False)
    assert ulysses_wire.setting() == "bf16"
    monkeypatch.setenv(ulysses_wire.SETTING, " INT8 ")
    assert ulysses_wire.setting() == "int8"
    monkeypatch.setenv(ulysses_wire.SETTING, "fp4")
    with pytest.raises(ValueError, match="CQUANT_ULYSSES_WIRE='fp4'; expected one of bf16, int8"):
        ulysses_wire.setting()


def test_wire_takes():
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    assert ulysses_wire.takes(q, q, q, False)
    assert not ulysses_wire.takes(q, q, q, True)  # the lse
    odd = torch.zeros(1, 8, 4, 30, dtype=torch.bfloat16)  # D = 30: the scales would not be 4-byte aligned
    assert not ulysses_wire.takes(odd, odd, odd, False)
    assert not ulysses_wire.takes(q, q, q.float(), False)


def test_auto_selects_eager_nccl_calls_for_the_wire(monkeypatch):
    """CQUANT_ULYSSES=auto leaves eager calls that only NCCL carries to diffusers' template, but for
    the 8-bit wire, which serves exactly those; "diffusers" still never takes them."""
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                            is_current_stream_capturing=lambda: False))
    monkeypatch.delenv(ulysses.SETTING, raising=False)
    monkeypatch.setenv(cquant.peer_memory.TRANSPORT_SETTING, "nccl")
    monkeypatch.delenv(ulysses_wire.SETTING, raising=False)
    assert not ulysses.selected(fake)
    monkeypatch.setenv(ulysses_wire.SETTING, "int8")
    assert ulysses.selected(fake)
    monkeypatch.setenv(ulysses.SETTING, "diffusers")
    assert not ulysses.selected(fake)
