"""cquant's diffusers attention backends under context parallelism: diffusers' ring and Ulysses
templates (diffusers/models/attention_dispatch.py) with "cquant" / "cquant_int8" as the attention
of each shard, on 2 processes.

CPU: torch.distributed's gloo backend (as "cpu:gloo", see _cpu_worker), which runs every
collective the templates and the context-parallel hooks use with equal shards (all_gather_tensor,
all_to_all_single, all_gather, permute_tensor). Starting processes and importing diffusers costs
seconds, so one spawn runs every CPU case; each rank saves its shard of every result and the
tests compare the whole against float64 attention (or the one-process model) here. The one thing
gloo cannot run is the model-level gather of uneven output shards ("_anything" modes): that test
skips, naming it. GPU (2 cards, NCCL): a Flux-size call, ring and Ulysses, both backends, against
one-GPU cquant and SDPA.
"""

import os
import secrets
import types
import warnings

import numpy as np
import pytest

import cquant
from attention_oracle import attention_f64, attention_rows_f64, cosine, rel_l2
from helpers import spawn_ranks
from tolerances import (ATTN_CUDA_LSE_ABS, ATTN_CUDA_REL_L2_FLOOR, ATTN_CUDA_VS_SDPA_FACTOR, ATTN_INT8_LSE_ABS,
                        ATTN_INT8_MERGE_ORDER_ULPS, ATTN_INT8_MERGE_ORDER_VALUE_UNITS, ATTN_INT8_MIN_COSINE,
                        ATTN_INT8_REL_L2, ATTN_MODEL_FULL_REL_L2, ATTN_MODEL_INT8_REL_L2, ATTN_REF_LSE_ABS,
                        ATTN_REF_REL_L2, ATTN_RING_REL_L2, OUTPUT_UNIT_ROUNDOFF)

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

from cquant.bench.models import enable_parallelism  # noqa: E402

WORLD = 2  # ranks of the GPU run on 2 or 3 GPUs (on 4 or more: 4, _gpu_world)
CPU_WORLDS = (2, 4)  # the gloo runs
GLOO_UNEVEN_ALLGATHER = "ProcessGroupGloo::allgather: invalid tensor size"
SPAWN_TIMEOUT_S = 300

# name: (backend, parallelism, B, S, H, D, dtype, how the keys and values are drawn)
# "ring" / "ulysses" split S evenly; the "_anything" modes take uneven lengths (and, for
# Ulysses, heads not divisible by the world size: diffusers pads them, by fewer than a rank's
# share of the padded heads: 7 heads take 2 and 4 ranks).
ATTN_CASES = {
    "ring": ("cquant", "ring", 2, 64, 2, 64, "float32", "iid"),
    "ulysses": ("cquant", "ulysses", 2, 64, 4, 64, "float32", "iid"),
    "ring_bf16": ("cquant", "ring", 1, 64, 2, 64, "bfloat16", "iid"),
    "ring_anything_uneven": ("cquant", "ring_anything", 1, 37, 2, 64, "float32", "iid"),
    "ulysses_anything_uneven": ("cquant", "ulysses_anything", 1, 37, 7, 64, "float32", "iid"),
    # 8-bit: values with per-channel means (the realistic case of ATTN_INT8_REL_L2) and keys whose
    # per-channel offset differs between the two halves, so the ring shards smooth K by
    # different means and merge right only if each lse undoes its own smoothing (cquant.h)
    "int8_ring": ("cquant_int8", "ring", 1, 256, 2, 64, "float32", "int8"),
    "int8_ulysses": ("cquant_int8", "ulysses", 1, 256, 4, 64, "float32", "int8"),
}
# cases also run with CQUANT_ULYSSES=cquant (cquant's own exchange), with and without the lse, with
# the rank's heads in one group and in two (on 4 ranks each has one head: one group either way)
LEAN_ULYSSES_CASES = ("ulysses", "int8_ulysses")
LEAN_ULYSSES_CHUNKS = (1, 2)
# Flux under enable_parallelism: (backend, parallelism)
MODEL_CASES = {
    "flux_ring": ("cquant", "ring"),
    "flux_ulysses": ("cquant", "ulysses"),
    "flux_int8_ring": ("cquant_int8", "ring"),
    "flux_ring_anything_uneven": ("cquant", "ring_anything"),
}


def _module_seed():
    value = int(os.environ.get("CQUANT_TEST_SEED", secrets.randbits(32)))
    print(f"random seed: {value} (repeat with CQUANT_TEST_SEED={value})")
    return value


