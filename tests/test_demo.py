"""`python -m cquant demo` and the command line (CPU, small settings)."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
PIL = pytest.importorskip("PIL")

from cquant import __main__ as cli  # noqa: E402
from cquant import demo, demo_model  # noqa: E402
from tolerances import MODEL_SQNR_FLOOR_DB  # noqa: E402


@pytest.fixture(autouse=True)
def _native_attention():
    import tiny_models

    with tiny_models.native_attention():
        yield


def _mini_flux_pipeline(seed):
    """A small random-weight Flux pipeline (FLUX.1-dev's layout at toy width), to save as a local checkpoint."""
    import diffusers

    torch.manual_seed(seed)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(8, 12, 12))
    vae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
                                  layers_per_block=1, latent_channels=16, norm_num_groups=8, use_quant_conv=False,
                                  use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    with torch.no_grad():  # diffusers zero-initialises output projections; random weights everywhere
        for mod in transformer.modules():
            if isinstance(mod, torch.nn.Linear) and not mod.weight.abs().sum():
                torch.nn.init.normal_(mod.weight, std=mod.in_features ** -0.5)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return diffusers.FluxPipeline(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                  transformer=transformer, vae=vae, scheduler=scheduler)


def test_demo_runs_every_requested_scheme_on_the_trained_model(tmp_path, capsys):
    out, js = tmp_path / "demo.png", tmp_path / "demo.json"
    results = demo.main(["--steps", "2", "--prompt", "red circle on blue, white digit 7 on black",
                         "--quant", "int8wo,fp8dqrow,fp6_e3m2", "--device", "cpu", "--out", str(out), "--json", str(js)])
    assert [r["variant"] for r in results] == ["float32", "int8wo", "fp8dqrow", "fp6_e3m2"]
    printed = capsys.readouterr().out
    assert "PSNR (dB)" in printed and "random" not in printed and "bundled demo model" in printed
    # a column of two 32x32 images upscaled to 128x128 per variant, labels beside and below
    image = PIL.Image.open(out)
    assert image.size[0] > 4 * 128 and image.size[1] > 2 * 128
    data = json.loads(js.read_text())
    assert data["device"] == "cpu" and data["reference"] == "float32" and (data["height"], data["width"]) == (32, 32)
    assert data["captions"] == ["red circle on blue", "white digit 7 on black"]
    ref_bytes = results[0]["weight_bytes"]
    assert results[0]["sqnr_db"] == results[0]["psnr_db"] == float("inf")
    # loose floors: they hold for any trained weights (the GPU-trained ones replace the bundled CPU-trained ones)
    for r in results[1:]:
        assert 15 < r["sqnr_db"] < float("inf") and 15 < r["psnr_db"] < float("inf"), r
        assert r["weight_bytes"] < ref_bytes / 3 and r["step_ms"] > 0 and r["skipped"] == 0
    assert results[1]["psnr_db"] > results[3]["psnr_db"]  # 8-bit integer codes beat 6-bit floats
    assert results[3]["weight_bytes"] < results[1]["weight_bytes"]  # 6-bit codes are smaller than 8-bit


@pytest.mark.pure_python
def test_the_bundled_model_draws_what_its_captions_say():
    """The trained weights make a red disc on blue, not noise: red pixels in the middle, blue at the corners."""
    model, encoder, spec = demo_model.load_bundled()
    image = demo_model.sample(model, encoder, spec, ["red circle on blue"] * 4, seed=0)
    mean = image.mean(0)  # over four seeds
    corners = torch.stack([mean[:, :4, :4], mean[:, :4, -4:], mean[:, -4:, :4], mean[:, -4:, -4:]]).mean((0, 2, 3))
    r, g, b = corners.tolist()
    assert b > r + 0.2 and b > g + 0.2, corners
    red = (image[:, 0] > image[:, 2] + 0.3).float().mean((1, 2))  # fraction of red pixels per image
    assert (red > 0.02).all() and red.mean() > 0.05, red  # the smallest drawn circles cover 7% of the image


def test_demo_shows_the_4_bit_schemes_with_their_groups(tmp_path, capsys):
    assert {"int4wo", "int4dq", "fp4_e2m1"} <= set(demo.DEMO_SCHEMES) <= set(demo.SCHEME_NAMES)
    results = demo.main(["--steps", "1", "--prompt", "yellow square on blue", "--quant", "int4wo,int4dq_g64",
                         "--device", "cpu", "--out", str(tmp_path / "int4.png")])
    assert [r["variant"] for r in results] == ["float32", "int4wo", "int4dq_g64"]
    out = capsys.readouterr().out
    assert "group 128" in out and "group 64" in out
    # the model's x_embedder takes 4x4 RGB patches, 48 columns: not a whole number of groups
    for r in results[1:]:
        assert r["skipped"] == 1 and 10 < r["sqnr_db"] < float("inf") and 10 < r["psnr_db"] < float("inf"), r
        assert r["weight_bytes"] < results[0]["weight_bytes"] / 5


def test_demo_table_names_the_weights_unit_in_its_header():
    rows = [dict(variant="float32", scheme=None, weight_bytes=2_345_678, skipped=0, step_ms=3.0, sqnr_db=float("inf"),
                 psnr_db=float("inf")),
            dict(variant="int8wo", scheme="int8wo", weight_bytes=612_345, skipped=0, step_ms=2.0, sqnr_db=40.0,
                 psnr_db=35.0)]
    head, _, *lines = demo.format_table(rows, "float32").splitlines()
    assert "weights (MB)" in head
    assert [line.split()[2] for line in lines] == ["2.35", "0.61"]  # "variant scales weights ...": plain numbers
    assert " MB" not in "\n".join(lines)


