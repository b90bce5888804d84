"""``SamplingParams``: what one request asks of the sampler, validated once.

Every field is checked when the object is built, so a bad request fails at the
API boundary with a message that names the field, the value and the valid
range, instead of producing silently wrong tokens deep inside a batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# Temperatures below this are greedy decoding (argmax), and the sampler divides
# by 1.0 instead of by the temperature for those rows to avoid dividing by ~0.
SAMPLING_EPS = 1e-5

# logit_bias entries are added to raw logits; OpenAI documents [-100, 100].
MAX_ABS_LOGIT_BIAS = 100.0

# torch.Generator.manual_seed accepts unsigned 64-bit seeds.
MAX_SEED = 2**64 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_real(name: str, value: Any) -> float:
    if not _is_real(value):
        raise TypeError(f"SamplingParams.{name} must be a real number, got {type(value).__name__} {value!r}")
    as_float = float(value)
    if math.isnan(as_float):
        raise ValueError(f"SamplingParams.{name} must not be NaN")
    return as_float


def _require_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _token_id_tuple(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"SamplingParams.{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for position, token_id in enumerate(values):
        if not _is_int(token_id):
            raise TypeError(
                f"SamplingParams.{name}[{position}] must be an int token id, got {type(token_id).__name__} {token_id!r}"
            )
        if token_id < 0:
            raise ValueError(f"SamplingParams.{name}[{position}] = {token_id} is negative; token ids are >= 0")
        out.append(token_id)
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (OpenAI / vLLM semantics).

    Defaults leave the model's distribution untouched (temperature 1, no
    filtering, no penalties). Sequences are stored as tuples and the object is
    frozen: use :func:`dataclasses.replace` to derive a variant.

    Fields and valid ranges:

    - ``temperature`` >= 0; below ``SAMPLING_EPS`` (1e-5) means greedy (argmax).
    - ``top_k``: -1 disables it, otherwise >= 1. ``0`` is rejected (it is an
      easy typo for "disabled" in some APIs and "keep nothing" in others; say
      -1).
    - ``top_p`` in (0, 1]; 1 disables it. ``min_p`` in [0, 1]; 0 disables it.
    - ``repetition_penalty`` > 0 (1 disables it): for tokens in the prompt *or*
      the output, positive logits are divided by it and negative ones multiplied.
    - ``frequency_penalty`` and ``presence_penalty`` in [-2, 2] (0 disables):
      subtract ``count * f`` and ``p`` (if count > 0) for tokens in the *output*.
    - ``seed``: None or an int in [0, 2**64 - 1]; a seeded request's tokens
      depend only on its seed and its own history, not on the batch.
    - ``max_tokens``: None (up to the model length) or >= 1.
      ``min_tokens`` >= 0 and <= ``max_tokens``: until the output has that many
      tokens, EOS and ``stop_token_ids`` are masked.
    - ``stop``: non-empty strings (a single string is accepted). ``stop_token_ids``
      >= 0. ``ignore_eos``: EOS neither stops the request nor is masked by
      min_tokens.
    - ``logprobs``: None or >= 0; the number of top logprobs returned beside the
      sampled token's (from the raw distribution, before any processing).
    - ``logit_bias``: token id (>= 0) -> bias in [-100, 100], added before
      penalties. ``allowed_token_ids``: if given, a non-empty whitelist.
    - ``bad_words``: non-empty strings, banned as token sequences once resolved
      with :meth:`resolve_bad_words` (needs a tokenizer); ``bad_words_token_ids``
      holds the resolved sequences and may be given directly.
    - ``extra_args``: free-form per-request arguments for custom logits
      processors (the sampler never reads it).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    extra_args: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise fields in place once

        temperature = _require_real("temperature", self.temperature)
        if temperature < 0 or math.isinf(temperature):
            raise ValueError(f"SamplingParams.temperature = {self.temperature} is invalid; valid: finite and >= 0")
        set_(self, "temperature", temperature)

        top_k = _require_int("top_k", self.top_k)
        if top_k < -1 or top_k == 0:
            raise ValueError(f"SamplingParams.top_k = {top_k} is invalid; valid: -1 (disabled) or >= 1")

        top_p = _require_real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p = {self.top_p} is invalid; valid: (0, 1]")
        set_(self, "top_p", top_p)

        min_p = _require_real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p = {self.min_p} is invalid; valid: [0, 1]")
        set_(self, "min_p", min_p)

        repetition = _require_real("repetition_penalty", self.repetition_penalty)
        if repetition <= 0 or math.isinf(repetition):
            raise ValueError(
                f"SamplingParams.repetition_penalty = {self.repetition_penalty} is invalid; valid: finite and > 0"
            )
        set_(self, "repetition_penalty", repetition)
        for name in ("frequency_penalty", "presence_penalty"):
            penalty = _require_real(name, getattr(self, name))
            if not -2.0 <= penalty <= 2.0:
                raise ValueError(f"SamplingParams.{name} = {getattr(self, name)} is invalid; valid: [-2, 2]")
            set_(self, name, penalty)

        if self.seed is not None:
            seed = _require_int("seed", self.seed)
            if not 0 <= seed <= MAX_SEED:
                raise ValueError(f"SamplingParams.seed = {seed} is invalid; valid: None or [0, 2**64 - 1]")

        if self.max_tokens is not None:
            max_tokens = _require_int("max_tokens", self.max_tokens)
            if max_tokens < 1:
                raise ValueError(f"SamplingParams.max_tokens = {max_tokens} is invalid; valid: None or >= 1")
        min_tokens = _require_int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens = {min_tokens} is invalid; valid: >= 0")
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens = {min_tokens} exceeds max_tokens = {self.max_tokens}; "
                "valid: min_tokens <= max_tokens"
            )

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence):
            raise TypeError(f"SamplingParams.stop must be a string or a sequence of strings, got {type(stop).__name__}")
        for position, text in enumerate(stop):
            if not isinstance(text, str):
                raise TypeError(f"SamplingParams.stop[{position}] must be a str, got {type(text).__name__}")
            if not text:
                raise ValueError(f"SamplingParams.stop[{position}] is an empty string; valid: non-empty strings")
        set_(self, "stop", tuple(stop))
        set_(self, "stop_token_ids", _token_id_tuple("stop_token_ids", self.stop_token_ids))

        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

        if self.logprobs is not None:
            logprobs = _require_int("logprobs", self.logprobs)
            if logprobs < 0:
                raise ValueError(f"SamplingParams.logprobs = {logprobs} is invalid; valid: None or >= 0")

        self._normalise_logit_bias(set_)

        if self.allowed_token_ids is not None:
            allowed = _token_id_tuple("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError(
                    "SamplingParams.allowed_token_ids is empty; valid: None (all tokens) or a non-empty list"
                )
            set_(self, "allowed_token_ids", allowed)

        bad_words = self.bad_words
        if isinstance(bad_words, str) or not isinstance(bad_words, Sequence):
            raise TypeError(f"SamplingParams.bad_words must be a sequence of strings, got {type(bad_words).__name__}")
        for position, word in enumerate(bad_words):
            if not isinstance(word, str):
                raise TypeError(f"SamplingParams.bad_words[{position}] must be a str, got {type(word).__name__}")
            if not word:
                raise ValueError(f"SamplingParams.bad_words[{position}] is an empty string; valid: non-empty strings")
        set_(self, "bad_words", tuple(bad_words))

        if self.bad_words_token_ids is not None:
            sequences = self.bad_words_token_ids
            if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
                raise TypeError("SamplingParams.bad_words_token_ids must be a sequence of token-id sequences")
            resolved = []
            for position, sequence in enumerate(sequences):
                ids = _token_id_tuple(f"bad_words_token_ids[{position}]", sequence)
                if not ids:
                    raise ValueError(
                        f"SamplingParams.bad_words_token_ids[{position}] is empty; valid: non-empty sequences"
                    )
                resolved.append(ids)
            set_(self, "bad_words_token_ids", tuple(resolved))

        if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
            raise TypeError(f"SamplingParams.extra_args must be a mapping, got {type(self.extra_args).__name__}")

    def _normalise_logit_bias(self, set_: Callable[[object, str, Any], None]) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            raise TypeError(
                f"SamplingParams.logit_bias must be a mapping token id -> bias, got {type(self.logit_bias).__name__}"
            )
        normalised: dict[int, float] = {}
        for token_id, bias in self.logit_bias.items():
            # JSON payloads carry keys as strings ("50256"): accept those, nothing looser.
            if isinstance(token_id, str) and token_id.lstrip("-").isdigit():
                token_id = int(token_id)
            if not _is_int(token_id):
                raise TypeError(f"SamplingParams.logit_bias key {token_id!r} must be an int token id")
            if token_id < 0:
                raise ValueError(f"SamplingParams.logit_bias key {token_id} is negative; token ids are >= 0")
            value = _require_real(f"logit_bias[{token_id}]", bias)
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"SamplingParams.logit_bias[{token_id}] = {bias} is invalid; valid: [-100, 100]")
            normalised[token_id] = value
        set_(self, "logit_bias", normalised)

    # --- derived views ------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature < 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def all_stop_token_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """Token ids that end the request: ``stop_token_ids`` plus EOS unless ``ignore_eos``."""
        if eos_token_id is None or self.ignore_eos or eos_token_id in self.stop_token_ids:
            return self.stop_token_ids
        return (*self.stop_token_ids, eos_token_id)

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if any token id in these params is outside ``[0, vocab_size)``."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size = {vocab_size!r} is invalid; valid: an int >= 1")
        groups: list[tuple[str, Sequence[int]]] = [
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", tuple(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ]
        for position, sequence in enumerate(self.bad_words_token_ids or ()):
            groups.append((f"bad_words_token_ids[{position}]", sequence))
        for name, token_ids in groups:
            for token_id in token_ids:
                if token_id >= vocab_size:
                    raise ValueError(
                        f"SamplingParams.{name} holds token id {token_id}, outside the vocabulary; "
                        f"valid: [0, {vocab_size})"
                    )

    def resolve_bad_words(self, encode: Callable[[str], Sequence[int]]) -> SamplingParams:
        """Return a copy whose ``bad_words_token_ids`` holds each bad word tokenized.

        ``encode`` maps text to token ids without special tokens. Each word is
        encoded as given and with a leading space, because BPE vocabularies
        spell a word differently at the start of a text and after a space
        (as vLLM does). Sequences given already in ``bad_words_token_ids`` are
        kept.
        """
        sequences: list[tuple[int, ...]] = list(self.bad_words_token_ids or ())
        for word in self.bad_words:
            for text in (word, " " + word):
                ids = tuple(encode(text))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return replace(self, bad_words_token_ids=tuple(sequences))
