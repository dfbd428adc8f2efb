"""Seeing inside a run: `python -m transformer_zoo.train.inspect` writes attention maps,
position pictures and curves; a training run ends with curves.png and TensorBoard text,
hyperparameters and images; labels render in DejaVu Sans without missing glyphs."""

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from tests.train import tiny_config
from transformer_zoo.train import inspect as inspect_cli
from transformer_zoo.train import plots
from transformer_zoo.train.loop import train_and_evaluate
from transformer_zoo.train.predict import load_run

STEPS = 4


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory):
    """The tiny digits -> words run: an evaluation at the last step, two printed samples."""
    config = tiny_config.get_config()
    config.train.update(num_steps=STEPS, eval_every=STEPS, checkpoint_every=STEPS)
    config.decode.update(num_print=2, beam_size=1)
    workdir = tmp_path_factory.mktemp("mt")
    train_and_evaluate(config, workdir)
    return workdir


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A two-step character LM (decoder-only, learned positions of 32)."""
    from transformer_zoo.configs import tinyshakespeare

    folder = tmp_path_factory.mktemp("lm")
    corpus = folder / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question.\n" * 50)
    config = tinyshakespeare.get_config()
    config.model.update(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1, max_length=32)
    config.data.update(path=str(corpus), seq_length=16, batch_size=2, max_eval_batches=1)
    config.train.update(num_steps=2, log_every=1, eval_every=0, checkpoint_every=2)
    config.optim.update(warmup_steps=1)
    config.decode.update(sample_length=0)
    train_and_evaluate(config, folder / "run")
    return folder / "run"


def _inspect(capsys, *argv):
    code = inspect_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _image(path) -> np.ndarray:
    path = Path(path)
    assert path.is_file() and path.stat().st_size > 1000, path
    return mpimg.imread(path)


def _pixels(inches: tuple[float, float]) -> tuple[int, int]:
    """(height, width) in pixels of a figure (width, height) inches."""
    return round(inches[1] * plots.DPI), round(inches[0] * plots.DPI)


def test_translation_run_is_inspected(translation_run, tmp_path, capsys):
    out = tmp_path / "pictures"
    code, printed, err = _inspect(capsys, "--workdir", translation_run, "--text", "1204",
                                  "--out", out)
    assert code == 0, err
    names = ["encoder_self_attention", "decoder_self_attention", "cross_attention",
             "alignment", "positions_explained", "curves"]
    assert printed == [str(out / f"{n}.png") for n in names]  # learned positions: no own
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in names)
    shapes = {Path(p).stem: _image(p).shape for p in printed}
    assert all(len(s) == 3 and s[2] == 4 for s in shapes.values())  # RGBA
    source = ["1", "2", "0", "4", "</s>"]
    assert shapes["encoder_self_attention"][:2] == _pixels(
        plots.attention_grid_inches(1, 2, source, source))  # 1 layer x 2 heads
    assert shapes["positions_explained"][:2] == (800, 1100)
    assert shapes["curves"][:2] == (600, 1200)  # loss, accuracy, lr, exact match: 3 x 2 panels


def test_a_given_target_is_teacher_forced_and_labels_are_pieces(translation_run):
    run = load_run(translation_run)
    seen = inspect_cli.inspect_text(run.model, run.params, run.tokenizer, run.family, "1204",
                                    "one thousand two hundred four")
    target = ["one", "thousand", "two", "hundred", "four", "</s>"]
    assert seen.tokens == {"source": ["1", "2", "0", "4", "</s>"],
                           "decoder": ["<s>", *target[:-1]], "target": target}
    cross = seen.weights["decoder/layer_0/cross_attention"]
    assert cross.shape == (2, 6, 5)
    np.testing.assert_allclose(cross.sum(-1), 1.0, atol=1e-5)


def test_decoder_only_run_shows_self_attention_only(lm_run, tmp_path, capsys):
    code, printed, err = _inspect(capsys, f"--workdir={lm_run}", "--text=to be",
                                  f"--out={tmp_path}")
    assert code == 0, err
    assert [Path(p).name for p in printed] == ["decoder_self_attention.png",
                                               "positions_explained.png", "curves.png"]
    reads = ["<s>", *"to be"]  # BOS, then the prompt
    assert _image(printed[0]).shape[:2] == _pixels(plots.attention_grid_inches(1, 2, reads,
                                                                               reads))


@pytest.mark.parametrize("case", ["missing workdir", "empty text", "too long",
                                  "target on decoder-only", "layer"])
def test_errors_exit_1_with_one_line_and_write_nothing(case, translation_run, lm_run, tmp_path,
                                                       capsys):
    out = tmp_path / "out"
    argv = {
        "missing workdir": [f"--workdir={tmp_path / 'nothing'}", "--text=12"],
        "empty text": [f"--workdir={translation_run}", "--text=  "],
        "too long": [f"--workdir={translation_run}", f"--text={'7' * 40}"],  # 41 > 32
        "target on decoder-only": [f"--workdir={lm_run}", "--text=to", "--target=be"],
        "layer": [f"--workdir={translation_run}", "--text=12", "--target=twelve", "--layer=1"],
    }[case]
    code, printed, err = _inspect(capsys, *argv, f"--out={out}")
    message = {"missing workdir": "does not exist", "empty text": "--text is empty",
               "too long": "41 tokens (with EOS); the model allows 32",
               "target on decoder-only": "encoder_decoder runs only; this run is decoder_only",
               "layer": "--layer=1 is out of range"}[case]
    assert code == 1 and printed == []
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def _events(folder: Path):
    """Every Event of the TFRecord files in `folder` (8-byte length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + length])
            yield event
            i += 12 + length + 4


