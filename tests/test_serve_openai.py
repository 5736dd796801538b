"""``tracegym serve`` against the official ``openai`` client: completions, streaming, log-probs, stop
strings, n/seed, tools, errors, API key, limits and continuous batching (tiny-random on loopback)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tracegym.engines.hf import HFEngine
from tracegym.serve import ServeLimits, ServerThread, create_app
from tracegym.types import Generation, Message, SamplingParams, ToolCall

KEY = "sk-serve-test-0d6f3a"
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tiny():
    from tracegym.models import load
    from tracegym.render import get_renderer

    model, tokenizer = load("tiny-random")
    return model, tokenizer, get_renderer("tiny-random", tokenizer)


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer, renderer = tiny
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    limits = ServeLimits(max_n=4, max_queue=8, max_batch_size=8)
    app = create_app(engine, renderer, "tiny-random", max_context=512, api_key=KEY, limits=limits)
    with ServerThread(app) as srv:
        yield srv, engine, renderer, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _direct(engine, renderer, messages, **kw):
    prompt = renderer.render_prompt([Message(**m) for m in messages])
    params = SamplingParams(stop_token_ids=tuple(renderer.stop_token_ids), **kw)
    return engine.generate([prompt], params)[0], prompt


def _collect_stream(stream):
    """Concatenate the streamed deltas per choice, as a client would."""
    out: dict[int, dict] = {}
    chunks = list(stream)
    for chunk in chunks:
        for ch in chunk.choices:
            acc = out.setdefault(ch.index, {"content": "", "tool_calls": {}, "finish": None, "token_ids": [], "lps": []})
            if ch.delta.content:
                acc["content"] += ch.delta.content
            for tc in ch.delta.tool_calls or ():
                call = acc["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if ch.finish_reason:
                acc["finish"] = ch.finish_reason
            acc["token_ids"] += (ch.model_extra or {}).get("token_ids", [])
            if ch.logprobs and ch.logprobs.content:
                acc["lps"] += ch.logprobs.content
    return out, chunks


def test_models_health_and_plain_completion(server, client):
    srv, engine, renderer, _ = server
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    assert client.models.retrieve("tiny-random").id == "tiny-random"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"  # no key needed for /health
    reply = client.chat.completions.create(model="tiny-random", messages=HI, temperature=0, max_tokens=8)
    [direct], prompt = _direct(engine, renderer, HI, temperature=0.0, max_tokens=8)
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == list(direct.token_ids)  # extension: the sampled ids
    assert choice.message.content == renderer.parse_completion(direct.token_ids).message.content
    assert choice.message.tool_calls is None and choice.logprobs is None
    assert choice.finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(direct.token_ids)
    assert reply.model == "tiny-random" and reply.object == "chat.completion"


def test_streaming_text_equals_the_non_streamed_completion(server, client):
    srv = server[0]
    kw = dict(model="tiny-random", messages=HI, temperature=1.0, seed=3, max_tokens=24)
    full = client.chat.completions.create(**kw)
    got, chunks = _collect_stream(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert got[0]["content"] == full.choices[0].message.content and len(full.choices[0].message.content) > 20
    assert got[0]["token_ids"] == full.choices[0].model_extra["token_ids"]
    assert got[0]["finish"] == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1
    raw = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={**kw, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_logprobs_are_the_engines_and_openai_shaped(server, client, tiny):
    _, engine, renderer, _ = server
    tokenizer = tiny[1]
    reply = client.chat.completions.create(model="tiny-random", messages=HI, temperature=0.8, top_p=0.9, seed=7,
                                           max_tokens=10, logprobs=True, top_logprobs=3)
    [direct], _ = _direct(engine, renderer, HI, temperature=0.8, top_p=0.9, seed=7, max_tokens=10)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert [e.model_extra["token_id"] for e in content] == list(direct.token_ids) == choice.model_extra["token_ids"]
    assert [e.logprob for e in content] == pytest.approx(list(direct.logprobs), abs=1e-6)
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.logprob <= tops[0].logprob + 1e-6
        assert entry.token == tokenizer.decode([entry.model_extra["token_id"]])
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
    # streamed: the same entries, chunk by chunk
    got, _ = _collect_stream(client.chat.completions.create(
        model="tiny-random", messages=HI, temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=True, stream=True))
    assert [e.logprob for e in got[0]["lps"]] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_stop_strings_are_removed(server, client, tiny):
    tokenizer = tiny[1]
    kw = dict(model="tiny-random", messages=HI, temperature=1.0, seed=1, max_tokens=30)  # greedy only writes newlines
    full = client.chat.completions.create(**kw)
    text = tokenizer.decode(full.choices[0].model_extra["token_ids"])
    stop = text[12:16]
    assert stop.strip() and text.find(stop) > 0
    expected = text[: text.find(stop)].strip()
    cut = client.chat.completions.create(stop=[stop, "never-seen-stop"], **kw)
    assert cut.choices[0].message.content == expected and stop not in cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"
    streamed, _ = _collect_stream(client.chat.completions.create(stop=stop, stream=True, **kw))
    assert streamed[0]["content"] == expected and streamed[0]["finish"] == "stop"


def test_n_and_seed_are_reproducible_and_match_the_engine(server, client):
    _, engine, renderer, _ = server
    kw = dict(model="tiny-random", messages=HI, temperature=1.0, max_tokens=6, n=3, seed=11)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    c = client.chat.completions.create(**{**kw, "seed": 12})
    ids = lambda r: [ch.model_extra["token_ids"] for ch in r.choices]  # noqa: E731
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert ids(a) == ids(b) != ids(c)
    direct, _ = _direct(engine, renderer, HI, temperature=1.0, max_tokens=6, n=3, seed=11)
    assert ids(a) == [list(g.token_ids) for g in direct]


def test_vllm_token_id_extensions_on_chat(server, client):
    _, engine, renderer, _ = server
    extensions = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    reply = client.chat.completions.create(model="tiny-random", messages=HI, temperature=0.8, seed=3, max_tokens=8,
                                           logprobs=True, top_logprobs=2, extra_body=extensions)
    [direct], prompt = _direct(engine, renderer, HI, temperature=0.8, seed=3, max_tokens=8)
    content = reply.choices[0].logprobs.content
    # vLLM's format: each token reads token_id:<id>, alternatives too; the prompt ids come back
    assert [e.token for e in content] == [f"token_id:{t}" for t in direct.token_ids]
    assert all(t.token == f"token_id:{t.model_extra['token_id']}" for e in content for t in e.top_logprobs)
    assert [e.logprob for e in content] == pytest.approx(list(direct.logprobs), abs=1e-6)
    assert reply.model_extra["prompt_token_ids"] == prompt
    chunks = list(client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=3, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    plain = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=3, logprobs=True)
    assert "prompt_token_ids" not in plain.model_extra and not plain.choices[0].logprobs.content[0].token.startswith("token_id:")


def test_completions_take_token_ids_and_match_the_engine(server, client, tiny):
    _, engine, renderer, _ = server
    tokenizer = tiny[1]
    prompt = renderer.render_prompt([Message(**m) for m in HI])
    kw = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)
    reply = client.completions.create(model="tiny-random", prompt=prompt, logprobs=0, n=2,
                                      extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}, **kw)
    direct = engine.generate([prompt], SamplingParams(stop_token_ids=tuple(renderer.stop_token_ids), n=2, **kw))[0]
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, gen in zip(reply.choices, direct):
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in gen.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(list(gen.logprobs), abs=1e-6)
        assert choice.model_extra["token_ids"] == list(gen.token_ids)
        assert choice.model_extra["prompt_token_ids"] == prompt
        visible = [t for t in gen.token_ids if t not in renderer.stop_token_ids]
        assert choice.text == tokenizer.decode(visible)
        assert choice.finish_reason == ("length" if gen.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(g.token_ids) for g in direct)
    # a text prompt is tokenized; top alternatives come in the legacy shape
    text = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=4, temperature=0.0, logprobs=2)
    [greedy] = engine.generate([tokenizer("Hello", add_special_tokens=False)["input_ids"]],
                               SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=tuple(renderer.stop_token_ids)))[0]
    assert text.choices[0].model_extra["token_ids"] == list(greedy.token_ids)
    assert all(len(top) >= 2 for top in text.choices[0].logprobs.top_logprobs)
    assert "prompt_token_ids" not in text.choices[0].model_extra
    cases = [
        (dict(prompt=[[1, 2], [3]]), "prompt", "one prompt"),
        (dict(prompt=[1, 10**7]), "prompt", "token ids"),
        (dict(prompt=[]), "prompt", "token ids"),
        (dict(prompt=[1, 2], stream=True), "stream", "not supported"),
        (dict(prompt=[1, 2], max_tokens=0), "max_tokens", "only with echo"),  # echo itself: test_distill_remote_teacher.py
        (dict(prompt=[1, 2], echo=True, logprobs=1), "logprobs", "with echo, logprobs must be 0"),
        (dict(prompt=[1, 2], logprobs=9), "logprobs", "0..5"),
        (dict(prompt=[1, 2], extra_body={"best_of": 2}), "best_of", "Unrecognized"),
        (dict(prompt=[1, 2], max_tokens=10**6), "max_tokens", "context"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-random", **kwargs)
        err = info.value.body
        assert err["param"] == param and words in err["message"], (kwargs, err)


def test_completions_stop_on_the_requests_stop_token_ids(server, client):
    _, engine, renderer, _ = server
    prompt = renderer.render_prompt([Message(**m) for m in HI])
    kw = dict(temperature=1.0, seed=4, max_tokens=12)
    free = client.completions.create(model="tiny-random", prompt=prompt, **kw).choices[0].model_extra["token_ids"]
    assert len(free) >= 3
    stop = free[2]
    cut = client.completions.create(model="tiny-random", prompt=prompt, extra_body={"stop_token_ids": [stop]}, **kw)
    ids = cut.choices[0].model_extra["token_ids"]
    assert ids == free[: free.index(stop) + 1] and cut.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(server, client):
    srv = server[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    cases = [
        (dict(max_tokens=10**9), "max_tokens", "context"),
        (dict(tool_choice="required", tools=[ADD_TOOL]), "tool_choice", "required"),
        (dict(tool_choice={"type": "function", "function": {"name": "add"}}, tools=[ADD_TOOL]), "tool_choice", "named"),
        (dict(response_format={"type": "json_object"}), "response_format", "json_object"),
        (dict(n=1000), "n", "1..4"),
        (dict(frequency_penalty=0.5), "frequency_penalty", "not supported"),
        (dict(top_logprobs=3), "top_logprobs", "logprobs"),
        (dict(extra_body={"best_of": 3}), "best_of", "Unrecognized"),
        (dict(temperature=3.5), "temperature", "temperature"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-random", messages=HI, **kwargs)
        err = info.value.body
        assert set(err) == {"message", "type", "param", "code"}, kwargs
        assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    r = httpx.get(srv.url + "/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key_is_required_and_never_echoed(server):
    srv = server[0]
    wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="tiny-random", messages=HI)
    assert info.value.code == "invalid_api_key" and "sk-wrong" not in str(info.value.body)
    r = httpx.get(srv.url + "/v1/models")
    assert r.status_code == 401 and KEY not in r.text and r.json()["error"]["code"] == "invalid_api_key"


def test_a_full_queue_answers_429(tiny):
    model, tokenizer, renderer = tiny
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    app = create_app(engine, renderer, "tiny-random", limits=ServeLimits(max_batch_size=1, max_queue=1))
    stepper = app.state.stepper
    results: list = []
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def call():
            results.append(client.chat.completions.create(model="tiny-random", messages=HI, temperature=0, max_tokens=2))

        with stepper.paused():
            threads = [threading.Thread(target=call) for _ in range(2)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while stepper.pending_requests < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # one request fits the batch (size 1), one waits (max_queue=1): the next one is refused at once
            assert stepper.pending_requests == 2 and stepper.waiting_requests == 1
            with pytest.raises(openai.RateLimitError) as info:
                client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=2)
            assert info.value.code == "rate_limit_exceeded" and info.value.body["type"] == "rate_limit_error"
        for t in threads:
            t.join(timeout=20)
    assert len(results) == 2 and all(r.choices[0].model_extra["token_ids"] for r in results)


def test_a_short_request_finishes_before_a_long_one_that_started_first(server, client, tiny):
    app, renderer = server[3], server[2]
    no_stop = {str(i): -100 for i in renderer.stop_token_ids}  # the long one must really run 200 tokens
    done: dict[str, float] = {}
    lengths: dict[str, int] = {}
    first_token = threading.Event()

    def long_request():
        stream = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=200, seed=1,
                                                logit_bias=no_stop, stream=True)
        ids: list[int] = []
        for chunk in stream:
            for ch in chunk.choices:
                ids += ch.model_extra.get("token_ids", [])
                if ids:
                    first_token.set()
        done["long"], lengths["long"] = time.monotonic(), len(ids)

    def short_request(k: int):
        r = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": f"q{k}"}],
                                           max_tokens=2, seed=k)
        done[f"short{k}"], lengths[f"short{k}"] = time.monotonic(), r.usage.completion_tokens

    long_thread = threading.Thread(target=long_request)
    long_thread.start()
    assert first_token.wait(20)  # the long request is decoding
    shorts = [threading.Thread(target=short_request, args=(k,)) for k in range(3)]
    for t in shorts:
        t.start()
    for t in shorts + [long_thread]:
        t.join(timeout=60)
    assert lengths["long"] == 200 and all(lengths[f"short{k}"] <= 2 for k in range(3))
    assert all(done[f"short{k}"] < done["long"] for k in range(3)), done
    assert app.state.stepper.max_active_rows >= 2  # they shared the batch


class ScriptedTokens:
    """A token engine that always returns ``ids`` and records the prompts it was given."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, ids):
        self.ids = tuple(ids)
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts.extend(list(p) for p in prompts)
        return [[Generation(token_ids=self.ids, logprobs=(-0.5,) * len(self.ids))] * params.n for _ in prompts]


