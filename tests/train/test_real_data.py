"""Real data end to end (slow): the Multi30k recipe translates after 500 steps, and the
character LM on tiny shakespeare learns within 200 steps.

Needs ../shared/data (Multi30k, tiny shakespeare), which a fresh clone does not have:
skipped then, with the reason.
"""

import json

import pytest

from transformer_zoo.configs import multi30k, tinyshakespeare
from transformer_zoo.configs.paths import SHARED_DATA
from transformer_zoo.train.loop import train_and_evaluate

NEEDED = [SHARED_DATA / "multi30k" / f"{split}.{side}" for split in ("train", "val")
          for side in ("en", "de")] + [SHARED_DATA / "tinyshakespeare" / "input.txt"]
MISSING = [str(p) for p in NEEDED if not p.is_file()]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"real data not found: {MISSING} (the shared "
                       "data directory ../shared/data is not part of a clone; see README)"),
]

# The recipe unchanged but for its length: 500 steps, warmup shortened to 150 (the full
# run warms up over 2000 of 5800 steps; the cosine then decays to 0 at step 500). Above
# the floor with the cosine schedule (clean-clone CI); 3.9 BLEU on these 100 val sentences
# with the inverse-sqrt schedule, the
# recipe's 8k vocabulary and beam 6 / alpha 1.4 (7.5 with the 6k vocabulary and beam 4
# / alpha 0.6); a model that never learned (or a broken pipeline) scores < 1.
BLEU_FLOOR = 2.5


def test_multi30k_recipe_translates_after_a_few_hundred_steps(tmp_path):
    config = multi30k.get_config()
    config.data.update(num_decode_examples=100, test_source="")
    config.optim.update(warmup_steps=150)
    config.train.update(num_steps=500, eval_every=0, checkpoint_every=500, log_every=100,
                        average_last=0)
    config.decode.update(num_print=3)
    result = train_and_evaluate(config, tmp_path)
    assert result["bleu"] > BLEU_FLOOR, result
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert losses[-1] < losses[0] - 2.0, losses


def test_char_lm_loss_after_200_steps_is_below_2_5(tmp_path):
    config = tinyshakespeare.get_config()
    config.train.update(num_steps=200, eval_every=200, checkpoint_every=200)
    config.data.update(max_eval_batches=20)
    config.decode.update(sample_length=64)
    result = train_and_evaluate(config, tmp_path)
    assert result["loss"] < 2.5, result
    assert len((tmp_path / "sample.txt").read_text()) > 64
