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


# ---- stop strings that contain special tokens ------------------------------

SPECIALS = {0: "<pad>", 1: "<s>", 2: "</s>"}  # the tiny tokenizer's special ids and literals
WORDS = ["The", " cache", " holds", " keys", ".", " 你好", " 🙂", "\n", " x = 42;", " stop!"]


def expected_with_specials(tokenizer, chunks, stops, include, min_tokens):
    """Definition with special tokens: the match text of the first k tokens is the
    decoded text with each special token's literal where it occurred; the request
    stops at the first token completing a stop string in it (at or after
    min_tokens); the visible text is the match text before the stop with the
    literals removed, plus the stop string if included."""
    ids = [t for chunk in chunks for t in chunk]
    previous_match = ""
    for k in range(1, len(ids) + 1):
        match, visible_at = "", []  # visible_at[i]: visible length before match[i]
        run: list[int] = []
        visible = ""
        for t in ids[:k] + [None]:
            if t is None or t in SPECIALS:
                text = tokenizer.decode(run, skip_special_tokens=True).rstrip("\ufffd")
                visible_at += [len(visible) + j for j in range(len(text))]
                match, visible, run = match + text, visible + text, []
                if t is not None:
                    visible_at += [len(visible)] * len(SPECIALS[t])
                    match += SPECIALS[t]
            else:
                run.append(t)
        visible_at.append(len(visible))
        if stops and k >= min_tokens:
            hits = [(at, -len(s), s) for s in stops for at in range(len(match) - len(s) + 1)
                    if match.startswith(s, at) and at + len(s) > len(previous_match)]
            if hits:
                at, _, s = min(hits)
                return visible[:visible_at[at]] + (s if include else ""), s
        previous_match = match
    return tokenizer.decode(ids, skip_special_tokens=True), None


@settings(max_examples=120)
@given(data=st.data(), include=st.booleans(), min_tokens=st.integers(0, 4))
def test_stop_strings_match_special_tokens_like_the_definition(tokenizer, data, include, min_tokens):
    pieces = data.draw(st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(sorted(SPECIALS))),
                                min_size=1, max_size=10))
    chunks = [[p] if isinstance(p, int) else tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    match_text = "".join(SPECIALS[p] if isinstance(p, int) else p for p in pieces)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):  # substrings of the match text, often around a literal
        a = data.draw(st.integers(0, len(match_text) - 1))
        b = data.draw(st.integers(a + 1, min(len(match_text), a + 12)))
        stops.append(match_text[a:b])
    ids = [t for chunk in chunks for t in chunk]
    detok = IncrementalDetokenizer(tokenizer, [1], stop=stops, include_stop_str_in_output=include,
                                   min_tokens=min_tokens)
    streamed, i = "", 0
    while i < len(ids) and not detok.finished:
        n = data.draw(st.integers(1, 3))
        streamed += detok.update(ids[i:i + n]).text
        i += n
    if not detok.finished:
        streamed += detok.flush()
    final, stop = expected_with_specials(tokenizer, chunks, stops, include, min_tokens)
    assert (detok.output_text, detok.stop_string) == (final, stop)
    assert streamed == final


def test_stop_on_a_special_token_string(tokenizer):
    """stop=["</s>"] fires on the EOS token although the text skips special tokens."""
    text_ids = tokenizer.encode("keys and values", add_special_tokens=False)
    for include, skip in ((False, True), (True, True), (False, False)):
        detok = IncrementalDetokenizer(tokenizer, [1], stop=["</s>"], include_stop_str_in_output=include,
                                       skip_special_tokens=skip)
        streamed = detok.update(text_ids).text
        delta = detok.update([2] + text_ids)  # tokens after the stop are dropped
        assert delta.stop_string == "</s>"
        assert streamed + delta.text == detok.output_text == "keys and values" + ("</s>" if include else "")
    # Without the stop string the special token stays invisible and ends nothing.
    plain = IncrementalDetokenizer(tokenizer, [1], stop=["zzz"])
    delta = plain.update(text_ids + [2])
    assert delta.stop_string is None and delta.text + plain.flush() == "keys and values"