def _attn_inputs(case, seed):
    """The whole q, k, v [B, S, H, D] of a case (every rank draws the same ones)."""
    _, _, b, s, h, d, dtype, kind = ATTN_CASES[case]
    rng = np.random.default_rng([seed, sorted(ATTN_CASES).index(case)])
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(3))
    if kind == "int8":
        k[:, : s // 2] += 8.0 * rng.standard_normal((1, 1, h, d)).astype(np.float32)
        k[:, s // 2:] += 8.0 * rng.standard_normal((1, 1, h, d)).astype(np.float32)
        v += rng.standard_normal((1, 1, h, d)).astype(np.float32)
    return tuple(torch.from_numpy(t).to(getattr(torch, dtype)) for t in (q, k, v))


def _cp_config(parallelism):
    """The config of a parallelism over every process of the (initialized) default group."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    degree = {"ring": "ring_degree", "ulysses": "ulysses_degree"}[parallelism.split("_")[0]]
    kwargs = {degree: dist.get_world_size()}
    if parallelism.endswith("_anything"):
        kwargs[parallelism] = True
    return ContextParallelConfig(**kwargs)


def _parallel_config(parallelism, rank, device):
    import torch.distributed as dist
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = _cp_config(parallelism)
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh(device.type, cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, dist.get_world_size(), device, mesh=mesh)
    return config


def _tiny_flux(uneven=False):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=[8, 12, 12]).eval()
    b, hw, t = 2, (35 if uneven else 36), (7 if uneven else 8)
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(b, hw, 8, generator=g),
                  encoder_hidden_states=torch.randn(b, t, 32, generator=g),
                  pooled_projections=torch.randn(b, 16, generator=g), timestep=torch.rand(b, generator=g),
                  img_ids=torch.randn(hw, 3, generator=g), txt_ids=torch.randn(t, 3, generator=g))
    return model, inputs


def _cpu_worker(rank, init_file, out_dir, seed, world):
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    torch.set_num_threads(1)  # several ranks on a small machine
    # "cpu:gloo", not "gloo": diffusers' gather_size_by_comm (the "_anything" modes) gathers on the CPU
    # only where the group's backend string names "cpu", else on torch.accelerator.current_accelerator(),
    # which is "cuda" on a CUDA build of torch even with no GPU (models/_modeling_parallel.py)
    dist.init_process_group("cpu:gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cquant.register_attention_backends()
    results = {}
    cpu = torch.device("cpu")
    try:
        for case, (backend, parallelism, *_rest) in ATTN_CASES.items():
            q, k, v = (t.tensor_split(world, dim=1)[rank] for t in _attn_inputs(case, seed))
            config = _parallel_config(parallelism, rank, cpu)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn: none may happen
                out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True}, backend=backend,
                                                 parallel_config=config)
            results[case] = (out, lse)

        # a ring step whose shard has no keys (lse = -inf): ring-anything with every key on rank 0. Two
        # ranks only: on more, a rank that begins on its empty shard gets NaN from diffusers' second
        # merge whatever the backend (test_ring_step_without_keys)
        if world == 2:
            q, k, v = _attn_inputs("ring", seed)
            q = q.tensor_split(world, dim=1)[rank]
            k, v = (t if rank == 0 else t[:, :0] for t in (k, v))
            config = _parallel_config("ring_anything", rank, cpu)
            results["ring_empty_shard"] = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True},
                                                                backend="cquant", parallel_config=config)

        # training through ring or Ulysses attention must fail loudly: the kernels have no backward
        for parallelism in ("ring", "ulysses"):
            q, k, v = (t.tensor_split(world, dim=1)[rank].requires_grad_() for t in _attn_inputs(parallelism, seed))
            out = dispatch_attention_fn(q, k, v, backend="cquant",
                                        parallel_config=_parallel_config(parallelism, rank, cpu))
            try:
                out.sum().backward()
                results[f"backward_{parallelism}"] = None
            except Exception as e:  # noqa: BLE001  (the type and message are what the test checks)
                results[f"backward_{parallelism}"] = (type(e).__name__, str(e))

        # cquant's own Ulysses exchange (CQUANT_ULYSSES=cquant), counted so that the tests know it ran
        lean_calls, exchange = [], cquant.ulysses.attention

        def counted(*args, **kwargs):
            lean_calls.append(1)
            return exchange(*args, **kwargs)

        cquant.ulysses.attention, os.environ[cquant.ulysses.SETTING] = counted, "cquant"
        try:
            for case in LEAN_ULYSSES_CASES:
                backend, parallelism, *_rest = ATTN_CASES[case]
                q, k, v = (t.tensor_split(world, dim=1)[rank] for t in _attn_inputs(case, seed))
                for chunks in LEAN_ULYSSES_CHUNKS:
                    os.environ[cquant.ulysses.CHUNKS_SETTING] = str(chunks)
                    for return_lse in (True, False):
                        results[f"lean_{case}_c{chunks}_lse{int(return_lse)}"] = dispatch_attention_fn(
                            q, k, v, attention_kwargs={"return_lse": return_lse}, backend=backend,
                            parallel_config=_parallel_config(parallelism, rank, cpu))
                del os.environ[cquant.ulysses.CHUNKS_SETTING]
            model, inputs = _tiny_flux()
            model.set_attention_backend("cquant")
            enable_parallelism(model, _cp_config("ulysses"))
            with torch.inference_mode():  # as pipelines call the model (the template's run: no_grad)
                results["lean_flux_ulysses"] = model(**inputs, return_dict=False)[0]
        finally:
            cquant.ulysses.attention = exchange
            del os.environ[cquant.ulysses.SETTING]
        results["lean_calls"] = len(lean_calls)

        for case, (backend, parallelism) in MODEL_CASES.items():  # the uneven case last (see below)
            model, inputs = _tiny_flux(uneven=case.endswith("uneven"))
            model.set_attention_backend(backend)
            enable_parallelism(model, _cp_config(parallelism))
            try:
                with torch.no_grad():  # return_dict=False as pipelines call it: the split hook on the
                    # model (the plan's "") takes only tensor outputs (hooks/context_parallel.py, post_forward)
                    results[case] = model(**inputs, return_dict=False)[0]
            except RuntimeError as e:
                # The "_anything" modes gather the output shards of unequal lengths with dist.all_gather
                # (hooks/context_parallel.py, _all_gather_anything), which gloo refuses on every rank
                # before sending anything: "ProcessGroupGloo::allgather: invalid tensor size".
                if GLOO_UNEVEN_ALLGATHER not in str(e):
                    raise
                results[case] = GLOO_UNEVEN_ALLGATHER
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawned_results(d, worker, what, world):
    """(seed, {case: [each rank's result]}) of one run of worker(rank, init_file, out_dir, seed, world)
    on world processes, which save their results in directory d; fails (not hangs) if they do not finish."""
    seed = _module_seed()
    spawn_ranks(worker, (str(d / "init"), str(d), seed, world), world, SPAWN_TIMEOUT_S, what)
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return seed, {case: [r[case] for r in ranks] for case in ranks[0]}


# The workers' runs raise through torch's C++ on purpose (gloo refusing uneven all-gathers, the
# backward op's error), which aborts a process under scripts/sanitize.sh's preloaded ASan runtime:
# the tests of that run carry the marker sanitize.sh leaves out.
spawned_run = pytest.mark.raises_in_torch_op


@pytest.fixture(scope="module", params=CPU_WORLDS, ids=lambda n: f"{n}ranks")
def cpu_results(tmp_path_factory, request):
    """{case: [each rank's result]} of one gloo run of every CPU case on 2 and on 4 processes."""
    return _spawned_results(tmp_path_factory.mktemp("cp_cpu"), _cpu_worker, "gloo context-parallel run",
                            request.param)


def _gathered(per_rank):
    """out [B, S, H, D] and lse [B, H, S] (the op's layout) from every rank's sequence shard."""
    out = torch.cat([o for o, _ in per_rank], dim=1).double().numpy()
    lse = torch.cat([lse for _, lse in per_rank], dim=1).transpose(1, 2).double().numpy()
    return out, lse


@spawned_run
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_attention_matches_float64(cpu_results, case):
    seed, results = cpu_results
    backend, parallelism, b, s, h, d, dtype, _ = ATTN_CASES[case]
    q, k, v = _attn_inputs(case, seed)
    ref, ref_lse = attention_f64(q.double().numpy(), k.double().numpy(), v.double().numpy(), d ** -0.5)
    out, lse = _gathered(results[case])
    assert out.shape == (b, s, h, d) and lse.shape == (b, h, s)
    assert results[case][0][0].dtype == getattr(torch, dtype)
    if backend == "cquant_int8":  # each ring shard quantizes its own keys and values
        assert cosine(out, ref) >= ATTN_INT8_MIN_COSINE
        assert rel_l2(out, ref) <= ATTN_INT8_REL_L2
        assert np.abs(lse - ref_lse).max() <= ATTN_INT8_LSE_ABS * max(1.0, np.abs(ref_lse).max())
        return
    bound = ATTN_RING_REL_L2[dtype] if parallelism.startswith("ring") else ATTN_REF_REL_L2[dtype]
    assert rel_l2(out, ref) <= bound
    assert np.abs(lse - ref_lse).max() <= ATTN_REF_LSE_ABS * max(1.0, np.abs(ref_lse).max())


@spawned_run
@pytest.mark.parametrize("case", ["ulysses", "int8_ulysses", "ulysses_anything_uneven"])
def test_ulysses_is_one_process_cquant_bit_for_bit(cpu_results, case):
    """Ulysses hands each rank whole sequences of some heads: the same per-head math as one call
    on one process, to the bit (the 8-bit mode too: K smoothing and V scales are per head)."""
    seed, results = cpu_results
    backend = ATTN_CASES[case][0]
    q, k, v = _attn_inputs(case, seed)
    one, one_lse = cquant.attention(q, k, v, mode="int8" if backend == "cquant_int8" else "bf16", return_lse=True)
    out = torch.cat([o for o, _ in results[case]], dim=1)
    lse = torch.cat([x for _, x in results[case]], dim=1)
    assert torch.equal(out, one) and torch.equal(lse, one_lse.transpose(1, 2))


@spawned_run
@pytest.mark.parametrize("case", LEAN_ULYSSES_CASES)
def test_cquant_ulysses_exchange_is_the_template_bit_for_bit(cpu_results, case):
    """CQUANT_ULYSSES=cquant reads the exchanged q, k, v in place and sends the output as the
    kernel writes it: the same per-head math as diffusers' template, outputs and lse to the bit."""
    _, results = cpu_results
    for r in range(len(results[case])):
        out, lse = results[case][r]
        for chunks in LEAN_ULYSSES_CHUNKS:
            lean_out, lean_lse = results[f"lean_{case}_c{chunks}_lse1"][r]
            assert torch.equal(lean_out, out) and torch.equal(lean_lse, lse), chunks
            assert torch.equal(results[f"lean_{case}_c{chunks}_lse0"][r], out), chunks


@spawned_run
def test_cquant_ulysses_exchange_runs_flux(cpu_results):
    """Flux under enable_parallelism(ulysses) with CQUANT_ULYSSES=cquant: the template's output to the
    bit, every attention call through the exchange (each rank: the attention cases in 1 and 2 head
    groups with and without the lse, and Flux's 2 blocks)."""
    _, results = cpu_results
    for lean, template in zip(results["lean_flux_ulysses"], results["flux_ulysses"], strict=True):
        assert torch.equal(lean, template)
    world = len(results["lean_calls"])
    assert results["lean_calls"] == [len(LEAN_ULYSSES_CASES) * len(LEAN_ULYSSES_CHUNKS) * 2 + 2] * world


@spawned_run
def test_ring_int8_shards_quantize_their_own_keys(cpu_results):
    """Ring 8-bit is the 8-bit math per shard, not of the whole sequence: it differs from one
    process's 8-bit result (while both meet the accuracy bar, test_attention_matches_float64)."""
    seed, results = cpu_results
    q, k, v = _attn_inputs("int8_ring", seed)
    one = cquant.attention(q, k, v, mode="int8")
    out = torch.cat([o for o, _ in results["int8_ring"]], dim=1)
    assert not torch.equal(out, one)


@spawned_run
def test_ring_step_without_keys(cpu_results):
    """A ring step over a shard with no keys gives out 0 and lse -inf (log of an empty sum), which
    diffusers' merge (out = prev - sigmoid(lse - prev_lse) (prev - out)) leaves out of the result."""
    seed, results = cpu_results
    if "ring_empty_shard" not in results:  # more than 2 ranks: see the worker
        pytest.skip("a rank that begins on its empty shard gets lse NaN from diffusers' first merge "
                    "(-inf - logsigmoid(-inf)) and output NaN from the second (3 or more ranks)")
    q, k, v = _attn_inputs("ring", seed)
    ref, ref_lse = attention_f64(q.double().numpy(), k.double().numpy(), v.double().numpy(), q.shape[-1] ** -0.5)
    out0, lse0 = results["ring_empty_shard"][0]
    out = torch.cat([out for out, _ in results["ring_empty_shard"]], dim=1).double().numpy()
    assert rel_l2(out, ref) <= ATTN_RING_REL_L2["float32"]
    # rank 0 holds every key: its lse merged a finite step with the -inf ones. (The other ranks' lse
    # is not checked: their first step, their own empty shard, starts diffusers' lse merge
    # prev_lse - logsigmoid(prev_lse - lse) at prev_lse = -inf, which gives -inf - (-inf) = NaN
    # whatever the backend; their out is right, as checked above.)
    half = out0.shape[1]
    got = lse0.transpose(1, 2).double().numpy()
    assert np.abs(got - ref_lse[:, :, :half]).max() <= ATTN_REF_LSE_ABS * max(1.0, np.abs(ref_lse).max())


@spawned_run
@pytest.mark.parametrize("parallelism", ["ring", "ulysses"])
def test_backward_raises(cpu_results, parallelism):
    _, results = cpu_results
    for raised in results[f"backward_{parallelism}"]:
        assert raised is not None, f"backward through {parallelism} attention did not raise"
        name, message = raised
        assert name == "NotImplementedError", raised
        assert "cquant" in message and "no backward" in message


@spawned_run
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_flux_with_enable_parallelism_matches_one_process(cpu_results, case):
    _, results = cpu_results
    backend, _ = MODEL_CASES[case]
    if isinstance(results[case][0], str):
        pytest.skip("diffusers gathers the uneven output shards of the '_anything' modes with dist.all_gather "
                    f"of unequal tensors, which gloo refuses ({results[case][0]})")
    model, inputs = _tiny_flux(uneven=case.endswith("uneven"))
    with torch.no_grad():
        ref = model(**inputs).sample  # one process, diffusers' native backend
    for out in results[case]:  # each rank gathers the whole output (the plan's proj_out)
        err = rel_l2(out.numpy(), ref.numpy())
        assert err <= (ATTN_MODEL_INT8_REL_L2 if backend == "cquant_int8" else ATTN_MODEL_FULL_REL_L2["float32"])
        if backend == "cquant_int8":
            assert err > 10 * ATTN_MODEL_FULL_REL_L2["float32"]  # the 8-bit kernels really ran


# ---------------------------------------------------------------- one process


def test_backends_are_registered_for_context_parallelism():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    cquant.register_attention_backends()
    for name in ("cquant", "cquant_int8"):
        assert _AttentionBackendRegistry._is_context_parallel_available(AttentionBackendName(name))


def _ring_config():
    """Enough of a ParallelConfig for the checks made before any collective."""
    return types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ring_degree=2, ulysses_degree=1))


@pytest.mark.parametrize("mode", [0, 1])
def test_ring_call_the_kernels_do_not_take_raises(mode):
    """diffusers' native backend, the fallback, cannot run ring attention (its forward op refuses
    return_lse, which every ring step asks for): such calls raise, naming why."""
    from cquant import attention_backend

    q = torch.randn(1, 8, 2, 16)
    fn = attention_backend._backend_fn(mode)
    with pytest.raises(NotImplementedError, match="attention masks are not supported.*ring attention"):
        fn(q, q, q, attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool), _parallel_config=_ring_config())
    with pytest.raises(NotImplementedError, match="causal attention is not supported.*ring attention"):
        fn(q, q, q, is_causal=True, _parallel_config=_ring_config())


@pytest.mark.raises_in_torch_op
def test_shard_the_kernels_refuse(monkeypatch):
    """A shard the kernels refuse: SDPA under Ulysses (no lse asked), an error under ring."""
    from cquant import attention_backend, ops

    def refuse(*args, **kwargs):
        raise NotImplementedError("the CUDA 8-bit attention takes batch * heads up to 65535; got 70000")

    monkeypatch.setattr(ops, "attention_into", refuse)
    monkeypatch.setattr(attention_backend, "_warned", set())
    forward_op = attention_backend._shard_forward_op(torch, cquant.attention_backend.register_torch_op(), 1)
    q, k, v = (torch.randn(2, 5, 2, 16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="refuse a context-parallel shard .*65535"):
        out = forward_op(None, q, k, v, return_lse=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(out, sdpa)
    with pytest.raises(NotImplementedError, match="65535.*no fallback gives the log-sum-exp"):
        forward_op(None, q, k, v, return_lse=True)


def test_shard_forward_op_gives_lse_in_model_layout():
    """The templates take (out [B, S, H, D], lse [B, S, H] fp32, natural log) from a forward op."""
    from cquant import attention_backend

    forward_op = attention_backend._shard_forward_op(torch, attention_backend.register_torch_op(), 0)
    q, k, v = (torch.randn(2, 7, 3, 16) for _ in range(3))
    out, lse = forward_op(None, q, k, v, scale=0.3, return_lse=True)
    ref, ref_lse = attention_f64(q.numpy(), k.numpy(), v.numpy(), 0.3)
    assert lse.shape == (2, 7, 3) and lse.dtype == torch.float32
    assert rel_l2(out.numpy(), ref) <= ATTN_REF_REL_L2["float32"]
    assert np.abs(lse.numpy() - ref_lse.transpose(0, 2, 1)).max() <= ATTN_REF_LSE_ABS * np.abs(ref_lse).max()
    with pytest.raises(NotImplementedError, match="cquant attention has no backward"):
        attention_backend._backward_op(None, out)


# ---------------------------------------------------------------- 2 or 4 GPUs, NCCL

GPU_SHAPE = (1, 4608, 24, 128)  # Flux at 1024x1024: 4096 image + 512 text tokens, 24 heads of 128
GPU_CHECK_ROWS = 256


def _gpu_inputs(seed, mode):
    b, s, h, d = GPU_SHAPE
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    if mode == "int8":  # realistic activations: per-channel key offsets and value means
        k += 8.0 * torch.randn(1, 1, h, d, generator=g)
        v += torch.randn(1, 1, h, d, generator=g)
    return q, k, v


def _gpu_worker(rank, init_file, out_dir, seed, world):
    import torch.distributed as dist
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=device)
    cquant.register_attention_backends()
    results = {}
    try:
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
        for parallelism in ("ring", "ulysses"):
            config = _parallel_config(parallelism, rank, device)
            for backend, mode in (("cquant", "bf16"), ("cquant_int8", "int8")) if fp8 else (("cquant", "bf16"),):
                q, k, v = (t.tensor_split(world, dim=1)[rank].to(device, torch.bfloat16)
                           for t in _gpu_inputs(seed, mode))
                with warnings.catch_warnings():
                    warnings.simplefilter("error", RuntimeWarning)  # no fallback may happen
                    out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True},
                                                     backend=backend, parallel_config=config)
                results[parallelism, backend] = (out.cpu(), lse.cpu())
                if parallelism == "ulysses":  # and through cquant's own exchange (NCCL), in 1 and 2 head groups
                    os.environ[cquant.ulysses.SETTING] = "cquant"
                    try:
                        for chunks in LEAN_ULYSSES_CHUNKS:
                            os.environ[cquant.ulysses.CHUNKS_SETTING] = str(chunks)
                            out, lse = dispatch_attention_fn(q, k, v, attention_kwargs={"return_lse": True},
                                                             backend=backend, parallel_config=config)
                            results[f"cquant_ulysses{chunks}", backend] = (out.cpu(), lse.cpu())
                    finally:
                        del os.environ[cquant.ulysses.SETTING], os.environ[cquant.ulysses.CHUNKS_SETTING]
        _gpu_p2p_cases(results, rank, device, seed, fp8)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _counting_p2p(calls):
    """cquant.ulysses' symmetric-memory exchange, counting its calls (restore with the returned original)."""
    original = cquant.ulysses._p2p_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    cquant.ulysses._p2p_attention = counted
    return original


def _gpu_p2p_cases(results, rank, device, seed, fp8):
    """cquant's exchange through symmetric memory (CQUANT_ULYSSES_TRANSPORT=p2p, no lse): three calls
    eagerly (the first, which sets the workspace up, under inference mode) and replayed from one
    CUDA graph (the workspace reused call after call, the inputs changed between capture and
    replay), and a tiny Flux optimized with CUDA graphs under enable_parallelism; each against
    diffusers' template on the same inputs."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    config = _parallel_config("ulysses", rank, device)
    calls = []
    original = _counting_p2p(calls)
    env = {cquant.ulysses.SETTING: "diffusers", cquant.peer_memory.TRANSPORT_SETTING: "p2p"}
    os.environ.update(env)
    try:
        for backend, mode in (("cquant", "bf16"), ("cquant_int8", "int8")) if fp8 else (("cquant", "bf16"),):
            xs = [tuple(t.tensor_split(torch.distributed.get_world_size(), dim=1)[rank].to(device, torch.bfloat16)
                        for t in _gpu_inputs(seed + 1 + i, mode)) for i in range(3)]

            def call(q, k, v):
                return dispatch_attention_fn(q, k, v, backend=backend, parallel_config=config)

            os.environ[cquant.ulysses.SETTING] = "diffusers"
            results["p2p_template", backend] = [call(*x).cpu() for x in xs]
            os.environ[cquant.ulysses.SETTING] = "cquant"
            for groups in P2P_GROUPS:  # the rank's heads in 1 group, then in 2 (a side stream overlaps them)
                os.environ[cquant.ulysses.CHUNKS_SETTING] = str(groups)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", RuntimeWarning)  # no fallback to NCCL may happen
                    eager = []
                    for i, x in enumerate(xs):  # the first under inference mode, where the workspace is set up
                        with torch.inference_mode(i == 0):
                            eager.append(call(*x).cpu())
                    results[f"p2p{groups}_eager", backend] = eager
                    static = [tuple(t.clone() for t in x) for x in xs]
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        outs = [call(*x) for x in static]
                    for dst, i in zip(static, P2P_GRAPH_ORDER):  # replay on the inputs in another order
                        for a, b in zip(dst, xs[i]):
                            a.copy_(b)
                    graph.replay()
                    results[f"p2p{groups}_graph", backend] = [o.cpu() for o in outs]
        del os.environ[cquant.ulysses.CHUNKS_SETTING]
        results["p2p_flux"] = _gpu_flux_graphs(device)
    finally:
        cquant.ulysses._p2p_attention = original
        for k in (*env, cquant.ulysses.CHUNKS_SETTING):
            os.environ.pop(k, None)
    results["p2p_calls"] = len(calls)


P2P_GRAPH_ORDER = (2, 0, 1)
P2P_GROUPS = (1, 2)


def _gpu_flux_graphs(device):
    """A tiny Flux (bf16, cquant attention), cquant.optimize(cuda_graph=True), then Ulysses over the run's GPUs:
    the output of the graph that captured diffusers' template and of the one that captured cquant's
    exchange (symmetric memory), each replayed twice."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=64, num_attention_heads=4, joint_attention_dim=64,
                                   pooled_projection_dim=32, axes_dims_rope=[16, 24, 24]).eval()
    model.to(device, torch.bfloat16)
    hw, t = 256, 32
    g = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(1, hw, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, t, 64, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.rand(1, generator=g),
                  img_ids=torch.randn(hw, 3, generator=g), txt_ids=torch.randn(t, 3, generator=g))
    inputs = {k: v.to(device, torch.bfloat16) for k, v in inputs.items()}
    cquant.enable_attention(model, "bf16")
    cquant.optimize(model, cuda_graph=True)
    enable_parallelism(model, _cp_config("ulysses"))
    graphs, outs = cquant.cuda_graph.find(model), {}
    for exchange in ("diffusers", "auto"):  # auto: cquant's exchange in the graph (p2p: the setting above)
        os.environ[cquant.ulysses.SETTING] = exchange
        graphs.reset()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no eager fallback, no NCCL fallback
            outs[exchange] = [model(**inputs, return_dict=False)[0].cpu() for _ in range(2)]
    return outs, graphs.num_graphs


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2 and cquant._C.built_with_cuda()


def _gpu_world():
    """Ranks of the GPU run: 4 where the machine has 4 GPUs (GPU_SHAPE's 24 heads and the tiny Flux's
    4 split evenly), else 2."""
    return 4 if torch.cuda.device_count() >= 4 else WORLD


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory):
    """{case: [each rank's result]} of one NCCL run of every GPU case, a process a GPU."""
    return _spawned_results(tmp_path_factory.mktemp("cp_gpu"), _gpu_worker, "NCCL context-parallel run",
                            _gpu_world())


def _within_merge_order(out, ref, value):
    """(ok, what differs): the 8-bit kernel's outputs of one call against another whose heads split
    its keys otherwise (ATTN_INT8_MERGE_ORDER_ULPS, ATTN_INT8_MERGE_ORDER_VALUE_UNITS)."""
    ulp = 2 * OUTPUT_UNIT_ROUNDOFF["bfloat16"] * ATTN_INT8_MERGE_ORDER_ULPS
    diff, mag = (out.float() - ref.float()).abs(), ref.float().abs()
    allowed = ulp * mag + ATTN_INT8_MERGE_ORDER_VALUE_UNITS * value.float().abs().max().item()
    bad = diff > allowed
    if not bad.any():
        return True, ""
    worst = int((diff - allowed).flatten().argmax())
    return False, (f"{int(bad.sum())} of {bad.numel()} elements; worst {diff.flatten()[worst].item():.3g} at "
                   f"|ref| {mag.flatten()[worst].item():.3g} (max |ref| {mag.max().item():.3g}, "
                   f"max diff {diff.max().item():.3g})")


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs and a CUDA build of cquant")
@pytest.mark.parametrize("backend", ["cquant", "cquant_int8"])
def test_gpus_cquant_ulysses_exchange_is_the_template(gpu_results, backend):
    """cquant's exchange on NCCL: diffusers' template to the bit in one head group; in two, the 8-bit
    kernel splits the keys of other query blocks (its last wave holds fewer heads), so those rows
    may land one bfloat16 ulp apart (ATTN_INT8_MERGE_ORDER_ULPS)."""
    if backend == "cquant_int8" and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("8-bit attention needs compute capability 8.9 or newer")
    seed, results = gpu_results
    for rank, (out, lse) in enumerate(results["ulysses", backend]):
        lean_out, lean_lse = results["cquant_ulysses1", backend][rank]
        assert torch.equal(lean_out, out) and torch.equal(lean_lse, lse)
        lean_out, lean_lse = results["cquant_ulysses2", backend][rank]
        if backend == "cquant":
            assert torch.equal(lean_out, out) and torch.equal(lean_lse, lse)
            continue
        value = _gpu_inputs(seed, "int8")[2].to(torch.bfloat16)
        ok, why = _within_merge_order(lean_out, out, value)
        assert ok, why
        assert (lean_lse - lse).abs().max().item() <= ATTN_CUDA_LSE_ABS * max(1.0, lse.abs().max().item())


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs and a CUDA build of cquant")
@pytest.mark.parametrize("parallelism", ["ring", "ulysses"])
@pytest.mark.parametrize("backend", ["cquant", "cquant_int8"])
def test_gpus_flux_shape(gpu_results, parallelism, backend):
    from cquant import attention_backend

    mode = "int8" if backend == "cquant_int8" else "bf16"
    if mode == "int8" and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("8-bit attention needs compute capability 8.9 or newer")
    seed, results = gpu_results
    q, k, v = (t.to("cuda:0", torch.bfloat16) for t in _gpu_inputs(seed, mode))
    scale = GPU_SHAPE[-1] ** -0.5
    out = torch.cat([o for o, _ in results[parallelism, backend]], dim=1).cuda()
    lse = torch.cat([x for _, x in results[parallelism, backend]], dim=1).cuda()
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    one = attention_backend._backend_fn(1 if mode == "int8" else 0)(q, k, v)  # one GPU, same backend
    rows = torch.randperm(GPU_SHAPE[1], generator=torch.Generator().manual_seed(seed))[:GPU_CHECK_ROWS].sort().values
    rows = rows.cuda()
    ref, ref_lse = attention_rows_f64(q, k, v, scale, rows)
    ref_lse = ref_lse.transpose(1, 2)  # the model layout [B, R, H], as the backend gives it
    ref_np = ref.cpu().numpy()
    err = rel_l2(out[:, rows].double().cpu().numpy(), ref_np)
    one_err = rel_l2(one[:, rows].double().cpu().numpy(), ref_np)
    lse_err = (lse[:, rows].double() - ref_lse).abs().max().item()
    if mode == "int8":
        assert cosine(out[:, rows].double().cpu().numpy(), ref_np) >= ATTN_INT8_MIN_COSINE
        assert err <= ATTN_INT8_REL_L2 and one_err <= ATTN_INT8_REL_L2, (err, one_err)
        assert lse_err <= ATTN_INT8_LSE_ABS * max(1.0, ref_lse.abs().max().item())
        return
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    sdpa_err = rel_l2(sdpa[:, rows].double().cpu().numpy(), ref_np)
    assert err <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + ATTN_CUDA_REL_L2_FLOOR, (err, sdpa_err)
    assert one_err <= ATTN_CUDA_VS_SDPA_FACTOR * sdpa_err + ATTN_CUDA_REL_L2_FLOOR, (one_err, sdpa_err)
    assert lse_err <= ATTN_CUDA_LSE_ABS


def test_p2p_head_groups(monkeypatch):
    """The p2p exchange's head groups: eagerly one; under a CUDA graph three whose first and last
    keep P2P_EDGE_ROWS_PER_SM query rows an SM (Flux at 2048x2048 on an H200: 2 + 8 + 2 of a rank's
    12 heads), one where no such edge leaves a middle group (1024x1024); CQUANT_ULYSSES_CHUNKS=G
    equal groups, one where G does not divide the heads."""
    from cquant import ulysses

    graphed = [False]
    props = types.SimpleNamespace(multi_processor_count=132)
    cuda = types.SimpleNamespace(get_device_properties=lambda device: props)
    fake = types.SimpleNamespace(cuda=cuda)
    monkeypatch.setattr(ulysses, "_graphed", lambda torch: graphed[0])
    monkeypatch.delenv(ulysses.CHUNKS_SETTING, raising=False)
    q2048, q1024 = torch.zeros(1, 8448, 24, 1), torch.zeros(1, 2304, 24, 1)  # a rank's tokens of Flux, Ulysses-2
    assert ulysses._p2p_groups(fake, q2048, 2) == (12,)
    graphed[0] = True
    assert ulysses._p2p_groups(fake, q2048, 2) == (2, 8, 2)
    assert ulysses._p2p_groups(fake, q1024, 2) == (12,)
    assert ulysses._p2p_groups(fake, torch.zeros(2, 2304, 24, 1), 2) == (4, 4, 4)  # batch 2: twice the rows
    for value, groups in (("3", (4, 4, 4)), ("5", (12,)), ("1", (12,))):
        monkeypatch.setenv(ulysses.CHUNKS_SETTING, value)
        assert ulysses._p2p_groups(fake, q2048, 2) == groups


def test_cquant_ulysses_setting_and_the_calls_it_takes(monkeypatch):
    """CQUANT_ULYSSES: unset or "auto" selects the exchange on a GPU where its transport may be p2p,
    and with CQUANT_ULYSSES_TRANSPORT=nccl under CUDA graph capture only; "cquant" always,
    "diffusers" never, anything else is a ValueError naming it (CQUANT_ULYSSES_CHUNKS likewise: a
    whole number >= 1); the exchange takes pure Ulysses calls with heads that split evenly and no
    gradient, and leaves the rest to the template."""
    from cquant import ulysses

    def fake_torch(capturing):
        cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: capturing)
        return types.SimpleNamespace(cuda=cuda)

    monkeypatch.delenv(ulysses.SETTING, raising=False)
    monkeypatch.delenv(cquant.peer_memory.TRANSPORT_SETTING, raising=False)
    assert not ulysses.selected(torch) or torch.cuda.is_available()  # a CPU never
    assert ulysses.selected(fake_torch(False)) and ulysses.selected(fake_torch(True))  # p2p may carry it
    monkeypatch.setenv(cquant.peer_memory.TRANSPORT_SETTING, "nccl")  # auto: only while a CUDA graph is captured
    assert not ulysses.selected(fake_torch(False)) and ulysses.selected(fake_torch(True))
    for value, eager, captured in (("auto", False, True), ("diffusers", False, False), ("cquant", True, True),
                                   (" CQUANT ", True, True)):
        monkeypatch.setenv(ulysses.SETTING, value)
        assert ulysses.selected(fake_torch(False)) is eager and ulysses.selected(fake_torch(True)) is captured
    monkeypatch.setenv(ulysses.SETTING, "nccl")
    with pytest.raises(ValueError, match="CQUANT_ULYSSES='nccl'; expected one of auto, cquant, diffusers"):
        ulysses.selected(torch)
    monkeypatch.delenv(ulysses.CHUNKS_SETTING, raising=False)
    assert ulysses.chunks() == ulysses.DEFAULT_CHUNKS == 2
    monkeypatch.setenv(ulysses.CHUNKS_SETTING, "3")
    assert ulysses.chunks() == 3
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv(ulysses.CHUNKS_SETTING, bad)
        with pytest.raises(ValueError, match="CQUANT_ULYSSES_CHUNKS=.*expected a whole number >= 1"):
            ulysses.chunks()

    mesh = types.SimpleNamespace(get_group=lambda: "group")

    def config(ring=1, degree=2, anything=False):
        cp = types.SimpleNamespace(ring_degree=ring, ulysses_degree=degree, ulysses_anything=anything,
                                   _ulysses_mesh=mesh)
        return types.SimpleNamespace(context_parallel_config=cp)

    q, k = torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 4, 16)
    assert ulysses.group_of(torch, config(), q, k) == ("group", 2)
    assert ulysses.group_of(torch, None, q, k) is None
    assert ulysses.group_of(torch, config(ring=2, degree=1), q, k) is None
    assert ulysses.group_of(torch, config(anything=True), q, k) is None
    assert ulysses.group_of(torch, config(degree=3), q, k) is None  # 4 heads over 3 ranks
    assert ulysses.group_of(torch, config(), q, torch.zeros(1, 8, 2, 16)) is None  # grouped-query heads
    assert ulysses.group_of(torch, config(), q.requires_grad_(), k) is None
    with torch.no_grad():
        assert ulysses.group_of(torch, config(), q, k) == ("group", 2)


