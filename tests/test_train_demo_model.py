"""scripts/train_demo_model.py: its procedural data and a quick CPU run that the demo can load."""

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from cquant import demo_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# training and drawing are torch alone: nothing here for the sanitizers (scripts/sanitize.sh)
pytestmark = pytest.mark.pure_python


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_demo_model", os.path.join(ROOT, "scripts", "train_demo_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_drawn_images_match_their_captions(train):
    images, ids = train.draw(64, 32, torch.Generator().manual_seed(0), "cpu")
    assert images.shape == (64, 3, 32, 32) and -1 <= images.min() and images.max() <= 1
    palette = torch.tensor(list(train.PALETTE.values())) * 2 - 1
    for image, row in zip(images, ids.tolist()):
        words = [demo_model.VOCAB[i] for i in row if i]
        assert words[-2] == "on" and words[0] != words[-1] and len(words) in (4, 5)
        # the least and most common colours of the image are (near) the caption's two colours
        pixels = image.reshape(3, -1).T
        nearest = torch.cdist(pixels, palette).argmin(1)
        counts = torch.bincount(nearest, minlength=len(palette))
        present = {demo_model.COLORS[c] for c in counts.nonzero().flatten().tolist()}
        if words[1] != "gradient":  # a gradient passes through other colours
            assert present == {words[0], words[-1]}, (words, present)


def test_quick_run_writes_weights_the_demo_loads(train, tmp_path, capsys):
    spec = train.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert "loss" in capsys.readouterr().out and spec["training"]["steps"] == 3
    saved = json.loads((tmp_path / "demo_model.json").read_text())
    assert saved["transformer"] == demo_model.default_config()["transformer"] and saved["vocab"] == list(demo_model.VOCAB)
    assert (tmp_path / "demo_model_samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, encoder, spec = demo_model.load(tmp_path / "demo_model.safetensors", tmp_path / "demo_model.json")
    images = demo_model.sample(model, encoder, spec, ["red circle on blue", "white digit 7 on black"], steps=2)
    assert images.shape == (2, 3, 32, 32) and images.isfinite().all()


def test_bad_arguments_are_named(train, capsys):
    for argv, match in ((["--minutes", "0"], "--minutes"), (["--device", "tpu"], "--device"),
                        (["--batch", "0"], "--batch")):
        with pytest.raises(SystemExit):
            train.main(argv + ["--out", "/nonexistent/never"])
        assert match in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown word.*'purple'"):
        demo_model.tokenize(["purple circle on blue"])


def test_packing_round_trips_and_timesteps_run_from_noise_to_image():
    images = torch.rand(2, 3, 32, 32)
    tokens = demo_model.pack(images, 4)
    assert tokens.shape == (2, 64, 48) and torch.equal(demo_model.unpack(tokens, 4, 32), images)
    # token (row 1, column 2) holds the 4x4 patch at pixels [4:8, 8:12]
    assert torch.equal(tokens[0, 8 + 2].reshape(3, 4, 4), images[0, :, 4:8, 8:12])
    assert torch.equal(demo_model.image_ids(demo_model.default_config())[8 + 2], torch.tensor([0.0, 1, 2]))
    for shift in (1.0, 3.0):
        t = demo_model.timesteps(8, shift)
        assert t[0] == 1 and t[-1] == 0 and (t[1:] < t[:-1]).all()
