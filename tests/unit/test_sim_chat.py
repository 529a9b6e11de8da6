"""The sim engine's chat template: chat works on a default `genq serve`, and the prompt it
renders is the documented one (role headers as plain text, BOS and EOS as real tokens)."""

from __future__ import annotations

from tokenizers import Tokenizer

from gateway.openai.templates import render_chat
from worker.sim import BOS, CHAT_TEMPLATE, EOS, SimEngine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _render(engine: SimEngine, add_generation_prompt: bool) -> str:
    card = engine.card
    assert card.chat_template is not None
    return render_chat(
        card.chat_template,
        MESSAGES,
        add_generation_prompt=add_generation_prompt,
        bos_token=card.bos_token,
        eos_token=card.eos_token,
    )


def test_the_card_ships_the_documented_template() -> None:
    engine = SimEngine()
    assert engine.card.chat_template == CHAT_TEMPLATE
    assert _render(engine, True) == "<s>system\nBe brief.</s>\nuser\nHi</s>\nassistant\n"
    assert _render(engine, False) == "<s>system\nBe brief.</s>\nuser\nHi</s>\n"


def test_bos_and_eos_in_the_prompt_are_single_special_tokens() -> None:
    engine = SimEngine()
    tok = Tokenizer.from_str(engine.tokenizer_json)
    ids = tok.encode(_render(engine, True)).ids
    assert ids[0] == tok.token_to_id(BOS)
    assert ids.count(tok.token_to_id(EOS)) == len(MESSAGES)


def test_an_engine_may_ship_no_template() -> None:
    assert SimEngine(chat_template=None).card.chat_template is None