def test_auto_takes_the_exchange_in_a_capture_warm_up(monkeypatch):
    """CQUANT_ULYSSES=auto also selects the exchange in cquant.cuda_graph's eager warm-up of a capture,
    which sets up what the captured calls need (the symmetric-memory workspace)."""
    from cquant import cuda_graph, ulysses

    cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: False)
    fake = types.SimpleNamespace(cuda=cuda)
    monkeypatch.delenv(ulysses.SETTING, raising=False)
    monkeypatch.setenv(cquant.peer_memory.TRANSPORT_SETTING, "nccl")  # where only NCCL carries it
    assert not cuda_graph.warming_up() and not ulysses.selected(fake)
    monkeypatch.setattr(cuda_graph, "_warming", 1)
    assert cuda_graph.warming_up() and ulysses.selected(fake)
    monkeypatch.setenv(ulysses.SETTING, "diffusers")
    assert not ulysses.selected(fake)


def test_transport_setting(monkeypatch):
    """CQUANT_ULYSSES_TRANSPORT: auto (default), p2p or nccl, anything else a ValueError naming it;
    no workspace (NCCL carries the exchange) under nccl or for tensors off the GPU."""
    from cquant import peer_memory

    monkeypatch.delenv(peer_memory.TRANSPORT_SETTING, raising=False)
    assert peer_memory.transport() == "auto"
    for value, expected in ((" P2P ", "p2p"), ("nccl", "nccl"), ("", "auto")):
        monkeypatch.setenv(peer_memory.TRANSPORT_SETTING, value)
        assert peer_memory.transport() == expected
    monkeypatch.setenv(peer_memory.TRANSPORT_SETTING, "nvlink")
    with pytest.raises(ValueError, match="CQUANT_ULYSSES_TRANSPORT='nvlink'; expected one of auto, p2p, nccl"):
        peer_memory.transport()
    group = types.SimpleNamespace(group_name="unused")  # never reached: nothing is set up
    for value in ("auto", "p2p", "nccl"):
        monkeypatch.setenv(peer_memory.TRANSPORT_SETTING, value)
        assert peer_memory.workspace(torch, group, torch.device("cpu"), 1 << 20) is None
    monkeypatch.setenv(peer_memory.TRANSPORT_SETTING, "nccl")
    assert peer_memory.workspace(torch, group, torch.device("cuda", 0), 1 << 20) is None
    assert peer_memory.aligned(1) == peer_memory.ALIGN and peer_memory.aligned(2 * peer_memory.ALIGN) == 512


