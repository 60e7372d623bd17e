"""Byte tokenizer: exact round trip, specials, errors."""

import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab.config import tiny
from kimilab.tokenizer import BOS, EOS, PAD, UNK, ByteTokenizer

tok = ByteTokenizer()


@settings(max_examples=examples(200), deadline=None)
@given(st.text())
def test_roundtrip(text):
    ids = tok.encode(text)
    assert ids[0] == BOS and all(0 <= t < 256 for t in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, bos=False, eos=True)) == text


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 259), max_size=50))
def test_decode_never_fails_on_any_ids(ids):
    assert isinstance(tok.decode(ids), str)


def test_vocab_fits_tiny_and_specials_distinct():
    assert tok.vocab_size == tiny.vocab_size == 260
    assert len({BOS, EOS, PAD, UNK}) == 4 and min(BOS, EOS, PAD, UNK) == 256


def test_utf8_bytes_and_special_display():
    assert tok.encode("é", bos=False) == [0xC3, 0xA9]
    assert tok.decode([BOS, 104, 105, EOS], skip_special=False) == "<bos>hi<eos>"
    assert tok.decode([0xC3]) == "\ufffd"
    assert tok.token_str(104) == "h" and tok.token_str(0xE2) == "<0xe2>" and tok.token_str(EOS) == "<eos>"


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="ids\\[1\\]=300"):
        tok.decode([1, 300])
    with pytest.raises(ValueError, match="encode\\(text\\)"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="encode\\(text\\)"):
        tok.encode("\ud800")
