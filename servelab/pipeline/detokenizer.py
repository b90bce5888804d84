"""Incremental detokenizer with stop strings.

Turning token ids into a text *stream* has two traps:

1. A token is not a unit of text. With byte-level BPE one character may span
   several tokens (the first ones decode to U+FFFD), and with SentencePiece a
   token's leading space depends on the token before it. So each step decodes
   a short window of recent tokens twice — with and without the new ones — and
   emits the difference, waiting while the window ends in an incomplete
   character. The window starts a few tokens back (``prefix_offset``) so the
   context that decides spaces is always there.
2. A stop string may arrive split across tokens ("Obs" + "erv" + "ation:").
   Text already streamed cannot be taken back, so the last
   ``len(longest stop) - 1`` characters are held back until they can no longer
   begin a stop string. When a stop string completes, the text is cut before
   it (or after it, with ``include_stop_str_in_output``) and the request stops.

Stop strings see special tokens. With ``skip_special_tokens`` (the default)
the streamed text leaves special tokens out, but ``stop=["<|im_end|>"]``
must still fire when the model emits ``<|im_end|>``. So stop strings are
matched against a *match text*: the output text with each generated special
token's literal text (``"<|im_end|>"``, ``"</s>"``...) inserted where it
occurred. The visible text is cut before the stop string (whose special
literals it never contained); with ``include_stop_str_in_output`` the stop
string follows verbatim. With ``skip_special_tokens=False`` the literals are
in the text already and the two texts coincide. A stop string made only of
ordinary characters therefore behaves exactly as before; for ending on a
special token no matter the text, ``SamplingParams.stop_token_ids`` remains
the cheaper tool (the scheduler checks ids, no decoding).

Stop *token ids*, EOS and ``min_tokens`` are the scheduler's business; stop
strings are checked here, and only once ``min_tokens`` outputs exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Tokens of context decoded before the first new token: enough for tokenizers
# whose decoding of a token depends on its left neighbours.
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


@dataclass
class DetokenizerDelta:
    """What one ``update`` produced: text safe to stream now, and the stop
    string that ended the request (None while it goes on)."""

    text: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids,
            skip_special_tokens=...)``).
        prompt_token_ids: the prompt, used only as left context.
        stop: stop strings; the request ends at the first one that appears.
        include_stop_str_in_output: keep the stop string in the text.
        min_tokens: ignore stop strings until this many tokens were generated.
        skip_special_tokens: drop special tokens (EOS, BOS...) from the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        if not hasattr(tokenizer, "decode"):
            raise TypeError(f"tokenizer must have a decode method, got {type(tokenizer).__name__}")
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}]={s!r} must be a non-empty string")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(f"min_tokens={min_tokens!r} must be an int >= 0")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(self._num_prompt - CONTEXT_TOKENS, 0)
        self._read_offset = self._num_prompt
        self.output_text = ""  # all text decoded so far (minus anything after a stop)
        self._num_emitted = 0  # characters of output_text already streamed
        self.stop_string: str | None = None
        # Stop matching: output_text with the literals of skipped special tokens
        # inserted; _inserted holds (position in _match_text, literal length).
        self._match_text = ""
        self._inserted: list[tuple[int, int]] = []
        self._special = _special_literals(tokenizer) if self.stop and skip_special_tokens else {}

    @property
    def num_output_tokens(self) -> int:
        return len(self._ids) - self._num_prompt

    @property
    def finished(self) -> bool:
        return self.stop_string is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_tokens(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character still missing its bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text):]

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add generated tokens; return the text that may be streamed now."""
        if self.finished:
            raise ValueError("update() after a stop string ended the request")
        for token_id in new_token_ids:
            self._ids.append(token_id)
            previous_len = len(self._match_text)
            new_text = self._decode_new_tokens()
            self.output_text += new_text
            if not self.stop:
                continue
            self._match_text += new_text
            literal = self._special.get(token_id)
            if literal:
                self._inserted.append((len(self._match_text), len(literal)))
                self._match_text += literal
            if self.num_output_tokens >= self.min_tokens and self._find_stop(previous_len):
                break  # tokens after a stop string are dropped
        if self.finished:
            return DetokenizerDelta(self._take(len(self.output_text)), self.stop_string)
        return DetokenizerDelta(self._take(len(self.output_text) - self.hold_back))

    def _find_stop(self, new_text_start: int) -> bool:
        # Only occurrences that end in the new text count: earlier ones were
        # either checked already or came before min_tokens.
        best = None
        for s in self.stop:
            at = self._match_text.find(s, max(new_text_start - len(s) + 1, 0))
            # earliest start wins; at the same start, the longer string
            if at != -1 and (best is None or (at, -len(s)) < (best[0], -len(best[1]))):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        # Match-text position -> output_text position: drop the inserted literals before it.
        cut = at - sum(min(length, max(at - pos, 0)) for pos, length in self._inserted)
        self.output_text = self.output_text[:cut] + (s if self.include_stop_str_in_output else "")
        self.stop_string = s
        return True

    def flush(self) -> str:
        """Release the held-back text once the request ended for another reason."""
        return self._take(len(self.output_text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self._num_emitted)
        delta = self.output_text[self._num_emitted:upto]
        self._num_emitted = upto
        return delta


def _special_literals(tokenizer: Any) -> dict[int, str]:
    """Special token id -> its literal text, for the ids a skipping decode leaves out."""
    ids: set[int] = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    literals = {}
    for i in ids:
        if tokenizer.decode([i], skip_special_tokens=True) == "":
            literal = tokenizer.decode([i], skip_special_tokens=False)
            if literal:
                literals[i] = literal
    return literals