def test_demo_with_a_local_checkpoint(tmp_path):
    _mini_flux_pipeline(seed=3).save_pretrained(tmp_path / "flux-mini")
    results = demo.main(["--model", str(tmp_path / "flux-mini"), "--steps", "1", "--height", "32", "--width", "32",
                         "--quant", "fp8wo", "--device", "cpu", "--out", str(tmp_path / "local.png")])
    # on the CPU the checkpoint's bfloat16 weights run (and are compared) in float32
    assert [r["variant"] for r in results] == ["float32", "fp8wo"]
    assert results[1]["sqnr_db"] > MODEL_SQNR_FLOOR_DB["fp8wo"] and results[1]["psnr_db"] > 20


def test_demo_rejects_bad_arguments(capsys):
    for argv, match in ((["--quant", "int3wo"], "unknown quantization scheme 'int3wo'"),
                        (["--quant", "int4wo_g48"], "group_size = 48"),
                        (["--model", "x", "--height", "100"], "multiple of 16"), (["--steps", "0"], "--steps"),
                        (["--width", "64"], "--width applies with --model"),
                        (["--quant", ",,"], "names no scheme"),  # ran the float model alone
                        (["--prompt", "red circle on blue,"], "--prompt 'red circle on blue,' has an empty entry"),
                        (["--prompt", ""], "--prompt '' names no caption")):
        with pytest.raises(SystemExit) as e:
            demo.main(argv)
        assert e.value.code == 2 and match in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--prompt: caption 'purple circle on blue': unknown word"):
        demo.main(["--prompt", "purple circle on blue", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--model '/nonexistent/flux': "):  # was diffusers' traceback
        demo.main(["--model", "/nonexistent/flux", "--device", "cpu", "--quant", "int8wo"])
    assert demo.parse_args(["--quant", "int8wo, float8wo_e4m3"]).schemes == ["int8wo", "float8wo_e4m3"]


@pytest.mark.parametrize("value, twice", [("int8wo, fp8wo,int8wo", "int8wo twice"),
                                          ("fp8dqrow,float8dq_e4m3_row", "fp8dqrow twice (as 'fp8dqrow' and "
                                                                         "'float8dq_e4m3_row')")])
def test_demo_refuses_a_scheme_named_twice(value, twice, capsys):
    """It ran each once, where cquant verify refused: one rule for every front end (cquant.schemes.scheme_names)."""
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--quant", value])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"--quant {value!r} names {twice}; expected each scheme once")


@pytest.mark.parametrize("value", ["int8wo,,fp8dqrow", "int8wo,", ",int8wo", "int8wo, ,fp8dqrow"])
def test_demo_refuses_an_empty_entry_of_a_comma_list(value, capsys):
    """An empty entry was dropped and the other schemes ran, as --quant '' once ran none."""
    with pytest.raises(SystemExit) as e:
        demo.parse_args(["--quant", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2
    assert err.endswith(f"--quant {value!r} has an empty entry; expected 'default', 'all' or comma-separated names")


def test_comma_list_is_one_parser_for_every_command_line():
    assert demo.comma_list(" a, b ,c", "--x", "thing", "things") == ["a", "b", "c"]
    for text, message in (("", "--x '' names no thing; expected things"),
                          (" , ", "--x ' , ' names no thing; expected things"),
                          ("a,,b", "--x 'a,,b' has an empty entry; expected things")):
        with pytest.raises(ValueError) as e:
            demo.comma_list(text, "--x", "thing", "things")
        assert str(e.value) == message


def test_demo_refuses_output_paths_before_running(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(demo, "BundledModel", lambda *a: ran.append(a))  # nothing may be built
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, match in ((["--out", str(tmp_path)], "--out '%s' is a directory" % tmp_path),
                        (["--out", str(tmp_path / "x.txt")], "--out '%s': expected an image file name" % (tmp_path / "x.txt")),
                        (["--out", str(afile / "x.png")], "is not an existing directory"),
                        (["--json", str(tmp_path / "no" / "r.json")], "--json"),
                        (["--json", str(tmp_path)], "--json '%s' is a directory" % tmp_path)):
        with pytest.raises(SystemExit) as e:
            demo.main(["--quant", "int8wo", "--device", "cpu", *argv])
        assert e.value.code == 2 and match in capsys.readouterr().err
    assert not ran


def test_command_line(capsys):
    assert cli.main(["--help"]) == 0 and "demo" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "cquant", "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--quant" in out.stdout and "--model" in out.stdout


def test_demo_on_cuda_without_a_usable_gpu_says_what_to_do(monkeypatch):
    """`cquant demo --device cuda` where it cannot run exits with a message, not a traceback."""
    import cquant

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="finds no CUDA GPU|built without CUDA.*--device cpu"):
        demo.check_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match="there are 1 CUDA devices"):
        demo.check_device(torch.device("cuda:3"))
    monkeypatch.setattr(cquant._C, "built_with_cuda", lambda: False)
    with pytest.raises(SystemExit, match="built CPU-only.*--device cpu"):
        demo.check_device(torch.device("cuda"))
    demo.check_device(torch.device("cpu"))
    with pytest.raises(SystemExit, match="--device mps: expected cpu or cuda"):
        demo.check_device(torch.device("mps"))


@pytest.mark.pure_python
def test_load_bundled_names_a_bad_dtype_and_gives_independent_copies():
    for bad in ("float16", 5, torch.int8):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            demo_model.load_bundled(bad)
    (a, _, spec_a), (b, _, _) = demo_model.load_bundled(), demo_model.load_bundled()
    with torch.no_grad():
        next(a.parameters()).add_(1.0)
    spec_a["captions"].append("changed")
    again, _, spec = demo_model.load_bundled()
    assert torch.equal(next(b.parameters()), next(again.parameters())) and "changed" not in spec["captions"]
