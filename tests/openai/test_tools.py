"""Tool calling through the official openai SDK, unchanged, on the sim's Hermes-style template:
1 and 3 tools, tool_choice each way, parallel calls, streamed (the SDK's stream helper
assembles the deltas) and not, and a two-turn conversation. Every call's arguments validate
against its tool's parameters."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel

from gateway.openai.toolcalls import FORMATS, ToolCallReader
from tests.openai.conftest import TOOLS

ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "search": SEARCH}


def tool(name: str) -> ChatCompletionToolParam:
    return {
        "type": "function",
        "function": {"name": name, "parameters": SCHEMAS[name], "strict": True},
    }


ONE = [tool("get_weather")]
THREE = [tool(n) for n in SCHEMAS]


def check_calls(message: object, allowed: set[str]) -> None:
    calls = message.tool_calls  # type: ignore[attr-defined]
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("tools", [ONE, THREE], ids=["1 tool", "3 tools"])
def test_required_and_named_choices_call(client: openai.OpenAI, tools: list) -> None:
    r = client.chat.completions.create(
        model=TOOLS, messages=ASK, tools=tools, tool_choice="required", max_tokens=200, seed=1
    )
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message, set(SCHEMAS))
    named = client.chat.completions.create(
        model=TOOLS,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        seed=3,
    )
    check_calls(named.choices[0].message, {"get_weather"})


def test_auto_calls_or_answers_and_none_answers(client: openai.OpenAI) -> None:
    """The sim calls where the grammar offers a call at the start unless its seed is odd."""
    called = client.chat.completions.create(
        model=TOOLS, messages=ASK, tools=THREE, max_tokens=200, seed=2
    )
    assert called.choices[0].finish_reason == "tool_calls"
    check_calls(called.choices[0].message, set(SCHEMAS))
    answered = client.chat.completions.create(
        model=TOOLS, messages=ASK, tools=THREE, max_tokens=20, seed=1
    )
    assert answered.choices[0].message.tool_calls is None and answered.choices[0].message.content
    none = client.chat.completions.create(
        model=TOOLS, messages=ASK, tools=THREE, tool_choice="none", max_tokens=20, seed=2
    )
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "length"


def calls_of(message: object) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[attr-defined]


def test_parallel_calls_and_one_call_only(client: openai.OpenAI) -> None:
    """The sim makes several calls where the grammar allows them (1 to 3, as the seed says),
    the same ones for the same seed; `parallel_tool_calls: false` makes one."""

    def ask(seed: int, **kwargs: object) -> object:
        return (
            client.chat.completions.create(  # type: ignore[call-overload]
                model=TOOLS,
                messages=ASK,
                tools=THREE,
                tool_choice="required",
                max_tokens=400,
                seed=seed,
                **kwargs,
            )
            .choices[0]
            .message
        )

    many = [ask(s) for s in range(6)]
    for m in many:
        check_calls(m, set(SCHEMAS))
    assert max(len(calls_of(m)) for m in many) >= 2
    assert len({len(calls_of(m)) for m in many}) >= 2  # not all alike: the seed decides
    assert calls_of(ask(0)) == calls_of(many[0])
    for s in range(6):
        single = ask(s, parallel_tool_calls=False)
        check_calls(single, set(SCHEMAS))
        assert len(calls_of(single)) == 1


def test_n_choices_call_differently(client: openai.OpenAI) -> None:
    """Choice j runs with seed + j: its arguments are its own (without a seed, each job's id
    seeds it: they differ as often as two draws do)."""
    r = client.chat.completions.create(
        model=TOOLS,
        messages=ASK,
        tools=ONE,
        tool_choice="required",
        max_tokens=400,
        n=2,
        seed=1,
        parallel_tool_calls=False,
    )
    first, second = (calls_of(c.message) for c in r.choices)
    assert first and second and first != second


def test_streamed_calls_assemble_as_the_whole_answer(client: openai.OpenAI) -> None:
    args = {
        "model": TOOLS,
        "messages": ASK,
        "tools": THREE,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 4,
    }
    whole = client.chat.completions.create(**args).choices[0].message  # type: ignore[call-overload]
    with client.chat.completions.stream(**args) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls or []
    ]
    # OpenAI's order: the first delta of a call brings index, id and name; then arguments
    chunks = list(client.chat.completions.create(**args, stream=True))  # type: ignore[call-overload]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:] if d.index == 0)
    assert len({d.index for d in deltas}) >= 2  # several calls, each its own index
    # OpenAI's shape of an answer that is only tool calls: the first delta says the role and
    # `content: null`; no delta carries empty content
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and "content" in first.model_fields_set
    assert first.content is None
    assert not [c for c in chunks if c.choices and c.choices[0].delta.content == ""]


def test_a_two_turn_tool_conversation(client: openai.OpenAI) -> None:
    first = (
        client.chat.completions.create(
            model=TOOLS,
            messages=ASK,
            tools=ONE,
            tool_choice="required",
            max_tokens=200,
            seed=1,
            parallel_tool_calls=False,
        )
        .choices[0]
        .message
    )
    [call] = first.tool_calls or []
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = client.chat.completions.create(
        model=TOOLS, messages=messages, tools=ONE, tool_choice="none", max_tokens=10, seed=1
    )
    assert second.choices[0].message.content and second.usage is not None
    # the call and the tool's answer are in the prompt the template rendered
    assert second.usage.prompt_tokens > first_prompt_tokens(client)


def first_prompt_tokens(client: openai.OpenAI) -> int:
    r = client.chat.completions.create(
        model=TOOLS, messages=ASK, tools=ONE, tool_choice="none", max_tokens=1
    )
    assert r.usage is not None
    return r.usage.prompt_tokens


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": ONE, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": ONE + ONE}, "tools.1.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=TOOLS, messages=ASK, **kwargs)
    assert e.value.param == param


@pytest.mark.parametrize(
    ("parameters", "why"),
    [
        ({"type": "objekt"}, "Invalid type: objekt"),
        (
            {"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9"}}},
            "unclosed character class at column 1 (`[0-9`)",
        ),
    ],
)
def test_a_tool_whose_parameters_cannot_run_is_named_with_the_reason(
    client: openai.OpenAI, parameters: dict, why: str
) -> None:
    broken: ChatCompletionToolParam = {
        "type": "function",
        "function": {"name": "broken", "parameters": parameters},
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=TOOLS, messages=ASK, tools=[*THREE[:2], broken])
    message = e.value.body["message"]  # type: ignore[index]
    assert e.value.param is not None and e.value.param.startswith("tools.2.function.parameters")
    assert message.startswith(f"{e.value.param}: ") and why in message
    assert "grammar" not in message


def test_the_reader_holds_a_marker_split_across_pieces() -> None:
    text = (
        'hi <tool_call>\n{"name":"add","arguments":{"a":1,"b":[2,"}"]}}\n</tool_call>\n'
        '<tool_call>\n{"name":"x","arguments":{}}\n</tool_call>'
    )
    for step in (1, 2, 3, 7):
        reader = ToolCallReader(FORMATS["hermes"])
        content, frags = "", {}
        for i in range(0, len(text), step):
            c, deltas = reader.feed(text[i : i + step])
            content += c
            for d in deltas:
                frags[d.index] = frags.get(d.index, "") + d.arguments
        content += reader.finish()
        assert content == "hi "
        assert [c["function"]["arguments"] for c in reader.calls] == ['{"a":1,"b":[2,"}"]}', "{}"]
        assert frags == {0: '{"a":1,"b":[2,"}"]}', 1: "{}"}


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tools_beside_a_response_format_call_or_answer_in_the_schema(
    client: openai.OpenAI, stream: bool
) -> None:
    """The sim calls where it may (even seeds) and otherwise answers: in the schema."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    args: Any = {"model": TOOLS, "messages": ASK, "tools": THREE, "response_format": fmt}
    if stream:
        with client.chat.completions.stream(**args, max_tokens=300, seed=2) as s:
            called = s.get_final_completion().choices[0]
        with client.chat.completions.stream(**args, max_tokens=300, seed=1) as s:
            answered = s.get_final_completion().choices[0]
    else:
        called = client.chat.completions.create(**args, max_tokens=300, seed=2).choices[0]
        answered = client.chat.completions.create(**args, max_tokens=300, seed=1).choices[0]
    assert called.finish_reason == "tool_calls"
    check_calls(called.message, set(SCHEMAS))
    assert answered.finish_reason == "stop" and answered.message.tool_calls is None
    jsonschema.validate(json.loads(answered.message.content or ""), CITY)
    parsed = client.chat.completions.parse(
        model=TOOLS,
        messages=ASK,
        tools=THREE,
        response_format=City,
        max_tokens=300,
        seed=1,  # type: ignore[arg-type]
    )
    message = parsed.choices[0].message
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content or "")


