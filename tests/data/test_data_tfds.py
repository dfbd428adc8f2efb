"""tfds translate and text pipelines under tfds.testing.mock_data, with no TensorFlow.

Runs in a subprocess: other tests (or plugins) in this process may import
TensorFlow-adjacent modules, and the claim is about the pipeline alone.
"""

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, sys
import tensorflow_datasets as tfds
from transformer_zoo import data

out = {}
with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
    pairs = data.tfds_translation("wmt14_translate/de-en", "train",
                                  source_key="en", target_key="de")
    texts = list(data.sample_texts(pairs, max_examples=24))
    tok = data.CharTokenizer.build(texts)
    batching = data.Batching(mode="pack", batch_size=4, max_inputs_length=64,
                             max_targets_length=64)
    it = iter(data.make_batches(pairs, batching, tokenizer=tok, train=True, seed=0,
                                shard_index=0, shard_count=1))
    batch = next(it)
    out["translation_keys"] = sorted(batch)
    out["translation_example"] = [pairs[0]["inputs"], pairs[0]["targets"]]
    out["decoded"] = tok.decode(data.unpack(batch)[0]["inputs"])

    lm = data.tfds_text("lm1b", "train")
    lm_batching = data.Batching(mode="bucket", batch_size=4, max_targets_length=64)
    lm_batch = next(iter(data.make_batches(lm, lm_batching, tokenizer=tok, train=False,
                                           shard_index=0, shard_count=1)))
    out["lm_keys"] = sorted(lm_batch)
    out["lm_first"] = lm[0]["targets"]
    for name in ("wmt17_translate/de-en",):
        out["wmt17_len"] = len(data.tfds_translation(name, "validation"))
out["tensorflow_imported"] = "tensorflow" in sys.modules
print("RESULT" + json.dumps(out))
"""


def test_tfds_pipelines_without_tensorflow():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    assert out["tensorflow_imported"] is False
    assert out["translation_keys"] == sorted(
        f + s for f in ("inputs", "targets") for s in ("", "_position", "_segmentation"))
    assert out["lm_keys"] == ["targets", "targets_position", "targets_segmentation"]
    src, tgt = out["translation_example"]
    assert src and tgt and src != tgt and "  " not in src  # Normalised text.
    assert out["decoded"] and out["lm_first"]
    assert out["wmt17_len"] == 24