def test_training_run_writes_curves_and_tensorboard_text_hparams_images(translation_run):
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    assert _image(translation_run / "curves.png").shape == (600, 1200, 4)
    texts, images, hparams = {}, {}, {}
    for event in _events(translation_run / "tensorboard"):
        for value in event.summary.value:
            if value.tag.endswith("/text_summary"):
                texts[(value.tag, event.step)] = value.tensor.string_val[0].decode()
            elif value.HasField("image"):
                images[value.tag] = mpimg.imread(_png(value.image.encoded_image_string)).shape
            elif value.tag == "_hparams_/session_start_info":
                data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                hparams = dict(data.session_start_info.hparams)
    for split in ("eval", "final"):  # two decoded held-out examples at each evaluation
        table = texts[(f"{split}/samples/text_summary", STEPS)]
        assert table.startswith("| source | output | reference |") and table.count("\n") == 3
    assert hparams["model.d_model"].number_value == 32
    assert hparams["train.num_steps"].number_value == STEPS
    assert hparams["family"].string_value == "encoder_decoder"
    assert images["final/curves"] == (600, 1200, 4)
    assert {"final/encoder_self_attention", "final/decoder_self_attention",
            "final/cross_attention", "final/alignment"} <= set(images)


def _png(data: bytes):
    import io

    return io.BytesIO(data)


def test_labels_render_with_dejavu_sans_and_no_missing_glyphs(tmp_path):
    assert plots.fonts()[0] == "DejaVu Sans"
    tokens = ["äöüß é", "Straße", " ", "\n", "中"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = plots.alignment(np.full((2, 5), 0.2), tokens, tokens[:2], tmp_path / "a.png",
                               title="äöüß é")
        plots.attention_grid(np.full((1, 1, 5, 5), 0.2), tokens, tokens, tmp_path / "g.png")
    assert not [w for w in caught if "missing from font" in str(w.message)], caught
    assert _image(path).ndim == 3
    assert plots.token_label(" ") == "\u2423" and plots.token_label("äöüß é") == "äöüß\u2423é"
    # Without a font for it, a character is spelled as its code point, never a blank box.
    expected = "中" if "Last Resort High-Efficiency" in plots.fonts() else "U+4E2D"
    assert plots.token_label("中") == expected


def test_curves_need_metrics_and_grids_need_matching_tokens(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has no loss"):
        plots.training_curves(empty, tmp_path / "c.png")
    with pytest.raises(ValueError, match="2 queries x 3 keys, got 2 query and 2 key tokens"):
        plots.attention_grid(np.zeros((1, 1, 2, 3)), ["a", "b"], ["a", "b"], tmp_path / "g.png")
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "g.png").exists()


def test_metric_writer_takes_image_arrays_and_refuses_other_shapes(tmp_path):
    from transformer_zoo.train.metrics import MetricWriter

    writer = MetricWriter(tmp_path, enabled=True)
    writer.write_image(3, "grey", np.linspace(0.0, 1.0, 20).reshape(4, 5))
    writer.write_image(3, "rgb", np.zeros((6, 7, 3), np.uint8))
    with pytest.raises(ValueError, match=r"\[H, W, 1\|3\|4\], got shape \(6, 7, 2\)"):
        writer.write_image(3, "bad", np.zeros((6, 7, 2)))
    writer.close()
    found = {v.tag: (e.step, v.image.height, v.image.width)
             for e in _events(tmp_path / "tensorboard") for v in e.summary.value
             if v.HasField("image")}
    assert found == {"grey": (3, 4, 5), "rgb": (3, 6, 7)}
