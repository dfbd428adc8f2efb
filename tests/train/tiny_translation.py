"""The Multi30k recipe shrunk for tests: number words as the 'German' side, a tiny model."""

from __future__ import annotations

from pathlib import Path

from transformer_zoo import data
from transformer_zoo.configs import multi30k


def write_pairs(directory: Path, name: str, examples) -> None:
    """NAME.en (inputs) and NAME.de (targets), one example per line."""
    for side, key in (("en", "inputs"), ("de", "targets")):
        (directory / f"{name}.{side}").write_text("".join(e[key] + "\n" for e in examples))


def config(tmp_path: Path, train: int = 400, val: int = 12, test: int = 10):
    """configs/multi30k.py on number-word corpora of train/val/test examples written under
    tmp_path/corpus, with a 1+1-layer D 32 model and a 64-piece vocabulary."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, n, seed in (("train", train, 0), ("val", val, 1), ("test", test, 2)):
        ds = data.number_words("train", num_examples=n, seed=seed)
        write_pairs(corpus, name, [ds[i] for i in range(n)])
    cfg = multi30k.get_config()
    cfg.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                     num_decoder_layers=1, max_length=64)
    cfg.data.update(train_source=str(corpus / "train.en"), train_target=str(corpus / "train.de"),
                    eval_source=str(corpus / "val.en"), eval_target=str(corpus / "val.de"),
                    test_source=str(corpus / "test.en"), test_target=str(corpus / "test.de"),
                    vocab_size=64, batch_size=8, max_inputs_length=32, max_targets_length=32,
                    eval_batch_size=8, num_decode_examples=val)
    cfg.optim.update(warmup_steps=2)  # the recipe's cosine needs warmup < num_steps
    return cfg
