"""The accuracy study's sequences (``bench/kv_quant_accuracy.py``): every sequence starts as the
tokenizer starts a text. Cutting the token stream into plain chunks gave Gemma 3 sequences without
``<bos>`` after the first one, which it handles out of distribution ("auto" perplexity 86 instead of
21 on the second 256 tokens), inflating its quantized settings' KL up to 15x."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from kv_quant_accuracy import text_sequences  # noqa: E402


class _Tokenizer:
    """Words to ids, after ``prefix`` (Gemma's ``[<bos>]``, or nothing as SmolLM2)."""

    def __init__(self, prefix: list[int]) -> None:
        self.prefix = prefix

    def encode(self, text: str) -> list[int]:
        return self.prefix + [100 + len(w) for w in text.split()]


TEXT = " ".join("w" * (1 + i % 7) for i in range(300))


@pytest.mark.parametrize("prefix", [[2], [], [5, 6]])
def test_every_sequence_starts_like_a_text(prefix):
    tok = _Tokenizer(prefix)
    seqs = text_sequences(tok, TEXT, 64, None)
    body = tok.encode(TEXT)[len(prefix):]
    assert all(s[: len(prefix)] == prefix for s in seqs)
    assert all(len(s) <= 64 for s in seqs)
    assert [t for s in seqs for t in s[len(prefix):]] == body[: sum(len(s) - len(prefix) for s in seqs)]
    assert len(seqs) == len(body) // (64 - len(prefix)) + (len(body) % (64 - len(prefix)) > 16)


def test_max_tokens_counts_the_prefix_once_and_short_sequences_are_refused():
    tok = _Tokenizer([2])
    seqs = text_sequences(tok, TEXT, 64, 128)
    assert sum(len(s) - 1 for s in seqs) + 1 <= 128 and all(s[0] == 2 for s in seqs)
    with pytest.raises(ValueError, match="seq-len 17"):
        text_sequences(tok, TEXT, 17, None)
