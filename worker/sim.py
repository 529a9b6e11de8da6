"""The `sim` engine: deterministic text without a model, for tests and capacity planning.

Tokens are a pure function of (prompt ids, seed, sampler settings, position), so the same
request always gives the same text, and a job resumed at position k continues exactly as an
undisturbed run would. Each decode step takes `step_ms` whatever the batch size (like a GPU
step); a new job first waits a prefill delay proportional to its prompt length.

Prefill (`prefill_ms_per_1k`, GENQ_SIM_PREFILL_MS_PER_1K): by default each job's prefill runs
beside the others', costing no step time. With `prefill_chunk_tokens`
(GENQ_SIM_PREFILL_CHUNK_TOKENS) it runs as on a GPU: one job after another, at most that many
prompt tokens a step, each step taking their prefill time on top of its decode time, so every
running job waits for it (what makes recomputing a prefix cost the whole batch).

Prefix cache (`cache_tokens`, GENQ_SIM_CACHE_TOKENS; off when 0): like the GPU engines' it
holds pages of 256 tokens, named by their hash chain (shared/pages.py), least recently used
dropped first. A job's leading prompt pages found there cost no prefill time and are its
usage's cached tokens; its prompt's pages are cached when it starts, and its reply's when it
ends (a conversation's next turn finds its history).

The settings a real sampler applies per token act on the sim's draw, so tests can see them:
its logits are 0 for each of its words (the only tokens it emits) and -inf for every other
token. `logit_bias` is added to them: the draw at each position is then softmax-weighted (a
word at -100 is, in effect, never drawn; one at 100 always is; a bias on any other token
changes nothing). A word that may not come next is left out of that position's draw, which
then picks among the rest: a stop token id before `min_tokens` tokens, and a word that would
complete one of `banned_strings` (matched without regard to case, in the text generated, as
exllamav2 and exllamav3 match them). A job none of whose words may come next ends there, as at
EOS (`finish_reason` "stop").

Fault injection (tests only, off by default): with `poison_marker` set, a job whose prompt
contains that string fails in the engine at its first decode step, on every attempt, while the
rest of the batch goes on: the worker's poison-job path (retry, then dead-letter) under test.

Chat: the card ships `CHAT_TEMPLATE`, so `/v1/chat/completions` works out of the box. Each
message is its role as a plain-text header line, its content, then EOS; the prompt starts
with BOS and ends with an open `assistant` header when a reply is wanted:

    <s>system
    Be brief.</s>
    user
    Hi</s>
    assistant

With `tools`, a system turn lists them first; an assistant's calls are Hermes's
`<tool_call>` blocks (genq's tool calling reads and writes that format for this template). A
worker's GENQ_CHAT_TEMPLATE still replaces it.

Constraints (`EngineJob.grammar`): the sim runs the same llguidance matcher as the GPU engines
(worker/constraint.py) and only ever emits a token it allows, so on a laptop and in CI the
whole pipeline emits text that fits the job's schema, regex, grammar or tool call. Its choice
among the allowed tokens is deterministic (`_constrained_pick`): the grammar's end as soon as
it may end, after a few tokens; then a closing `"`, `)`, `]` or `}` half the time, or once
the output is long (and then other punctuation, which moves a pattern on); otherwise its own
next word when allowed, or some allowed plain token. Where the grammar offers a tool call at
the start (`<tool_call>`, a special token of its tokenizer), it takes it unless the job's
seed is odd. Each call it opens gets a budget of its own, counted in the tokens it chose (those
the grammar forces, such as the call's keys, cost none), so arguments differ from seed to
seed. Where the grammar allows another call after one (`parallel_tool_calls` not false), the
sim makes 1 to `SIM_MAX_CALLS` calls, as the job's seed says, while `max_tokens` leaves room
for one more as long as the longest so far. A character of several bytes (a constraint can
force one) is emitted whole, once its last byte's token is generated.
A matcher that fails (a limit llguidance hits as the output grows) fails the job with
`constraint_failed`, the job's own fault, as the GPU engines do.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import math
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.constraints import CONSTRAINT_FAILED
from shared.pages import PAGE_TOKENS, page_hashes, shared_pages
from shared.schemas import ModelCard
from worker.constraint import (
    Grammars,
    JobMatcher,
    MaskBatch,
    allowed_ids,
    allows,
)
from worker.engine import EngineJob, SamplingSupport, StepOutput
from worker.text import first_stop, held_back

SIM_NAME = "sim"
EOS = "</s>"
BOS = "<s>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (TOOL_CALL, TOOL_CALL_END)
"""Added after training (ids after the trained vocabulary): the tool-call markers of the
sim's chat template, one token each as in Hermes/Qwen tokenizers."""
CONSTRAINED_BUDGET = 24
"""Tokens into a constraint (or chosen in a tool call) after which the sim closes what it can
(a quote, a bracket, the end) rather than open more."""
SIM_MAX_CALLS = 3
"""Most tool calls in one reply, where the grammar allows several (each job: 1 to this many,
from its seed)."""
_LOW_BITS = 32
"""Bits of `_mix` a constrained pick drops: its low bits barely change with the position (one
multiply carries only upwards), so a choice made from them was the same all through a job."""
_CALLS_BITS = 40
"""Where in the job's random base the number of its tool calls is read."""
_UTF8_MAX_BYTES = 4
"""The most bytes of one character: a held sequence this long is emitted as it decodes."""
_CLOSERS = ('"', ")", "]", "}")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}system\nTools you may call, one <tool_call> each: <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] }}\n"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>\n{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}"
    "{{ message['content'] or '' }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant\n{% endif %}"
)
_VOCAB_SIZE = 2048
_MASK64 = (1 << 64) - 1
_CORPUS = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there their one all we can has been if more when will would
who so no time out up into its than then them these two may first any like our over such
also new only some could other very what about after well where just between most many those
model token queue worker gateway stream batch cache prompt reply event redis python system
simulated engine output sample text words answer request client server network memory speed
light river stone cloud green quiet morning garden window bridge paper music ocean signal
""".split()


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on a small built-in corpus: every corpus word is one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [" ".join(_CORPUS[i:] + _CORPUS[:i]) for i in range(0, len(_CORPUS), 7)] * 4
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


@dataclass(slots=True)
class _SimJob:
    job: EngineJob
    base: int
    ready_at: float
    position: int
    text: str = ""
    sent_chars: int = 0
    poisoned: bool = False
    matcher: JobMatcher | None = None
    """The job's constraint (`EngineJob.grammar`), advanced over every token emitted."""
    mask: memoryview | None = None
    """This step's next-token mask of `matcher` (a row of the engine's `MaskBatch`)."""
    cached: int = 0
    """Prompt tokens found in the prefix cache (not prefilled again)."""
    prefill_left: int = 0
    """Prompt tokens still to prefill (one job at a time: `prefill_chunk_tokens`)."""
    generated: list[int] = field(default_factory=list)
    """Token ids emitted (kept only with a prefix cache: its pages are cached at the end)."""
    weights: list[float] | None = None
    """Each word's weight in the draw, as `logit_bias` makes it; None: all alike."""
    banned: tuple[str, ...] = ()
    """`banned_strings`, lower-cased."""
    tail: str = ""
    """The end of the text generated, lower-cased: as much as a banned string can reach back
    from a new word."""
    calls: int = 0
    """Tool calls opened (`<tool_call>` emitted)."""
    call_from: int = 0
    """The position of the current call's `<tool_call>`."""
    longest_call: int = 0
    """Tokens the longest finished call took, its `<tool_call>` to the next one's."""
    chosen: int = 0
    """Tokens of the current call the sim chose among several (its budget)."""
    pending: list[int] = field(default_factory=list)
    """Tokens holding the first bytes of a character not yet whole."""


