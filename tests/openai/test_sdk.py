"""The official openai SDK, sync and async, against a real gateway and sim workers (real HTTP,
real Redis): genq is a drop-in `base_url`."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.openai.conftest import (
    API_KEY,
    BARE,
    CHAT,
    GONE,
    LLAMA,
    SLOW,
    TOOLS,
    GenqServer,
    job_spec,
)
from worker.sim import build_tokenizer

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi there"}]


def test_models_lists_live_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == sorted([CHAT, LLAMA, BARE, SLOW, TOOLS])  # not sim-gone: no live worker


def test_completion(client: openai.OpenAI, server: GenqServer) -> None:
    r = client.completions.create(model=CHAT, prompt="the model", max_tokens=12, seed=7)
    assert r.object == "text_completion" and r.model == CHAT
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 12, 14)
    job = httpx.get(
        f"{server.url}/v1/jobs/{r.id.removeprefix('cmpl-')}",
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert job["status"] == "succeeded" and job["priority"] == "interactive"
    assert job["text"] == choice.text


async def test_completion_async(aclient: openai.AsyncOpenAI, client: openai.OpenAI) -> None:
    r = await aclient.completions.create(model=CHAT, prompt="the model", max_tokens=12, seed=7)
    same = client.completions.create(model=CHAT, prompt="the model", max_tokens=12, seed=7)
    assert r.choices[0].text == same.choices[0].text  # the sim is deterministic per seed


def test_completion_of_several_prompts_and_token_ids(client: openai.OpenAI) -> None:
    r = client.completions.create(model=CHAT, prompt=["a", "the model"], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.completion_tokens == 12
    ids = build_tokenizer().encode("the model").ids
    by_ids = client.completions.create(model=CHAT, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=CHAT, prompt="the model", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_completion_renders_the_models_template(
    client: openai.OpenAI, server: GenqServer, db: redis.Redis
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        *USER,
    ]
    r = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=5)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    spec = job_spec(db, server.keys, r.id.removeprefix("chatcmpl-"))
    assert build_tokenizer().decode(spec.input_ids, skip_special_tokens=False) == prompt
    assert r.usage is not None and r.usage.prompt_tokens == len(spec.input_ids)


def test_llama3_template_through_the_stack(
    client: openai.OpenAI, server: GenqServer, db: redis.Redis
) -> None:
    r = client.chat.completions.create(model=LLAMA, messages=USER, max_tokens=2)
    spec = job_spec(db, server.keys, r.id.removeprefix("chatcmpl-"))
    assert build_tokenizer().decode(spec.input_ids, skip_special_tokens=False) == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_streamed_chat_with_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=CHAT, messages=USER, max_tokens=20, seed=3)
    stream = client.chat.completions.create(
        model=CHAT,
        messages=USER,
        max_tokens=20,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last_choice, usage = chunks
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last_choice.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 20
    assert usage.usage.model_dump() == whole.usage.model_dump()  # type: ignore[union-attr]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content


async def test_streamed_chat_async_without_usage(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model=CHAT, messages=USER, max_tokens=8, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


async def test_streamed_completion_async(aclient: openai.AsyncOpenAI) -> None:
    whole = await aclient.completions.create(model=CHAT, prompt="hello", max_tokens=15, seed=1)
    stream = await aclient.completions.create(
        model=CHAT, prompt="hello", max_tokens=15, seed=1, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_runs_n_jobs(client: openai.OpenAI, server: GenqServer) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT, messages=USER, max_tokens=10, n=2, seed=5
    )
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage is not None and r.usage.completion_tokens == 20
    single = client.chat.completions.create(model=CHAT, messages=USER, max_tokens=1)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # type: ignore[union-attr]
    job_ids = raw.headers["x-job-ids"].split(",")
    assert len(job_ids) == 2 and job_ids[0] == r.id.removeprefix("chatcmpl-")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for i, job_id in enumerate(job_ids):
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=auth).json()
        assert job["status"] == "succeeded" and job["text"] == r.choices[i].message.content
        assert job["metadata"] == {"api": "openai.chatcmpl", "request": r.id, "choice": i}


def test_n_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=CHAT, messages=USER, max_tokens=6, n=2, stream=True
    )
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert roles[:2] == [0, 1] and finished == {0, 1}


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings(client: openai.OpenAI, as_list: bool) -> None:
    full = client.completions.create(model=CHAT, prompt="x", max_tokens=30, temperature=0)
    text = full.choices[0].text
    words = text.split()
    stop = " " + words[len(words) // 2]
    expected = text[: text.index(stop)]
    stopped = client.completions.create(
        model=CHAT,
        prompt="x",
        max_tokens=30,
        temperature=0,
        stop=[stop, "zzz"] if as_list else stop,
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=CHAT, prompt="x", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == expected


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=CHAT, messages=USER, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    cmpl = client.completions.create(model=CHAT, prompt="x", max_tokens=4, logprobs=3)
    lp = cmpl.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    # a dict per token: the sim's alternatives may repeat a token, which then counts once
    assert lp.top_logprobs and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    plain = client.chat.completions.create(model=CHAT, messages=USER, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_max_completion_tokens_wins_and_extras_are_ignored(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=CHAT,
        messages=USER,
        max_tokens=50,
        max_completion_tokens=3,
        user="alice",
        presence_penalty=0.5,
        frequency_penalty=0.5,
        top_p=0.9,
        extra_body={"some_future_field": {"x": 1}, "top_k": 4},
    )
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_logit_bias_bans_a_token_and_genqs_sampler_extensions_pass_in_extra_body(
    client: openai.OpenAI,
) -> None:
    tokenizer = build_tokenizer()  # each sim word is one token: its text gives its ids back

    def completion(**kw: object) -> list[int]:
        r = client.completions.create(model=CHAT, prompt="the model", max_tokens=30, seed=3, **kw)
        return tokenizer.encode(r.choices[0].text).ids

    plain = completion()
    common = max(set(plain), key=plain.count)
    banned = completion(logit_bias={str(common): -100})
    assert common not in banned and len(banned) == 30

    def chat(**extra: object) -> tuple[list[int], str | None]:
        r = client.chat.completions.create(
            model=CHAT, messages=USER, max_tokens=30, seed=3, extra_body=extra
        )
        return tokenizer.encode(r.choices[0].message.content or "").ids, r.choices[0].finish_reason

    plain, _ = chat()
    first, word = plain[0], tokenizer.decode([plain[1]]).strip()
    assert chat(stop_token_ids=[first]) == ([first], "stop")  # it ends the job at once
    held, reason = chat(stop_token_ids=[first], min_tokens=30, banned_strings=[word.upper()])
    assert reason == "length" and len(held) == 30 and first not in held
    assert word not in tokenizer.decode(held).lower()


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logit_bias": {"99999": -100}}, "logit_bias", ["99999", "vocabulary"]),
        ({"logit_bias": {"x": -100}}, "logit_bias.x", ["token id"]),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", ["9", "8"]),
    ],
)
def test_bad_sampler_extensions_are_4xx_naming_the_field(
    client: openai.OpenAI, extra: dict[str, object], param: str, words: list[str]
) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=CHAT, prompt="the model", extra_body=extra)
    assert err.value.status_code in (400, 422) and getattr(err.value, "param", None) == param
    assert all(w in err.value.message for w in words)


# ---- errors -------------------------------------------------------------------------------


def test_context_length_exceeded_is_400_with_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=CHAT, prompt="the model", max_tokens=8192)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    assert "prompt is 2 tokens and max_tokens is 8192" in err.value.message
    assert "maximum context length of 8192 tokens" in err.value.message
    assert err.value.param == "max_tokens"


def test_chat_without_template_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=BARE, messages=USER)
    assert err.value.code == "chat_template_missing" and "no chat template" in err.value.message


def test_template_raise_exception_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=CHAT, messages=[{"role": "tool", "content": "42", "tool_call_id": "t1"}]
        )
    assert err.value.body == {
        "message": "unknown role: tool",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "chat_template_error",
    }


def test_tools_for_a_template_that_takes_none_are_400(client: openai.OpenAI) -> None:
    """ChatML as the test gives it renders no tools: genq does not prompt with them."""
    tool: ChatCompletionToolParam = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=CHAT, messages=USER, tools=[tool])
    assert err.value.param == "tools" and err.value.code == "tools_unsupported"


def test_bad_api_key_is_401(server: GenqServer) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model=CHAT, messages=USER)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


async def test_unknown_model_is_404(aclient: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await aclient.chat.completions.create(model="no-such-model", messages=USER)
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_invalid_field_is_422_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model=CHAT, messages=USER, temperature=5)
    assert err.value.param == "temperature" and "less than or equal to 2" in err.value.message
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.completions.create(model=CHAT, prompt="x", n=0)
    assert err.value.param == "n"


def test_malformed_json_is_400_in_openai_shape(server: GenqServer) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400  # as OpenAI answers a body it cannot parse
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == "body"


def test_model_without_live_worker_is_503(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=GONE, messages=USER)
    assert err.value.status_code == 503 and err.value.code == "model_unavailable"