def _randn(gen, *shape):
    return torch.from_numpy(gen.standard_normal(shape))


class _ThreadWorkspace:
    """peer_memory.Workspace's interface over CPU buffers that threads (one a rank) share: a view of
    any rank's buffer, and a barrier every rank's thread reaches before any goes on."""

    def __init__(self, buffers, rank, barrier):
        self.buffers, self.rank, self.world, self._barrier = buffers, rank, len(buffers), barrier

    def view(self, rank, offset, shape, dtype):
        n = int(np.prod(shape)) * dtype.itemsize
        return self.buffers[rank][offset:offset + n].view(dtype).view(shape)

    def barrier(self, channel):
        self._barrier.wait(timeout=60)


@pytest.mark.parametrize("world, b, s, skv, h, d, groups", [
    (2, 1, 8, 8, 4, 16, 1), (2, 2, 6, 10, 4, 8, 1), (3, 2, 5, 7, 6, 8, 1), (4, 1, 4, 4, 8, 8, 1),
    (2, 1, 8, 8, 4, 16, 2), (2, 2, 6, 10, 8, 8, 4), (3, 2, 5, 7, 12, 8, 2), (2, 1, 8, 8, 8, 16, (1, 2, 1)),
    (2, 2, 6, 10, 12, 8, (2, 3, 1))])