class SimEngine:
    """Deterministic stand-in engine. Not a model: its card says `simulated: true`."""

    # No pages: batch slots alone limit admission. Size is checked by `add`, which refuses a
    # job over max_seq_len (admitting it to fail is better than leaving it queued forever).
    page_size = 0
    total_pages = 0
    sampling_support = SamplingSupport(
        sampler=frozenset(
            {
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
            }
        ),
        elsewhere={
            "seed": "`_job_base`, as `EngineJob.seed` (the spec's, else one drawn from the job id)",
            "stop": "`_text` cuts the text at the first (the worker does, when `job.text` is off)",
            "stop_token_ids": "`_advance` ends the job on one",
            "logprobs": "`_advance` reports that many alternatives per token",
            "logit_bias": "`_next` weighs its draw by it (the sim's logits: 0 for each word)",
            "min_tokens": "`_next` draws no stop token id before that many tokens",
            "banned_strings": "`_next` draws no word that would complete one",
        },
    )
    """Sampler settings change the text (`_job_base` hashes them with the prompt and seed)."""

    def __init__(
        self,
        *,
        model_name: str = SIM_NAME,
        max_batch: int = 256,
        step_ms: float = 20.0,
        prefill_ms_per_1k: float = 5.0,
        cache_tokens: int = 0,
        prefill_chunk_tokens: int = 0,
        max_seq_len: int = 8192,
        poison_marker: str | None = None,
        chat_template: str | None = CHAT_TEMPLATE,
    ) -> None:
        self._max_batch = max_batch
        self._poison_marker = poison_marker
        self._step_s = step_ms / 1000.0
        self._prefill_s_per_token = prefill_ms_per_1k / 1000.0 / 1000.0
        self._chunk = prefill_chunk_tokens
        self._prefilling: collections.deque[_SimJob] = collections.deque()
        """Jobs waiting for their prefill, first come first (with `prefill_chunk_tokens`)."""
        self.prefill_side_by_side = not prefill_chunk_tokens
        """Without chunks, every job's prefill runs beside the others' (the worker's pace of
        prefill, worker/pace.py, is measured accordingly)."""
        self._cache_pages = cache_tokens // PAGE_TOKENS
        self._cache: OrderedDict[int, None] = OrderedDict()
        """Page hashes (`shared.pages`) the prefix cache holds, least recently used first."""
        self._tokenizer = build_tokenizer()
        self.tokenizer_json = self._tokenizer.to_str()
        self._words = self._single_token_words()
        eos_id = self._tokenizer.token_to_id(EOS)
        assert eos_id is not None  # a special token of the trainer
        self._eos_id: int = eos_id
        self._jobs: dict[str, _SimJob] = {}
        self._grammars: Grammars | None = None
        """Built at the first constrained job (most sim workers never see one)."""
        self._masks: MaskBatch | None = None
        self._token_texts = [
            self._tokenizer.decode([t], skip_special_tokens=False)
            for t in range(self._tokenizer.get_vocab_size())
        ]
        self._plain = self._plain_tokens()
        self._closers = [t for c in _CLOSERS if (t := self._tokenizer.token_to_id(c)) is not None]
        """In the order the sim prefers them: a string's end, a group's, an array's, an object's."""
        self._marks = frozenset(
            t for t in self._plain if not self._tokenizer.decode([t]).strip().isalnum()
        )
        self._specials = [
            t for name in SPECIAL_TOKENS if (t := self._tokenizer.token_to_id(name)) is not None
        ]
        self._tool_call = self._tokenizer.token_to_id(TOOL_CALL)
        self._partial = frozenset(i for i, t in enumerate(self._token_texts) if "\ufffd" in t)
        """Tokens of some bytes of a character, not all (byte-level BPE): held until whole."""
        self.card = ModelCard(
            name=model_name,
            engine="sim",
            simulated=True,
            max_seq_len=max_seq_len,
            max_batch=max_batch,
            tokenizer_sha=hashlib.sha256(self.tokenizer_json.encode()).hexdigest(),
            bos_token=BOS,
            eos_token=EOS,
            eos_token_ids=[self._eos_id],
            chat_template=chat_template,
            description="genq sim engine: deterministic placeholder text, not a language model",
        )

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def _single_token_words(self) -> list[tuple[int, str]]:
        words: list[tuple[int, str]] = []
        for w in sorted(set(_CORPUS)):
            ids = self._tokenizer.encode(" " + w).ids
            if len(ids) == 1:
                words.append((ids[0], " " + w))
        return words

    def _plain_tokens(self) -> frozenset[int]:
        """Tokens whose text is printable ASCII: what the sim picks under a constraint when
        its own word is not allowed (never half of a UTF-8 character)."""
        out = set()
        for token_id in range(self._tokenizer.get_vocab_size()):
            piece = self._tokenizer.decode([token_id])
            if piece and piece.isascii() and piece.isprintable():
                out.add(token_id)
        return frozenset(out)

    def free_pages(self) -> int:
        return 0

    def add(self, job: EngineJob) -> None:
        need = len(job.input_ids) + job.max_tokens
        if need > self.card.max_seq_len:
            raise ValueError(
                f"the job needs {need} tokens (prompt + max_tokens), over this engine's "
                f"max_seq_len of {self.card.max_seq_len}"
            )
        prompt = [*job.input_ids, *job.resume_ids]
        cached = self._cached_prefix(prompt)
        now = time.monotonic()
        sim = _SimJob(
            job=job,
            base=_job_base(job),
            ready_at=now + (len(prompt) - cached) * self._prefill_s_per_token,
            position=len(job.resume_ids),
            poisoned=self._is_poisoned(job),
            cached=min(cached, len(job.input_ids)),
            weights=self._weights(job.sampling.logit_bias),
            banned=tuple(b.lower() for b in job.sampling.banned_strings),
        )
        if job.grammar is not None:  # ConstraintError (the job's fault) if it cannot run
            self._replay(sim)
        if job.resume_ids:
            self._resume(sim)
        if self._chunk and len(prompt) > cached:  # its turn comes in `step`
            sim.prefill_left, sim.ready_at = len(prompt) - cached, math.inf
            self._prefilling.append(sim)
        elif self._chunk:
            sim.ready_at = now
        self._jobs[job.id] = sim

    def _replay(self, s: _SimJob) -> None:
        """The job's matcher, over the tokens an earlier attempt generated; token by token when
        they hold a tool call, so that its calls are counted as an undisturbed run counts them."""
        job = s.job
        assert job.grammar is not None
        if self._tool_call not in job.resume_ids:
            s.matcher = self._grammar_set().matcher(job.grammar, job.resume_ids)
            return
        m = s.matcher = self._grammar_set().matcher(job.grammar)
        for position, token_id in enumerate(job.resume_ids):
            self._note_call(s, token_id, position, m.allowed_bits() if s.calls else b"")
            m.replay([token_id])

    def _cached_prefix(self, ids: list[int]) -> int:
        """Tokens of `ids` the prefix cache holds (whole leading pages), and every full page of
        `ids` cached from now (prefilled now, or used again), most recently used last."""
        if not self._cache_pages:
            return 0
        chain = page_hashes(ids)
        hit = shared_pages(chain, self._cache.keys())
        self._remember(chain)
        return hit * PAGE_TOKENS

    def _remember(self, chain: list[int]) -> None:
        for h in chain:
            self._cache[h] = None
            self._cache.move_to_end(h)
        while len(self._cache) > self._cache_pages:
            self._cache.popitem(last=False)

    @property
    def cached_pages(self) -> list[int]:
        """The page hashes the prefix cache holds, least recently used first."""
        return list(self._cache)

    def _grammar_set(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer_json, [self._eos_id])
        return self._grammars

    def _grammar_set_masks(self) -> MaskBatch:
        if self._masks is None:
            self._masks = MaskBatch(self._grammar_set().vocab_size)
        return self._masks

    def _weights(self, logit_bias: dict[str, float]) -> list[float] | None:
        """Each word's weight, exp(its bias), scaled so the largest is 1; None when no word
        is biased (the draw stays uniform)."""
        bias = {int(k): v for k, v in logit_bias.items()}
        if not any(t in bias for t, _ in self._words):
            return None
        top = max(bias.get(t, 0.0) for t, _ in self._words)
        return [math.exp(bias.get(t, 0.0) - top) for t, _ in self._words]

    def _resume(self, s: _SimJob) -> None:
        """Rebuild the text of the tokens an earlier attempt sent and how much of it that
        attempt sent (all but what it held back as a possible stop-string start), so stop
        strings spanning the resume point are found and held-back text is not lost; and the
        text a banned string could reach back into."""
        text = "".join(self._whole(s, t) for t in s.job.resume_ids)  # leaves `pending` as it was
        s.tail = _tail(text.lower(), s.banned)
        if s.job.text:
            s.text = text
            stops = s.job.sampling.stop
            s.sent_chars = len(s.text) - (held_back(s.text, stops) if stops else 0)

    def _is_poisoned(self, job: EngineJob) -> bool:
        if self._poison_marker is None:
            return False
        return self._poison_marker in self._tokenizer.decode(job.input_ids)

    def cancel(self, job_id: str) -> bool:
        return self._jobs.pop(job_id, None) is not None

    def active(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        self._jobs.clear()
        self._prefilling.clear()

    def reset(self) -> list[str]:
        ids = list(self._jobs)
        self._jobs.clear()
        self._prefilling.clear()
        return ids

    def step(self) -> list[StepOutput]:
        if not self._jobs:
            return []
        prefill_s = self._prefill_chunk()
        now = time.monotonic()
        ready = [s for s in self._jobs.values() if s.ready_at <= now]
        if not ready:  # only prefill this step, or jobs still in their (side by side) prefill
            due = [s.ready_at for s in self._jobs.values() if s.ready_at < math.inf]
            time.sleep(prefill_s if prefill_s or not due else max(0.0, min(due) - now))
            return []
        began = time.monotonic()
        constrained = [s for s in ready if s.matcher is not None and not s.poisoned]
        if constrained:  # every constrained job's mask at once, in llguidance's threads,
            # during the step (as the GPU engines compute them during the forward pass)
            rows = self._grammar_set_masks().fill([s.matcher for s in constrained if s.matcher])
            for s, row in zip(constrained, rows, strict=True):
                s.mask = row
        if self._step_s or prefill_s:  # one decode step for the whole batch, and the chunk
            # of prefill it carries (0: none, as fast as it can)
            time.sleep(max(0.0, self._step_s + prefill_s - (time.monotonic() - began)))
        outputs = [self._poison(s) if s.poisoned else self._advance(s) for s in ready]
        for out in outputs:
            if out.finish_reason is not None or out.error is not None:
                ended = self._jobs.pop(out.job_id)
                if self._cache_pages and out.error is None:  # the reply's pages stay cached
                    self._remember(
                        page_hashes([*ended.job.input_ids, *ended.job.resume_ids, *ended.generated])
                    )
        return outputs

    def _prefill_chunk(self) -> float:
        """With `prefill_chunk_tokens`: prefill up to that many prompt tokens of the jobs
        waiting, first come first, as a GPU engine's step does; what it costs this step
        (seconds). A job whose prefill ends here decodes from the next step."""
        budget = self._chunk
        spent = 0
        while self._prefilling and budget > 0:
            s = self._prefilling[0]
            if self._jobs.get(s.job.id) is not s:  # cancelled while it waited
                self._prefilling.popleft()
                continue
            take = min(s.prefill_left, budget)
            s.prefill_left -= take
            budget -= take
            spent += take
            if not s.prefill_left:
                self._prefilling.popleft()
                s.ready_at = time.monotonic() + spent * self._prefill_s_per_token
        return spent * self._prefill_s_per_token

    def _advance(self, s: _SimJob) -> StepOutput:
        job = s.job
        picked: tuple[int, str] | StepOutput | None
        picked = self._constrained_pick(s, s.matcher) if s.matcher is not None else self._next(s)
        if isinstance(picked, StepOutput):
            return picked
        if picked is None:  # no word may come next: the job ends, as at EOS
            out = StepOutput(job.id, finish_reason="stop", prompt_tokens=len(job.input_ids))
            out.text = s.text[s.sent_chars :] if job.text else ""
            return out
        token_id, piece = picked
        s.position += 1
        if s.banned:
            s.tail = _tail(s.tail + piece.lower(), s.banned)
        if self._cache_pages:
            s.generated.append(token_id)
        out = StepOutput(
            job.id, token_ids=[token_id], prompt_tokens=len(job.input_ids), cached_tokens=s.cached
        )
        if job.sampling.logprobs is not None:
            out.logprobs = [
                self._logprob(s.base, s.position, token_id, piece, job.sampling.logprobs)
            ]
        if job.text and self._text(s, piece):
            out.finish_reason = "stop"
        elif token_id in job.sampling.stop_token_ids:
            out.finish_reason = "stop"
        elif s.matcher is not None and s.matcher.stopped:
            out.finish_reason = "stop"  # the grammar is complete: nothing more may follow
        elif s.position >= job.max_tokens:
            out.finish_reason = "length"
        if job.text:
            hold = 0 if out.finish_reason else held_back(s.text, job.sampling.stop)
            out.text = s.text[s.sent_chars : len(s.text) - hold]
            s.sent_chars += len(out.text)
        return out

    def _text(self, s: _SimJob, piece: str) -> bool:
        """Add a token's text; True when a stop string ended the job (the text cut there)."""
        s.text += piece
        stops = s.job.sampling.stop
        cut = first_stop(s.text, stops, len(s.text) - len(piece)) if stops else -1
        if cut >= 0:
            s.text = s.text[:cut]
        return cut >= 0

    def _constrained_pick(self, s: _SimJob, m: JobMatcher) -> tuple[int, str] | StepOutput:
        """The token the sim emits under its job's constraint (the rule in the module's
        docstring), consumed by the matcher; or the job's last output: ended by the grammar
        (its end chosen: nothing emitted) or failed (the grammar allows nothing)."""
        job = s.job
        row = s.mask if s.mask is not None else memoryview(m.allowed_bits())
        s.mask = None
        if m.failed:  # its mask failed (a limit of llguidance's): EOS alone is no end
            return self._constraint_failed(s, m)
        x = _mix(s.base, s.position) >> _LOW_BITS
        long = (s.chosen if s.calls else s.position) >= CONSTRAINED_BUDGET
        token_id = self._constrained_choice(s, row, x, long)
        if token_id is None:
            return self._constraint_failed(s, m)
        if token_id == self._eos_id:
            return StepOutput(
                job.id,
                finish_reason="stop",
                prompt_tokens=len(job.input_ids),
                cached_tokens=s.cached,
            )
        if s.calls or token_id == self._tool_call:
            self._note_call(s, token_id, s.position, row)
        if not m.consume(token_id):
            return self._constraint_failed(s, m)
        return token_id, self._whole(s, token_id)

    def _note_call(self, s: _SimJob, token_id: int, position: int, row: bytes | memoryview) -> None:
        """Count the tool calls the job opened, and the tokens it chose in the current one
        (`row`: the mask it chose from; a forced token costs the budget nothing)."""
        if token_id == self._tool_call:
            if s.calls:
                s.longest_call = max(s.longest_call, position - s.call_from)
            s.calls += 1
            s.call_from, s.chosen = position, 0
        elif s.calls and int.from_bytes(row, "little").bit_count() > 1:
            s.chosen += 1

    def _another_call(self, s: _SimJob) -> bool:
        """After a tool call: whether the job makes another (its seed wants more, and
        `max_tokens` leaves room for one as long as the longest so far)."""
        wanted = 1 + (s.base >> _CALLS_BITS) % SIM_MAX_CALLS
        room = s.job.max_tokens - s.position
        return s.calls < wanted and room > max(s.longest_call, s.position - s.call_from)

    def _whole(self, s: _SimJob, token_id: int) -> str:
        """The token's text, once its character is whole: a token of a character's first
        bytes is held (text ''), then the character comes with its last byte's token."""
        if not s.pending and token_id not in self._partial:
            return self._token_texts[token_id]
        s.pending.append(token_id)
        text = self._tokenizer.decode(s.pending, skip_special_tokens=False)
        if text.endswith("\ufffd") and len(s.pending) < _UTF8_MAX_BYTES:
            return ""
        s.pending.clear()
        return text

    def _constraint_failed(self, s: _SimJob, m: JobMatcher) -> StepOutput:
        """The job's end when its matcher failed: the job's own fault (`CONSTRAINT_FAILED`)."""
        why = m.error or "it allows no token"
        error = f"the constraint failed after {s.position} generated tokens: {why}"
        return StepOutput(s.job.id, error=error, error_code=CONSTRAINT_FAILED)

    def _constrained_choice(self, s: _SimJob, row: memoryview, x: int, long: bool) -> int | None:
        """The rule of the module's docstring, testing single bits first: the whole list of
        allowed tokens is made only when none of the sim's preferred ones is allowed."""
        if allows(row, self._eos_id):
            if s.calls:  # after a tool call: another, or the end
                if not self._another_call(s):
                    return self._eos_id
            elif long or (s.position > 0 and x % 4 == 0):
                return self._eos_id
        if s.position == 0 and s.job.seed % 2 == 0:
            special = next((t for t in self._specials if allows(row, t)), None)
            if special is not None:
                return special
        closer = next((t for t in self._closers if allows(row, t)), None)
        if closer is not None and (long or x % 2 == 0):
            return closer
        own, _ = self._token_at(s.base, s.position)
        if not long and allows(row, own):
            return own
        allowed = allowed_ids(row, len(self._token_texts))
        if not allowed:
            return None
        if long:  # punctuation moves a pattern on (`@`, `.`, `,`) where letters may loop
            marks = [t for t in allowed if t in self._marks]
            if marks:
                return marks[x % len(marks)]
        if allows(row, own):
            return own
        plain = [t for t in allowed if t in self._plain]
        others = [t for t in allowed if t != self._eos_id and t not in self._specials]
        choices = plain or others or allowed
        return choices[x % len(choices)]

    def _poison(self, s: _SimJob) -> StepOutput:
        return StepOutput(
            job_id=s.job.id, error="sim engine: poison marker in the prompt (test fault injection)"
        )

    def _next(self, s: _SimJob) -> tuple[int, str] | None:
        """The job's token at its position: the position's draw among the words, or where
        that word may not come next, the same draw among those that may; None if none may."""
        x = _mix(s.base, s.position)
        every = range(len(self._words))
        first = self._words[_pick(x, every, s.weights)]
        if self._may_come_next(s, *first):
            return first
        allowed = [i for i in every if self._may_come_next(s, *self._words[i])]
        return self._words[_pick(x, allowed, s.weights)] if allowed else None

    def _may_come_next(self, s: _SimJob, token_id: int, piece: str) -> bool:
        sampling = s.job.sampling
        if s.position < sampling.min_tokens and token_id in sampling.stop_token_ids:
            return False
        return not s.banned or not any(b in s.tail + piece.lower() for b in s.banned)

    def _token_at(self, base: int, position: int) -> tuple[int, str]:
        """The word a plain draw (uniform, nothing left out) gives at `position`."""
        return self._words[_pick(_mix(base, position), range(len(self._words)), None)]

    def _logprob(
        self, base: int, position: int, token_id: int, piece: str, top: int
    ) -> dict[str, Any]:
        uniform = -math.log(len(self._words))
        alternatives = [self._token_at(base ^ 0x5555, position * 31 + k) for k in range(top)]
        return {
            "token": piece,
            "token_id": token_id,
            "logprob": uniform,
            "top_logprobs": [
                {"token": p, "token_id": t, "logprob": uniform} for t, p in alternatives
            ],
        }


def _mix(base: int, position: int) -> int:
    """The job's 64 random bits for `position` (splitmix64's mixing)."""
    x = (base ^ ((position + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    return ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _MASK64


def _pick(x: int, indices: Sequence[int], weights: list[float] | None) -> int:
    """One of `indices` for the random bits `x`: uniformly, or by `weights` (by index)."""
    if weights is None:
        return indices[(x >> 17) % len(indices)]
    cumulative = list(itertools.accumulate(weights[i] for i in indices))
    at = bisect_right(cumulative, (x >> 11) / 2**53 * cumulative[-1])
    return indices[min(at, len(indices) - 1)]


def _tail(text: str, banned: tuple[str, ...]) -> str:
    """What of `text`'s end a banned string added to it could start in."""
    keep = max((len(b) for b in banned), default=1) - 1
    return text[-keep:] if keep else ""


def _job_base(job: EngineJob) -> int:
    s = job.sampling
    greedy = s.temperature == 0.0
    params = {
        "ids": job.input_ids,
        "seed": None if greedy else job.seed,
        "t": s.temperature,
        "p": s.top_p,
        "k": s.top_k,
        "mp": s.min_p,
        "rp": s.repetition_penalty,
        "pp": s.presence_penalty,
        "fp": s.frequency_penalty,
    }
    digest = hashlib.blake2b(json.dumps(params).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