@pytest.fixture(scope="module")
def scripted(tiny):
    renderer = tiny[2]
    message = Message(role="assistant", content="Let me compute.", tool_calls=(
        ToolCall(name="add", arguments={"a": 2, "b": 40}), ToolCall(name="add", arguments={"a": 1, "b": 1})))
    fake = ScriptedTokens(renderer.encode_completion(message))
    with ServerThread(create_app(fake, renderer, "scripted")) as srv:
        yield srv, fake, renderer, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_tool_calls_have_unique_ids_and_null_content(tiny):
    renderer = tiny[2]
    only_calls = Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 2, "b": 40}),
                                                        ToolCall(name="add", arguments={"a": 1, "b": 1})))
    fake = ScriptedTokens(renderer.encode_completion(only_calls))
    with ServerThread(create_app(fake, renderer, "scripted")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "2+40 and 1+1?"}]
        ids = []
        for _ in range(2):  # two turns of a conversation
            reply = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL])
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"a": 2, "b": 40}, {"a": 1, "b": 1}]
            ids += [c.id for c in choice.message.tool_calls]
            messages += [choice.message.model_dump(exclude_none=True)] + [
                {"role": "tool", "tool_call_id": c.id, "content": "42"} for c in choice.message.tool_calls]
        assert len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)
        # the second turn's prompt is the renderer's rendering of the history with those ids
        assert fake.prompts[-1] == renderer.render_prompt([_msg(m) for m in messages[:-3]], [ADD_TOOL])


