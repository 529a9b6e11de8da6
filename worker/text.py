"""A job's text and stop strings, made from its token ids (GENQ_DETOKENIZE=worker), and the
stop-string rules every engine that matches them follows.

Rules (the sim engine's, which tests hold as the reference): a stop string ends the job with
finish reason `stop`, the text cut where it begins; text that could still begin a stop string
is held back, never sent before it is known not to; when the job ends otherwise (a stop
token, its length) what was held is sent. A job resumed by a later attempt holds back, at
the resume point, exactly what the earlier attempt held back, so nothing is lost or doubled.

In the worker, `TextStream` does this per job with tokenizers' `DecodeStream` (incremental:
each token decoded against the few before it, so multi-byte characters and leading-space
markers come out as a full decode would). A stop string found here sends a cancel to the
engine, which may have run one step more: those tokens are never sent.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 4
"""Prompt tokens a job's text is decoded after (not sent): enough for any decoder's context."""


def first_stop(text: str, stops: list[str], new_from: int) -> int:
    """Index where the earliest stop string ending in `text[new_from:]` begins, or -1."""
    best = -1
    for stop in stops:
        i = text.find(stop, max(0, new_from - len(stop) + 1))
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still begin a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


class TextStream:
    """One attempt of one job: token ids in, the text to send out, stop strings matched."""

    __slots__ = ("_decode", "_held", "_stops", "_tokenizer", "done")

    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], prompt_ids: list[int], resume_ids: list[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._decode = DecodeStream(skip_special_tokens=True)
        self.done = False
        """A stop string ended the job here: whatever the engine still sends is dropped."""
        # The prompt's last tokens as context: decoded alone, a first token loses its leading
        # space with some decoders (SentencePiece's), as it would at the start of a text.
        for t in prompt_ids[-CONTEXT_TOKENS:]:
            self._piece(t)
        sent = "".join(self._piece(t) for t in resume_ids)
        self._held = sent[len(sent) - held_back(sent, stops) :] if stops else ""
        """Text decoded but not sent: it could begin a stop string."""

    def _piece(self, token_id: int) -> str:
        return self._decode.step(self._tokenizer, token_id) or ""

    def feed(self, token_ids: list[int], finished: bool) -> tuple[str, int]:
        """The text to send for these tokens, and how many of them to keep: all of them,
        unless a stop string ended the job (then `done` is set and the text stops before it)."""
        if not self._stops:
            return "".join(self._piece(t) for t in token_ids), len(token_ids)
        text = self._held
        for n, token_id in enumerate(token_ids, 1):
            new_from = len(text)
            text += self._piece(token_id)
            cut = first_stop(text, self._stops, new_from)
            if cut >= 0:
                self.done = True
                self._held = ""
                return text[:cut], n
        hold = 0 if finished else held_back(text, self._stops)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], len(token_ids)


class Detokenizer:
    """The model's tokenizer, loaded once per worker, and a stream per job."""

    def __init__(self, tokenizer_json: str) -> None:
        self._tokenizer = Tokenizer.from_str(tokenizer_json)

    def stream(self, stops: list[str], prompt_ids: list[int], resume_ids: list[int]) -> TextStream:
        return TextStream(self._tokenizer, stops, prompt_ids, resume_ids)
