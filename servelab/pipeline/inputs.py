"""What a user hands the pipeline, turned into token ids: prompts, batch
arguments and chat conversations.

A prompt is a ``str`` (needs a tokenizer), a sequence of int token ids (a
list, a tuple, a 1-D tensor or array), or a :class:`RenderedPrompt` (text
and ids together, what :meth:`Pipeline.chat` produces). ``bytes`` are
refused: they are a sequence of ints to Python, but nobody means byte values
as token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from servelab.samplers import SamplingParams

_NO_TOKENIZER = ("prompt is a string but the pipeline has no tokenizer; pass token ids (a list of ints), or "
                 "give one: Pipeline(model, tokenizer) or Pipeline.from_pretrained on a folder with tokenizer "
                 "files")


class RenderedPrompt(NamedTuple):
    """A prompt already tokenized: ``text`` is kept as the output's ``prompt``."""

    text: str
    token_ids: list[int]


def prompt_token_ids(prompt: Any, tokenizer: Any, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of one prompt, checked against the vocabulary and ``max_model_len``.

    Raises ``TypeError`` / ``ValueError`` naming what is wrong (the pipeline
    turns them into that request's error).
    """
    if isinstance(prompt, RenderedPrompt):
        ids = list(prompt.token_ids)
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string; at least one token is needed")
        if tokenizer is None:
            raise ValueError(_NO_TOKENIZER)
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError(f"prompt is {type(prompt).__name__}; pass a str (text) or a list of int token ids "
                        "(decode bytes first)")
    elif hasattr(prompt, "tolist"):  # a tensor or an array
        ids = prompt.tolist()
        if not isinstance(ids, list):
            ids = [ids]
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty; at least one token is needed")
    if not set(map(type, ids)) <= {int}:
        bad = next(t for t in ids if type(t) is not int)
        raise TypeError(f"prompt holds {bad!r} ({type(bad).__name__}); token ids must be ints")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"prompt token id {bad} at position {ids.index(bad)} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, longer than max_model_len={max_model_len}")
    return ids


_MASK63 = (1 << 63) - 1


def request_params(params: Any, number: int, *, vocab_size: int, max_logprobs: int, tokenizer: Any,
                   eos_token_id: int | None, extra_eos: Sequence[int], seed: int | None) -> SamplingParams:
    """One request's :class:`SamplingParams`, checked against the model and completed.

    Checks: ``SamplingParams.validate_for_model`` (token ids in the vocabulary,
    ``logprobs <= max_logprobs``, ``top_k`` bounds, masks that leave a
    token, also against ``eos_token_id`` and the extra EOS ids), and that stop
    strings / bad words have a tokenizer. Completes:
    bad words resolved to token ids, the model's extra EOS ids as stop ids,
    and for a random-sampling request without a seed one derived from
    (``seed``, its arrival ``number``), so a run is reproducible from a fresh
    pipeline. Raises ``TypeError`` / ``ValueError`` (that request fails).
    """
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if params.stop and tokenizer is None:
        raise ValueError(f"stop={params.stop!r} needs a tokenizer; the pipeline has none")
    if params.bad_words and params.bad_words_token_ids is None:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids instead")
        params = params.resolve_bad_words(lambda s: tokenizer.encode(s, add_special_tokens=False))
    params.validate_token_ids(vocab_size)  # before the extra EOS ids are appended: name the user's ids
    extra = tuple(e for e in extra_eos if e not in params.stop_token_ids)
    if extra and not params.ignore_eos:  # the scheduler knows one EOS; the rest are stop ids
        params = replace(params, stop_token_ids=params.stop_token_ids + extra)
    params.validate_for_model(vocab_size, max_logprobs=max_logprobs, eos_token_id=eos_token_id)
    if seed is not None and params.seed is None and not params.is_greedy:
        params = replace(params, seed=(seed * 0x9E3779B97F4A7C15 + number) & _MASK63)
    return params


def _is_one_prompt(prompts: Any) -> bool:
    if isinstance(prompts, (str, RenderedPrompt)):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and all(type(t) is int for t in prompts)


def batch_arguments(prompts: Any, sampling_params: Any, priorities: Any) -> list[tuple[Any, Any, int]]:
    """Check a batch call's arguments; ``(prompt, params, priority)`` per prompt.

    Malformed *calls* raise here (nothing is queued); a malformed *prompt*
    inside a well-formed list fails that request only.
    """
    if isinstance(prompts, (bytes, bytearray, memoryview)):
        raise TypeError(f"prompts is {type(prompts).__name__}; pass a str, a list of int token ids, or a list of "
                        "those (decode bytes first)")
    if _is_one_prompt(prompts):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, Mapping):
        raise TypeError(f"prompts must be a list of strings or of token-id lists, got {type(prompts).__name__}")
    num = len(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * num
    elif isinstance(sampling_params, Sequence) and len(sampling_params) == num:
        params = list(sampling_params)
    else:
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {num} (one per prompt)")
    if priorities is None:
        priorities = [0] * num
    elif not isinstance(priorities, Sequence) or len(priorities) != num:
        raise ValueError(f"priorities must be None or a list of {num} ints (one per prompt)")
    return list(zip(prompts, params, priorities))


def _is_message(item: Any) -> bool:
    return isinstance(item, Mapping) and "role" in item


def conversations_of(messages: Any) -> tuple[list[list[Mapping[str, Any]]], bool]:
    """``(conversations, single)``: one conversation (a list of ``{"role", "content"}``
    dicts) or a list of them, as a list; ``single`` says which was given."""
    if isinstance(messages, Sequence) and not isinstance(messages, str) and messages:
        if all(_is_message(m) for m in messages):
            return [list(messages)], True
        if all(isinstance(c, Sequence) and not isinstance(c, str) and c and all(_is_message(m) for m in c)
               for c in messages):
            return [list(c) for c in messages], False
    raise TypeError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} dicts) or "
                    f"a list of conversations, got {type(messages).__name__}: {str(messages)[:80]!r}")


def render_chat(tokenizer: Any, conversation: list[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> RenderedPrompt:
    """Apply the tokenizer's chat template to one conversation.

    The template writes every special token the model expects (BOS included,
    if it has one), so the text is tokenized with ``add_special_tokens=False``:
    no second BOS (as vLLM's ``LLM.chat``).
    """
    if tokenizer is None:
        raise ValueError("chat() needs a tokenizer with a chat template; the pipeline has none (pass token ids "
                         "to generate() instead)")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=... (a Jinja template string) "
                         "or format the prompt yourself and call generate()")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **dict(chat_template_kwargs or {}))
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return RenderedPrompt(text, ids)