def _msg(wire):
    from tracegym.engines.openai import message_from_wire

    return message_from_wire(wire).message


def test_streamed_tool_calls_accumulate_to_the_non_streamed_ones(scripted):
    srv, fake, renderer, client = scripted
    kw = dict(model="scripted", messages=[{"role": "user", "content": "2+40?"}], tools=[ADD_TOOL])
    full = client.chat.completions.create(**kw).choices[0]
    got, chunks = _collect_stream(client.chat.completions.create(stream=True, **kw))
    assert got[0]["content"] == full.message.content == "Let me compute."
    calls = [got[0]["tool_calls"][k] for k in sorted(got[0]["tool_calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    assert got[0]["finish"] == "tool_calls" and got[0]["token_ids"] == list(fake.ids)


def test_tool_choice_none_and_parallel_tool_calls_false_are_enforced(scripted):
    srv, fake, renderer, client = scripted
    messages = [{"role": "user", "content": "2+40?"}]
    one = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL], parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL], tool_choice="none")
    # no tool schemas in the prompt and no tool calls in the answer (the text stays text)
    assert fake.prompts[-1] == renderer.render_prompt([Message(role="user", content="2+40?")])
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert "<tool_call>" in none.choices[0].message.content


def test_cli_errors_are_one_line_and_the_key_comes_from_the_environment(monkeypatch, capsys):
    import tracegym.serve as serve_module
    from tracegym.cli import main

    assert main(["serve", "no-such-model", "--port", "8123"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown model 'no-such-model'") and "\n" not in err
    seen = {}
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("TRACEGYM_API_KEY", "sk-from-env")
    assert main(["serve", "tiny-random", "--max-n", "2"]) == 0
    assert seen["api_key"] == "sk-from-env" and seen["limits"].max_n == 2
    assert main(["serve", "tiny-random", "--max-queue", "-1"]) == 2


def test_smollm2_greedy_stream_and_logprobs_match_the_engine():
    """The real model: batched streaming and non-streamed requests give the engine's tokens and log-probs."""
    from tracegym.models import load
    from tracegym.render import get_renderer

    model, tokenizer = load("smollm2-135m")
    renderer = get_renderer("smollm2-135m", tokenizer)
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    with ServerThread(create_app(engine, renderer, "smollm2-135m")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="smollm2-135m", messages=messages, temperature=0, max_tokens=8, logprobs=True)
        full = client.chat.completions.create(**kw).choices[0]
        got, _ = _collect_stream(client.chat.completions.create(stream=True, **kw))
    [direct], _ = _direct(engine, renderer, messages, temperature=0.0, max_tokens=8)
    assert full.model_extra["token_ids"] == list(direct.token_ids) == got[0]["token_ids"]
    assert [e.logprob for e in full.logprobs.content] == pytest.approx(list(direct.logprobs), abs=1e-5)
    assert "Paris" in full.message.content and got[0]["content"] == full.message.content