class City(BaseModel):
    city: str
    population: int


class Address(BaseModel):
    street: str
    city: str


class Ship(BaseModel):
    to: Address
    via: list[Address]


def test_a_pydantic_tool_with_nested_models_calls_through_its_defs(client: openai.OpenAI) -> None:
    """pydantic writes nested models as `$defs` and `#/$defs/…` references; the call's schema
    holds the parameters under `arguments`, and the references still reach them."""
    parameters = Ship.model_json_schema()
    assert "$defs" in parameters
    ship: ChatCompletionToolParam = {
        "type": "function",
        "function": {"name": "ship", "parameters": parameters},
    }
    named = client.chat.completions.create(
        model=TOOLS,
        messages=ASK,
        tools=[ship],
        tool_choice={"type": "function", "function": {"name": "ship"}},
        parallel_tool_calls=False,
        max_tokens=400,
        seed=2,
    )
    [call] = named.choices[0].message.tool_calls or []
    Ship.model_validate_json(call.function.arguments)
    either = client.chat.completions.create(  # the call's schema: anyOf one variant per tool
        model=TOOLS, messages=ASK, tools=[ship, *ONE], tool_choice="required", max_tokens=400
    )
    for c in either.choices[0].message.tool_calls or []:
        if c.function.name == "ship":
            Ship.model_validate_json(c.function.arguments)
        else:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)
