"""Chat templates render exactly as Hugging Face transformers renders them."""

from __future__ import annotations

import pytest

from gateway.openai.templates import InvalidTemplate, compile_template, render_chat
from shared.errors import BadRequest
from tests.openai.conftest import CHATML, LLAMA3

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "  Name a river.  "},
]


def test_llama3_template_renders_exactly() -> None:
    text = render_chat(LLAMA3, MESSAGES, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a river.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chatml_template_renders_exactly() -> None:
    text = render_chat(CHATML, MESSAGES, bos_token="<s>", eos_token="</s>")
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n  Name a river.  <|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_without_generation_prompt_the_reply_turn_stays_closed() -> None:
    text = render_chat(CHATML, MESSAGES[:2], add_generation_prompt=False)
    assert (
        text
        == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    )


def test_hf_conventions_tojson_trim_blocks_and_generation_block() -> None:
    source = (
        "{% for m in messages %}\n"
        "  {% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}"
    )
    # lstrip_blocks eats the indent, trim_blocks the newline after each tag; é stays é
    assert (
        render_chat(source, [{"role": "user", "content": "é"}])
        == '{"role": "user", "content": "é"}'
    )


def test_raise_exception_is_a_400_naming_messages() -> None:
    with pytest.raises(BadRequest) as err:
        render_chat(CHATML, [{"role": "tool", "content": "x"}])
    assert err.value.message == "unknown role: tool"
    assert err.value.param == "messages"


def test_the_sandbox_refuses_unsafe_templates() -> None:
    with pytest.raises(BadRequest) as err:
        render_chat("{{ messages.__class__.__mro__ }}", [])
    assert err.value.code == "chat_template_error"
    with pytest.raises(BadRequest):
        render_chat("{{ messages.append(1) }}", [])  # immutable: no mutation of inputs


def test_a_broken_template_is_a_server_error_and_compiles_are_cached() -> None:
    with pytest.raises(InvalidTemplate) as err:
        compile_template("{% for %}")
    assert err.value.status == 500
    assert compile_template(CHATML) is compile_template(CHATML)
