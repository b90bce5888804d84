"""The incremental detokenizer against a definition: decode every prefix of
the output in full; the request stops at the first token (at or after
``min_tokens``) that completes a stop string, and the text is cut at the
earliest-starting stop string completed by that token."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.models import build_tiny_tokenizer, load_tokenizer
from servelab.pipeline.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The cache holds keys and values in blocks.",
    "naïve café — déjà vu, 你好世界 🙂🚀 ok",
    "Observation: x = 42; Action: stop!\nFinal answer: yes",
    "   spaces   and\ttabs\n\nnew lines   ",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return load_tokenizer(path)


def expected_text(tokenizer, ids, stops, include, min_tokens):
    """Definition-level oracle: (final text, stop string or None)."""
    previous = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd")
        if stops and k >= min_tokens:
            # occurrences completed by token k: they end past the previous text
            hits = [(at, -len(s), s) for s in stops for at in range(len(text) - len(s) + 1)
                    if text.startswith(s, at) and at + len(s) > len(previous)]
            if hits:
                at, _, s = min(hits)
                return text[: at + len(s) if include else at], s
        previous = text
    return tokenizer.decode(ids, skip_special_tokens=True), None


@settings(max_examples=150)
@given(data=st.data(), text_index=st.integers(0, len(TEXTS) - 1), include=st.booleans(),
       min_tokens=st.integers(0, 6), num_stops=st.integers(0, 3))
def test_stream_matches_definition_and_never_takes_text_back(tokenizer, data, text_index, include, min_tokens,
                                                             num_stops):
    text = TEXTS[text_index]
    prompt = tokenizer.encode("Q: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    stops = []
    for _ in range(num_stops):  # substrings of the text, so they really occur
        a = data.draw(st.integers(0, len(text) - 1))
        b = data.draw(st.integers(a + 1, min(len(text), a + 8)))
        stops.append(text[a:b])
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stops, include_stop_str_in_output=include,
                                   min_tokens=min_tokens)
    streamed = ""
    i = 0
    while i < len(ids) and not detok.finished:
        n = data.draw(st.integers(1, 4))  # several tokens per step, as with speculative decoding
        delta = detok.update(ids[i:i + n])
        streamed += delta.text
        i += n
    final, stop = expected_text(tokenizer, ids, stops, include, min_tokens)
    if not detok.finished:
        streamed += detok.flush()
    assert detok.stop_string == stop
    assert detok.output_text == final
    assert streamed == final, "the stream must add up to the final text"


def test_a_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    ids = tokenizer.encode("Thought: go. Observation: done", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Observation:"])
    streamed = []
    for t in ids:
        delta = detok.update([t])
        streamed.append(delta.text)
        assert "Obs" not in "".join(streamed)
        if delta.stop_string:
            break
    assert "".join(streamed) == "Thought: go. " and detok.stop_string == "Observation:"


def test_multibyte_characters_wait_for_their_last_byte(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "byte-level BPE splits this emoji"
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([t]).text for t in ids]
    assert all(d == "" for d in deltas[:-1]) and deltas[-1] == "🙂"


def test_special_tokens_are_skipped_and_errors(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1])
    assert detok.update(tokenizer.encode("hi", add_special_tokens=False) + [2]).text == "hi"
    with pytest.raises(ValueError, match=r"stop\[0\]=''"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])
    with pytest.raises(TypeError, match="sequence of strings"):
        IncrementalDetokenizer(tokenizer, [], stop="END")
    with pytest.raises(ValueError, match="min_tokens"):
        IncrementalDetokenizer(tokenizer, [], min_tokens=-1)
    with pytest.raises(TypeError, match="decode"):
        IncrementalDetokenizer(object(), [])
    done = IncrementalDetokenizer(tokenizer, [], stop=["a"])
    done.update(tokenizer.encode("a", add_special_tokens=False))
    with pytest.raises(ValueError, match="after a stop string"):
        done.update([5])