def test_p2p_exchange_layout_on_threads(world, b, s, skv, h, d, groups):
    """The symmetric-memory exchange's layout and copies (ulysses._p2p_attention), each rank a thread
    over shared CPU buffers: every rank's output is float64 attention of its tokens over the whole
    sequence, at batch 1 and 2, self- and cross-attention, 2-4 ranks, in 1, 2 and 4 equal head
    groups and in uneven ones, two calls in a row (the second overwrites the first's workspace)."""
    import threading

    from cquant import ulysses

    sizes = groups if isinstance(groups, tuple) else (h // world // groups,) * groups
    assert sum(sizes) == h // world
    gen = np.random.default_rng([world, b, s, skv])
    calls = [[_randn(gen, b, n * world, h, d) for n in (s, skv, skv)] for _ in range(2)]
    layout = ulysses._p2p_layout(calls[0][0][:, :s], calls[0][1][:, :skv], world)
    buffers = [torch.zeros(layout[-1], dtype=torch.uint8) for _ in range(world)]
    barrier, outs, errors, events = threading.Barrier(world), {}, [], {}

    def shard(q, k, v, scale, return_lse):  # each head on its own, as the kernels compute
        assert not return_lse and q.shape[1] == s * world and k.shape[1] == skv * world
        assert q.shape[2] in sizes
        return torch.from_numpy(attention_f64(q.numpy(), k.numpy(), v.numpy(), scale)[0])

    def rank_thread(r):
        try:
            ws = _ThreadWorkspace(buffers, r, barrier)
            for i, (q, k, v) in enumerate(calls):
                q, k, v = q[:, r * s:(r + 1) * s], k[:, r * skv:(r + 1) * skv], v[:, r * skv:(r + 1) * skv]
                seen = events[r, i] = []

                def shard_seen(*args):
                    seen.append("attention")
                    return shard(*args)

                with ulysses.beside_exchange(lambda: seen.append("beside")):
                    outs[r, i] = ulysses._p2p_attention(shard_seen, q, k, v, 0.25, world, ws, layout, sizes)
        except Exception as e:  # noqa: BLE001 - reported below; the other threads then time out
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, (q, k, v) in enumerate(calls):
        ref = torch.from_numpy(attention_f64(q.numpy(), k.numpy(), v.numpy(), 0.25)[0])
        for r in range(world):
            out = outs[r, i]
            assert out.shape == (b, s, h, d) and out.dtype == torch.float64
            assert torch.allclose(out, ref[:, r * s:(r + 1) * s], rtol=0, atol=1e-12), (r, i)
            # the block's work beside the exchange ran once, with the inputs under way, before any attention
            assert events[r, i] == ["beside"] + ["attention"] * len(sizes), (r, i, events[r, i])


def test_beside_exchange_runs_the_work_once():
    """ulysses.beside_exchange: the exchange that takes the work runs it (run_beside), else it runs on
    leaving; a block that fails drops it; work left behind runs before the next block's."""
    from cquant import ulysses

    done = []
    with ulysses.beside_exchange(lambda: done.append("a")):
        assert done == []
        ulysses.run_beside()  # the exchange
        assert done == ["a"]
        ulysses.run_beside()  # nothing is left
    assert done == ["a"]
    with ulysses.beside_exchange(lambda: done.append("b")):
        assert done == ["a"]  # no exchange took it: it runs on leaving
    assert done == ["a", "b"]
    with pytest.raises(RuntimeError, match="attention failed"):
        with ulysses.beside_exchange(lambda: done.append("c")):
            raise RuntimeError("attention failed")
    ulysses.run_beside()
    assert done == ["a", "b"]
    with ulysses.beside_exchange(None):
        ulysses.run_beside()
    ulysses._beside.work = lambda: done.append("left")  # as if a block had left it behind
    with ulysses.beside_exchange(lambda: done.append("d")):
        assert done == ["a", "b", "left"]
    assert done == ["a", "b", "left", "d"]


def test_destroy_process_group_releases_the_workspaces_first(monkeypatch, tmp_path):
    """Once a workspace exists, destroy_process_group releases the workspaces of the groups it
    destroys (after synchronizing their devices) before torch tears the groups down."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from cquant import peer_memory

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    original = c10d.destroy_process_group
    try:
        peer_memory._release_before_destroy()
        peer_memory._release_before_destroy()  # once only
        assert dist.destroy_process_group.__wrapped__ is original
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
        sub = dist.new_group([0])
        sub_ws = types.SimpleNamespace(group_name=sub.group_name, device="sub device")
        world_ws = types.SimpleNamespace(group_name=dist.group.WORLD.group_name, device="world device")
        old_ws = types.SimpleNamespace(group_name=sub.group_name, device="sub device")
        monkeypatch.setattr(peer_memory, "_workspaces", {(sub.group_name, 0): sub_ws, ("world", 0): world_ws})
        monkeypatch.setattr(peer_memory, "_kept", [old_ws])
        dist.destroy_process_group(sub)
        assert peer_memory._workspaces == {("world", 0): world_ws} and peer_memory._kept == []
        assert synced == ["sub device"]  # once a device
        dist.destroy_process_group()
        assert peer_memory._workspaces == {} and synced[1:] == ["world device"]
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            original()
        c10d.destroy_process_group = dist.destroy_process_group = original


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs and a CUDA build of cquant")
@pytest.mark.parametrize("backend", ["cquant", "cquant_int8"])
def test_gpus_p2p_exchange_is_the_template(gpu_results, backend):
    """cquant's exchange through symmetric memory gives diffusers' template's output, eagerly and from
    a CUDA graph of three calls in a row replayed on other inputs: to the bit in one head group; in
    two, the 8-bit kernel's rows whose key split follows the call's heads may land one bfloat16 ulp
    apart (ATTN_INT8_MERGE_ORDER_ULPS), as with NCCL's head groups."""
    if backend == "cquant_int8" and torch.cuda.get_device_capability(0) < (8, 9):
        pytest.skip("8-bit attention needs compute capability 8.9 or newer")
    seed, results = gpu_results

    def same(out, ref, groups, i):
        if groups == 1 or backend == "cquant":
            return torch.equal(out, ref), "not to the bit"
        return _within_merge_order(out, ref, _gpu_inputs(seed + 1 + i, "int8")[2].to(torch.bfloat16))

    for rank in range(len(results["p2p_template", backend])):
        template = results["p2p_template", backend][rank]
        assert not torch.equal(template[0], template[1])
        for groups in P2P_GROUPS:
            for i, out in enumerate(results[f"p2p{groups}_eager", backend][rank]):
                ok, why = same(out, template[i], groups, i)
                assert ok, (groups, i, why)
            for out, i in zip(results[f"p2p{groups}_graph", backend][rank], P2P_GRAPH_ORDER):
                ok, why = same(out, template[i], groups, i)
                assert ok, (groups, i, why)


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs and a CUDA build of cquant")
def test_gpus_optimized_flux_graph_takes_the_p2p_exchange(gpu_results):
    """optimize(cuda_graph=True) then enable_parallelism: the graph captures cquant's exchange through
    symmetric memory (CQUANT_ULYSSES=auto), its workspace set up by the capture's eager warm-up,
    and replays the template's output to the bit."""
    _, results = gpu_results
    fp8 = torch.cuda.get_device_capability(0) >= (8, 9)
    calls_eager = 3 * (2 if fp8 else 1) * 2 * len(P2P_GROUPS)  # eager and captured calls of the exchange cases
    for rank in range(len(results["p2p_flux"])):
        outs, graphs = results["p2p_flux"][rank]
        assert graphs == 1
        for out in outs["auto"] + outs["diffusers"][1:]:
            assert torch.equal(out, outs["diffusers"][0])
        assert not torch.isnan(outs["auto"][0]).any()
        # Flux's 4 blocks: 2 warm-up forwards and the capture go through the exchange, replays do not
        assert results["p2p_calls"][rank] == calls_eager + 3 * 4
