"""Local file sources: normalisation and clear errors for bad files."""

import logging

import pytest

from transformer_zoo.data import normalize_text, parallel_files, text_corpus, text_files, tsv_file


def _write(path, content: bytes):
    path.write_bytes(content)
    return path


def test_multi30k_style_normalisation():
    # Multi30k train.de has trailing U+00A0 and a TAB inside a line.
    assert normalize_text("Ein\u00a0Hund\tläuft  schnell.\u00a0 ") == "Ein Hund läuft schnell."
    # NFC: decomposed a + combining diaeresis becomes one code point.
    assert normalize_text("la\u0308uft") == "l\u00e4uft"


def test_parallel_files_normalise_and_skip_empty(tmp_path, caplog):
    src = _write(tmp_path / "train.en", b"A dog .\n\nTwo  cats\n")
    tgt = _write(tmp_path / "train.de", "Ein\u00a0Hund .\nLeer\nZwei\tKatzen\u00a0\n".encode())
    with caplog.at_level(logging.INFO, logger="transformer_zoo.data.sources"):
        ds = parallel_files(src, tgt)
    assert list(ds) == [{"inputs": "A dog .", "targets": "Ein Hund ."},
                        {"inputs": "Two cats", "targets": "Zwei Katzen"}]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "skipped 1 empty lines of 3" in skipped[0]


def test_misaligned_parallel_files_name_file_and_line(tmp_path):
    src = _write(tmp_path / "a.en", b"one\ntwo\nthree\n")
    tgt = _write(tmp_path / "a.de", b"eins\nzwei\n")
    with pytest.raises(ValueError, match=r"a\.en.* line 3 has no counterpart in .*a\.de"):
        parallel_files(src, tgt)


def test_invalid_utf8_names_file_and_line(tmp_path):
    bad = _write(tmp_path / "bad.de", b"gut\nschlecht \xff\xfe\n")
    good = _write(tmp_path / "good.en", b"good\nbad\n")
    with pytest.raises(ValueError, match=r"bad\.de: line 2: invalid UTF-8"):
        parallel_files(good, bad)
    with pytest.raises(ValueError, match=r"bad\.de: line 2"):
        text_files([good, bad])


def test_missing_file_names_path(tmp_path):
    good = _write(tmp_path / "good.en", b"good\n")
    with pytest.raises(FileNotFoundError, match="nope.de"):
        parallel_files(good, tmp_path / "nope.de")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        text_corpus(tmp_path / "nope.txt")


def test_tsv_and_text_files(tmp_path):
    tsv = _write(tmp_path / "p.tsv", "a b\tx\u00a0y\n\nc\td\n".encode())
    assert list(tsv_file(tsv)) == [{"inputs": "a b", "targets": "x y"},
                                   {"inputs": "c", "targets": "d"}]
    bad = _write(tmp_path / "bad.tsv", b"a\tb\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad\.tsv: line 2: expected 2 tab-separated"):
        tsv_file(bad)
    lm = _write(tmp_path / "lm.txt", b"First  line\n\n second\n")
    assert list(text_files(lm)) == [{"targets": "First line"}, {"targets": "second"}]
    assert text_corpus(lm) == "First  line\n\n second\n"  # Raw for char LMs.
