import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelab.blocks import NONE_HASH, MultiModalSpan, RequestBlockHasher, TokenSequence, block_extra_keys
from servelab.blocks.hashing import hash_block_tokens, none_hash


def _none_hash_in_subprocess(hash_fn: str, pythonhashseed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    code = f"from servelab.blocks.hashing import none_hash; print(none_hash({hash_fn!r}).hex())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_sha256_none_hash_is_fixed_across_processes():
    assert _none_hash_in_subprocess("sha256", None) == NONE_HASH.hex() == none_hash().hex()


def test_fast_hash_seed_is_random_per_process_unless_pythonhashseed_is_set():
    assert _none_hash_in_subprocess("xxhash", None) != _none_hash_in_subprocess("xxhash", None)
    assert _none_hash_in_subprocess("xxhash", "7") == _none_hash_in_subprocess("xxhash", "7")
    assert _none_hash_in_subprocess("xxhash", "7") != _none_hash_in_subprocess("xxhash", "8")


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
def test_chain_depends_on_the_whole_prefix(hash_fn):
    a = RequestBlockHasher(2, hash_fn)
    b = RequestBlockHasher(2, hash_fn)
    a.update([1, 2, 3, 4, 5, 6])
    b.update([9, 2, 3, 4, 5, 6])
    # Blocks 1 and 2 hold the same tokens, but their parents differ.
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes))
    assert len(a.block_hashes[0]) == (32 if hash_fn == "sha256" else 16)


@given(tokens=st.lists(st.integers(0, 1000), max_size=40), block_size=st.integers(1, 8),
       cuts=st.lists(st.integers(0, 40), max_size=5))
def test_incremental_hashing_equals_hashing_from_scratch(tokens, block_size, cuts):
    spans = (MultiModalSpan("img-a", 3, 5),)
    incremental = RequestBlockHasher(block_size, lora_name="ad", cache_salt="s", mm_spans=spans)
    for cut in sorted(cuts) + [len(tokens)]:  # the sequence grows in random steps
        incremental.update(tokens[: min(cut, len(tokens))])
    scratch = RequestBlockHasher(block_size, lora_name="ad", cache_salt="s", mm_spans=spans)
    scratch.update(tokens)
    assert incremental.block_hashes == scratch.block_hashes
    assert len(scratch.block_hashes) == len(tokens) // block_size  # full blocks only
    # The explicit chain, computed by hand.
    parent = none_hash()
    for i, expected in enumerate(scratch.block_hashes):
        start = i * block_size
        extra = block_extra_keys(start, start + block_size, "ad", "s", spans)
        parent = hash_block_tokens(parent, tokens[start:start + block_size], extra)
        assert parent == expected


def test_extra_keys_adapter_salt_first_block_only_and_relative_mm_offsets():
    spans = [MultiModalSpan("img", offset=6, length=4)]
    assert block_extra_keys(0, 4) is None
    assert block_extra_keys(0, 4, lora_name="l", cache_salt="s") == (("lora", "l"), ("salt", "s"))
    assert block_extra_keys(4, 8, lora_name="l", cache_salt="s", mm_spans=spans) == (("lora", "l"), ("mm", "img", 2))
    assert block_extra_keys(8, 12, mm_spans=spans) == (("mm", "img", -2),)
    assert block_extra_keys(12, 16, mm_spans=spans) is None


def test_extra_keys_separate_caches():
    tokens = list(range(8))
    plain = TokenSequence("a", tokens, 4).block_hashes
    salted = TokenSequence("b", tokens, 4, cache_salt="tenant-1").block_hashes
    adapter = TokenSequence("c", tokens, 4, lora_name="sql").block_hashes
    image_here = TokenSequence("d", tokens, 4, mm_spans=[MultiModalSpan("cat", 1, 2)]).block_hashes
    image_there = TokenSequence("e", tokens, 4, mm_spans=[MultiModalSpan("cat", 2, 2)]).block_hashes
    assert len({plain[0], salted[0], adapter[0], image_here[0], image_there[0]}) == 5
    # The salt is only mixed into block 0, but the chain carries it on.
    assert salted[1] != plain[1]
    # Image only in block 0: block 1 still differs through its parent.
    assert image_here[1] != plain[1]


def test_hashing_errors():
    with pytest.raises(ValueError, match="hash_fn"):
        RequestBlockHasher(4, "md5")
    with pytest.raises(ValueError, match="block_size"):
        RequestBlockHasher(0)
    with pytest.raises(TypeError, match="cache_salt"):
        RequestBlockHasher(4, cache_salt=3)
    with pytest.raises(ValueError, match="hash_fn"):
        none_hash("crc32")
    hasher = RequestBlockHasher(2)
    hasher.update([1, 2, 3, 4])
    with pytest.raises(ValueError, match="only grow"):
        hasher.update([1])
    with pytest.raises(ValueError, match="identifier"):
        MultiModalSpan("", 0, 1)
    with pytest.raises(ValueError, match="length"):
        MultiModalSpan("x", 0, 0)
    with pytest.raises(ValueError, match="token id"):
        TokenSequence("a", [1, -2], 4)
    with pytest.raises(ValueError, match="request_id"):
        TokenSequence("", [1], 4)


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash"])
@given(tokens=st.lists(st.integers(0, 50_000), max_size=70), block_size=st.integers(1, 9),
       lora=st.sampled_from([None, "a"]), salt=st.sampled_from([None, "s"]), with_mm=st.booleans())
def test_request_hasher_equals_the_chain_of_hash_block_tokens(hash_fn, tokens, block_size, lora, salt, with_mm):
    """The hasher's inlined loop gives the bytes of the public one-block function, chained."""
    spans = (MultiModalSpan("img", 3, 4),) if with_mm else ()
    hasher = RequestBlockHasher(block_size, hash_fn, lora, salt, spans)
    hasher.update(tokens)
    parent, expected = none_hash(hash_fn), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = block_extra_keys(start, start + block_size, lora, salt, spans)
        parent = hash_block_tokens(parent, tokens[start:start + block_size], extra, hash_fn)
        expected.append(parent)
    assert hasher.block_hashes == expected
