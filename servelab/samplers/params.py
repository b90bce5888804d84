"""``SamplingParams``: what one request asks of the sampler, validated twice.

1. When the object is built (``__post_init__``): every field alone and
   fields against each other, so a bad request fails at the API boundary
   with a message that names the field, the value and the valid range.
2. When a request is added to a model (:meth:`SamplingParams.validate_for_model`,
   called by the pipeline): everything that depends on the model (token ids
   against the vocabulary, ``logprobs`` against the engine's ``max_logprobs``,
   whitelists and bans that leave no token). A failure there fails that
   request only, never a batch mid-step.

Decisions documented here:

- ``top_k`` larger than the vocabulary is *clamped* (it keeps every token,
  like -1), never refused: the sampling metadata stores ``min(top_k, vocab)``,
  so no int32 tensor ever sees a huge value.
- ``temperature`` must fit float32 (<= 3.4e38): larger values are *refused*
  at construction, because float32 would turn them into inf and
  ``logits / inf`` into NaN. Any finite value is handled exactly (a very large
  temperature is a uniform draw over the unmasked tokens).
- What can still go wrong at sampling time (a multi-token bad word or a
  custom processor masking the last token, NaN logits) is reported per row in
  ``SamplerOutput.errors`` and fails that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from servelab._internal.validation import check_bool, check_int, check_number

# Temperatures below this are greedy decoding (argmax), and the sampler divides
# by 1.0 instead of by the temperature for those rows to avoid dividing by ~0.
SAMPLING_EPS = 1e-5

# The largest finite float32: temperatures above it would become inf in the sampler's float32 tensor.
MAX_TEMPERATURE = 3.4028234663852886e38

# logit_bias entries are added to raw logits; OpenAI documents [-100, 100].
MAX_ABS_LOGIT_BIAS = 100.0

# torch.Generator.manual_seed accepts unsigned 64-bit seeds.
MAX_SEED = 2**64 - 1

_set = object.__setattr__  # frozen dataclass: normalise fields in place, once, in __post_init__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(name: str) -> str:
    return f"SamplingParams.{name}"


def _real(name: str, value: Any, *, min_value: float | None = None, max_value: float | None = None) -> float:
    """A finite real in ``[min_value, max_value]`` (``check_number`` with the field's full name)."""
    return check_number(_field(name), value, min_value=min_value, max_value=max_value)


def _token_id_tuple(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{_field(name)} must be a sequence of ints, got {type(values).__name__}")
    return tuple(check_int(f"{_field(name)}[{position}]", token_id, min_value=0)
                 for position, token_id in enumerate(values))


def _string_tuple(name: str, values: Any) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{_field(name)} must be a sequence of strings, got {type(values).__name__}")
    for position, text in enumerate(values):
        if not isinstance(text, str):
            raise TypeError(f"{_field(name)}[{position}] must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{_field(name)}[{position}] is an empty string; valid: non-empty strings")
    return tuple(values)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (OpenAI / vLLM semantics).

    Defaults leave the model's distribution untouched (temperature 1, no
    filtering, no penalties). Sequences are stored as tuples and the object is
    frozen: use :func:`dataclasses.replace` to derive a variant.

    Fields and valid ranges:

    - ``temperature`` in [0, 3.4e38] (must fit float32); below ``SAMPLING_EPS``
      (1e-5) means greedy (argmax).
    - ``top_k``: -1 disables it, otherwise >= 1; values >= the vocabulary keep
      every token (clamped, see the module docstring). ``0`` is rejected (it is
      an easy typo for "disabled" in some APIs and "keep nothing" in others;
      say -1).
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
    - ``logprobs``: None or >= 0 (and <= the engine's ``max_logprobs``, checked by
      :meth:`validate_for_model`); the number of top logprobs returned beside
      the sampled token's (from the raw distribution, before any processing).
    - ``prompt_logprobs``: None, -1 (the whole vocabulary) or >= 0 (and, as
      ``logprobs``, <= ``max_logprobs``, -1 counting as the vocabulary size):
      per prompt token its logprob and rank under the model plus the top
      ``prompt_logprobs`` tokens, in ``GenerationOutput.prompt_logprobs``
      (:mod:`servelab.pipeline.prompt_logprobs`). Such a request computes its
      whole prompt (it skips prefix-cache hits until its prompt is done).
    - ``logit_bias``: token id (>= 0) -> bias in [-100, 100], added before
      penalties. ``allowed_token_ids``: if given, a non-empty whitelist.
    - ``bad_words``: non-empty strings, banned as token sequences once resolved
      with :meth:`resolve_bad_words` (needs a tokenizer); ``bad_words_token_ids``
      holds the resolved sequences and may be given directly.
    - ``extra_args``: free-form per-request arguments for custom logits
      processors (the sampler never reads it).
    - ``n`` >= 1: completions sampled for the prompt (parallel sampling). The
      pipeline prefills the prompt once and fans out ``n`` child requests
      that share its KV blocks through prefix caching, child ``i`` sampling
      with its own seed stream (:func:`servelab.pipeline.parallel_sampling.child_seed`);
      the request's ``GenerationOutput.outputs`` holds the ``n`` completions.
    - ``structured_outputs``: None or a
      :class:`~servelab.samplers.structured.StructuredOutputsParams` (JSON
      schema, regex, EBNF grammar or choice list). The pipeline compiles it when
      the request is added (a grammar that does not compile fails that request
      with the compiler's message) and masks every sampled position — drafts
      included — with the grammar's bitmask before sampling. Not with
      ``ignore_eos`` (a completed grammar allows only EOS).
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
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    extra_args: Mapping[str, Any] | None = field(default=None, compare=False)
    structured_outputs: Any = None
    n: int = 1

    def __post_init__(self) -> None:
        """Validate and normalise every field, one named step per group."""
        self._check_sampling_knobs()
        self._check_penalties()
        self._check_seed_and_lengths()
        self._check_stops()
        if self.logprobs is not None:
            check_int(_field("logprobs"), self.logprobs, min_value=0)
        if self.prompt_logprobs is not None:
            check_int(_field("prompt_logprobs"), self.prompt_logprobs, min_value=-1)
        self._normalise_logit_bias()
        self._check_token_masks()
        if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
            raise TypeError(f"SamplingParams.extra_args must be a mapping, got {type(self.extra_args).__name__}")
        self._check_structured_outputs()
        check_int(_field("n"), self.n, min_value=1)

    def _check_structured_outputs(self) -> None:
        """structured_outputs: a StructuredOutputsParams; a grammar ends with EOS, so not with ignore_eos."""
        if self.structured_outputs is None:
            return
        from servelab.samplers.structured.params import StructuredOutputsParams

        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        if self.ignore_eos:
            raise ValueError("SamplingParams.structured_outputs with ignore_eos=True is invalid: a completed "
                             "grammar allows only the end-of-sequence token")

    def _check_sampling_knobs(self) -> None:
        """temperature, top_k, top_p, min_p."""
        _set(self, "temperature", _real("temperature", self.temperature, min_value=0.0, max_value=MAX_TEMPERATURE))
        top_k = check_int(_field("top_k"), self.top_k, min_value=-1)
        if top_k == 0:
            raise ValueError("SamplingParams.top_k=0 is invalid; valid: -1 (disabled) or >= 1")
        top_p = _real("top_p", self.top_p, min_value=0.0, max_value=1.0)
        if top_p == 0.0:
            raise ValueError("SamplingParams.top_p=0.0 is invalid; valid: in (0, 1] (1 disables top-p)")
        _set(self, "top_p", top_p)
        _set(self, "min_p", _real("min_p", self.min_p, min_value=0.0, max_value=1.0))

    def _check_penalties(self) -> None:
        """repetition_penalty > 0; frequency and presence penalties in [-2, 2]."""
        repetition = _real("repetition_penalty", self.repetition_penalty, min_value=0.0)
        if repetition == 0.0:
            raise ValueError("SamplingParams.repetition_penalty=0.0 is invalid; valid: finite and > 0 (1 disables it)")
        _set(self, "repetition_penalty", repetition)
        for name in ("frequency_penalty", "presence_penalty"):
            _set(self, name, _real(name, getattr(self, name), min_value=-2.0, max_value=2.0))

    def _check_seed_and_lengths(self) -> None:
        """seed, max_tokens, min_tokens (<= max_tokens)."""
        if self.seed is not None:
            check_int(_field("seed"), self.seed, min_value=0, max_value=MAX_SEED)
        if self.max_tokens is not None:
            check_int(_field("max_tokens"), self.max_tokens, min_value=1)
        min_tokens = check_int(_field("min_tokens"), self.min_tokens, min_value=0)
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens = {min_tokens} exceeds max_tokens = {self.max_tokens}; "
                "valid: min_tokens <= max_tokens"
            )

    def _check_stops(self) -> None:
        """stop (a string or strings), stop_token_ids, ignore_eos."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence):
            raise TypeError(f"SamplingParams.stop must be a string or a sequence of strings, got {type(stop).__name__}")
        _set(self, "stop", _string_tuple("stop", stop))
        _set(self, "stop_token_ids", _token_id_tuple("stop_token_ids", self.stop_token_ids))
        check_bool(_field("ignore_eos"), self.ignore_eos)

    def _check_token_masks(self) -> None:
        """allowed_token_ids (non-empty), bad_words (non-empty strings), bad_words_token_ids."""
        if self.allowed_token_ids is not None:
            allowed = _token_id_tuple("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError(
                    "SamplingParams.allowed_token_ids is empty; valid: None (all tokens) or a non-empty list"
                )
            _set(self, "allowed_token_ids", allowed)
        _set(self, "bad_words", _string_tuple("bad_words", self.bad_words))
        if self.bad_words_token_ids is None:
            return
        sequences = self.bad_words_token_ids
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence):
            raise TypeError("SamplingParams.bad_words_token_ids must be a sequence of token-id sequences")
        resolved = []
        for position, sequence in enumerate(sequences):
            ids = _token_id_tuple(f"bad_words_token_ids[{position}]", sequence)
            if not ids:
                raise ValueError(f"SamplingParams.bad_words_token_ids[{position}] is empty; valid: non-empty sequences")
            resolved.append(ids)
        _set(self, "bad_words_token_ids", tuple(resolved))

    def _normalise_logit_bias(self) -> None:
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
            normalised[token_id] = _real(f"logit_bias[{token_id}]", bias, min_value=-MAX_ABS_LOGIT_BIAS,
                                         max_value=MAX_ABS_LOGIT_BIAS)
        _set(self, "logit_bias", normalised)

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
        check_int("vocab_size", vocab_size, min_value=1)
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

    def validate_for_model(self, vocab_size: int, *, max_logprobs: int, eos_token_id: int | None = None) -> None:
        """Everything these params can get wrong against a model; ``ValueError`` naming the field.

        Checks, in order: token ids inside ``[0, vocab_size)``; ``logprobs`` <=
        ``max_logprobs`` (the engine's limit) and <= ``vocab_size``; a
        whitelist / one-token bans combination that leaves no token; with
        ``min_tokens`` > 0, a whitelist made only of stop tokens (and
        ``eos_token_id`` when given and not ``ignore_eos``). ``top_k`` above the
        vocabulary is accepted and clamped (module docstring). Multi-token bad
        words can only empty a row at some later step; that is reported by the
        sampler for that request.
        """
        check_int("max_logprobs", max_logprobs, min_value=0)
        self.validate_token_ids(vocab_size)
        for what, limit in (("max_logprobs", max_logprobs), ("vocab_size", vocab_size)):
            if self.logprobs is not None and self.logprobs > limit:
                raise ValueError(f"SamplingParams.logprobs = {self.logprobs} exceeds {what} = {limit}; "
                                 f"valid: None or [0, {min(max_logprobs, vocab_size)}]")
        if self.prompt_logprobs is not None:
            wanted = vocab_size if self.prompt_logprobs == -1 else self.prompt_logprobs
            for what, limit in (("max_logprobs", max_logprobs), ("vocab_size", vocab_size)):
                if wanted > limit:
                    raise ValueError(f"SamplingParams.prompt_logprobs = {self.prompt_logprobs} exceeds {what} = "
                                     f"{limit}; valid: None or [0, {min(max_logprobs, vocab_size)}]"
                                     + (" (-1 means the whole vocabulary)" if self.prompt_logprobs == -1 else ""))
        candidates = self._tokens_left_unmasked(vocab_size)
        if candidates is not None and not candidates:
            raise ValueError("SamplingParams.allowed_token_ids and bad_words_token_ids leave no token to sample "
                             "(every allowed token is a one-token bad word); valid: at least one allowed, "
                             "unbanned token")
        if self.min_tokens > 0 and self.allowed_token_ids is not None:
            stops = set(self.all_stop_token_ids(eos_token_id))
            if set(self.allowed_token_ids) - stops - self._one_token_bans() == set():
                raise ValueError(f"SamplingParams.min_tokens = {self.min_tokens} masks every allowed token "
                                 "(all of allowed_token_ids are stop tokens or EOS) until that many tokens exist; "
                                 "valid: allow a non-stop token, or min_tokens = 0")

    def _one_token_bans(self) -> set[int]:
        return {sequence[0] for sequence in self.bad_words_token_ids or () if len(sequence) == 1}

    def _tokens_left_unmasked(self, vocab_size: int) -> set[int] | None:
        """Tokens neither outside the whitelist nor banned outright; None when surely non-empty."""
        bans = self._one_token_bans()
        if self.allowed_token_ids is not None:
            return set(self.allowed_token_ids) - bans
        return set() if len({b for b in bans if b < vocab_size}) >= vocab_size else None

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
