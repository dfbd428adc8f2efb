"""decode_options: which search the options given ask for, and a run's own beam settings
(its config's decode section) as the defaults a restored run decodes with."""

import pytest

from transformer_zoo.train.search import DecodeOptions, Search, decode_options

RECIPE = {"beam_size": 6, "alpha": 1.4, "max_extra": 50, "metric": "bleu"}


def test_without_a_preset_the_paper_defaults_hold():
    assert decode_options("encoder_decoder") == DecodeOptions(search=Search.BEAM, beam_size=4,
                                                              alpha=0.6)
    assert decode_options("decoder_only") == DecodeOptions(search=Search.GREEDY)


def test_an_encoder_decoder_run_decodes_with_its_recipe_when_nothing_is_asked():
    chosen = decode_options("encoder_decoder", preset=RECIPE)
    assert (chosen.search, chosen.beam_size, chosen.alpha) == (Search.BEAM, 6, 1.4)
    # A recipe scored greedily (beam_size 1) decodes greedily.
    assert decode_options("encoder_decoder", preset={"beam_size": 1, "alpha": 0.6}).search \
        == Search.GREEDY
    # A decoder-only run still decodes greedily by default.
    assert decode_options("decoder_only", preset=RECIPE).search == Search.GREEDY


def test_beam_options_not_given_come_from_the_preset():
    assert decode_options("encoder_decoder", preset=RECIPE, alpha=0.2) == DecodeOptions(
        search=Search.BEAM, beam_size=6, alpha=0.2)
    assert decode_options("encoder_decoder", preset=RECIPE, beam_size=2) == DecodeOptions(
        search=Search.BEAM, beam_size=2, alpha=1.4)
    assert decode_options("encoder_decoder", preset=RECIPE, n_best=5).beam_size == 6
    assert decode_options("decoder_only", preset=RECIPE, search="beam").alpha == 1.4
    # A greedy recipe's beam_size 1 is not a beam width: beam search keeps 4.
    assert decode_options("encoder_decoder", preset={"beam_size": 1, "alpha": 1.0},
                          n_best=2) == DecodeOptions(search=Search.BEAM, beam_size=4, alpha=1.0,
                                                     n_best=2)


def test_other_searches_ignore_the_preset():
    assert decode_options("encoder_decoder", preset=RECIPE, search="greedy") == DecodeOptions(
        search=Search.GREEDY)
    sampled = decode_options("encoder_decoder", preset=RECIPE, temperature=0.7, seed=3)
    assert sampled == DecodeOptions(search=Search.SAMPLE, temperature=0.7, seed=3)
    assert decode_options("encoder_decoder", preset=RECIPE, beam_size=1).search == Search.GREEDY


@pytest.mark.parametrize("preset, message", [
    ({"beam_size": 0, "alpha": 0.6}, "beam_size must be >= 1, got 0"),
    ({"beam_size": 4, "alpha": -1.0}, "alpha must be >= 0, got -1.0"),
    ({"beam_size": "4"}, "beam_size must be an int, got '4'"),
])
def test_a_bad_preset_is_refused_with_its_values(preset, message):
    with pytest.raises(ValueError, match="the run's decode settings") as e:
        decode_options("encoder_decoder", preset=preset)
    assert message in str(e.value)


def test_preset_values_the_caller_overrides_are_still_checked():
    with pytest.raises(ValueError, match=r"n_best must be in \[1, beam_size=6\], got 7"):
        decode_options("encoder_decoder", preset=RECIPE, n_best=7)
