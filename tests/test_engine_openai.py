"""The openai engine against ``tracegym serve`` (tiny-random in a background thread), fake servers for
retries, redaction of the API key, and what RL needs of a remote server: log-probs, token ids from the
server (``tracegym serve``; vLLM's ``token_id:123`` format) or re-tokenized and flagged, tool calls
parsed from text, the ``max_completion_tokens`` fallback and all ``n`` choices of one request."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tracegym.engines import EngineCapabilities, make_engine, require_rl_sampler
from tracegym.engines.hf import HFEngine
from tracegym.engines.openai import OpenAIEngine, OpenAIEngineError, message_from_wire, message_to_wire
from tracegym.serve import ServerThread, create_app
from tracegym.types import Generation, Message, SamplingParams, ToolCall

SECRET = "sk-test-5f8e2c91d7a04b6e"
KEY_ENV = "TRACEGYM_TEST_API_KEY"

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]},
    },
}


@pytest.fixture(scope="module")
def tiny():
    from tracegym.models import load
    from tracegym.render import get_renderer

    model, tokenizer = load("tiny-random")
    return model, tokenizer, get_renderer("tiny-random", tokenizer)


@pytest.fixture(scope="module")
def hf_server(tiny):
    model, tokenizer, renderer = tiny
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    with ServerThread(create_app(engine, renderer, "tiny-random", max_context=512)) as server:
        yield server, engine, renderer


class ScriptedTokens:
    """A token engine that always returns ``ids`` and records the prompts it was given."""

    name = "scripted"

    def __init__(self, ids):
        self.ids = tuple(ids)
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts.extend(list(p) for p in prompts)
        return [[Generation(token_ids=self.ids, logprobs=(0.0,) * len(self.ids))] * params.n for _ in prompts]


def test_models_and_greedy_chat_match_the_engine(hf_server):
    server, engine, renderer = hf_server
    client = make_engine("openai", model="tiny-random", base_url=server.url + "/v1", api_key_env=KEY_ENV)
    assert client.models() == ["tiny-random"]
    messages = [Message(role="system", content="Be brief."), Message(role="user", content="Say hi.")]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reply = client.chat(messages, None, params)
    # the same request straight through the engine: identical greedy tokens, parsed the same way
    direct = engine.generate([renderer.render_prompt(messages)], params.model_copy(update={"stop_token_ids": tuple(renderer.stop_token_ids)}))[0][0]
    assert reply == renderer.parse_completion(direct.token_ids).message
    assert reply.role == "assistant"
    assert client.usage["completion_tokens"] == len(direct.token_ids) <= 8
    assert client.usage["prompt_tokens"] == len(renderer.render_prompt(messages))


def test_tools_are_rendered_and_tool_calls_come_back(tiny):
    _, _, renderer = tiny
    call_message = Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 2, "b": 40}),))
    fake = ScriptedTokens(renderer.encode_completion(call_message))
    with ServerThread(create_app(fake, renderer, "scripted")) as server:
        client = OpenAIEngine("scripted", base_url=server.url + "/v1", api_key_env=KEY_ENV)
        history = [
            Message(role="user", content="What is 1+1 and then 2+40?"),
            Message(role="assistant", tool_calls=(ToolCall(name="add", arguments={"a": 1, "b": 1}, id="call_a"),)),
            Message(role="tool", content="2", tool_call_id="call_a", name="add"),
        ]
        parsed = client.chat_with_errors(history, [ADD_TOOL], SamplingParams(max_tokens=40))
        raw = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "scripted", "messages": [message_to_wire(m) for m in history], "tools": [ADD_TOOL]}).json()
    # the server rendered exactly what the renderer renders for these messages and tools
    assert fake.prompts[0] == renderer.render_prompt(history, [ADD_TOOL])
    assert fake.prompts[0] == fake.prompts[1]
    assert parsed.errors == ()
    [call] = parsed.message.tool_calls
    assert (call.name, call.arguments) == ("add", {"a": 2, "b": 40})
    choice = raw["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 40}


def test_wire_format_round_trip_and_bad_arguments():
    m = Message(role="assistant", content="ok", tool_calls=(ToolCall(name="f", arguments={"x": [1, 2]}, id="c1"),))
    back = message_from_wire(message_to_wire(m))
    assert back.message.tool_calls[0].arguments == {"x": [1, 2]} and back.message.content == "ok"
    bad = message_from_wire({"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
        {"id": "3", "type": "function", "function": {"name": "h", "arguments": "{}"}}]})
    assert [c.name for c in bad.message.tool_calls] == ["h"]
    assert len(bad.errors) == 2 and "not valid JSON" in bad.errors[0] and "JSON object" in bad.errors[1]
    with pytest.raises(ValueError, match="role"):
        message_from_wire({"role": "wizard", "content": ""})


def test_server_rejects_bad_requests(hf_server):
    server, _, _ = hf_server
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "x", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "top_p": 0})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 600}]})
    assert r.status_code == 400 and "context window" in r.json()["error"]["message"]


def _fake_server(responses: list[tuple[int, dict]], seen_auth: list[str]):
    app = FastAPI()
    queue = list(responses)

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        seen_auth.append(request.headers.get("authorization", ""))
        status, body = queue.pop(0) if len(queue) > 1 else queue[0]
        # a badly behaved server that echoes the credentials back in its error body
        if status >= 400:
            body = {"error": {"message": f"denied for {request.headers.get('authorization')}"}}
        return JSONResponse(status_code=status, content=body)

    return app


OK_BODY = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "fine"}}],
           "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def test_retries_429_then_succeeds(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    seen: list[str] = []
    with ServerThread(_fake_server([(429, {}), (200, OK_BODY)], seen)) as server:
        client = OpenAIEngine("m", base_url=server.url + "/v1", api_key_env=KEY_ENV, backoff_s=0.01)
        reply = client.chat([Message(role="user", content="hi")], None, SamplingParams())
    assert reply == Message(role="assistant", content="fine")
    assert client.requests == 2 and len(seen) == 2
    assert seen[0] == f"Bearer {SECRET}"  # the key is sent...


def test_gives_up_after_retries_and_redacts_the_key(monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, SECRET)
    seen: list[str] = []
    with ServerThread(_fake_server([(503, {})], seen)) as server:
        client = OpenAIEngine("m", base_url=server.url + "/v1", api_key_env=KEY_ENV, backoff_s=0.01, max_retries=2)
        with caplog.at_level(logging.WARNING), pytest.raises(OpenAIEngineError) as info:
            client.chat([Message(role="user", content="hi")], None, SamplingParams())
    assert client.requests == 3 and info.value.status_code == 503
    # ...but never shown: not in the error, the logs or the repr
    assert SECRET not in str(info.value) and "***" in str(info.value)
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)
    assert SECRET not in repr(client) and "[set]" in repr(client)


def test_client_errors_are_not_retried(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    seen: list[str] = []
    with ServerThread(_fake_server([(401, {})], seen)) as server:
        client = OpenAIEngine("m", base_url=server.url + "/v1", api_key_env=KEY_ENV, backoff_s=0.01)
        with pytest.raises(OpenAIEngineError, match="401") as info:
            client.chat([Message(role="user", content="hi")], None, SamplingParams())
    assert client.requests == 1 and SECRET not in str(info.value)


def test_connection_errors_are_retried():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIEngine("m", base_url=f"http://127.0.0.1:{port}/v1", api_key_env=KEY_ENV, backoff_s=0.01, max_retries=2)
    with pytest.raises(OpenAIEngineError, match="after 3 attempts"):
        client.chat([Message(role="user", content="hi")], None, SamplingParams())
    assert client.requests == 3
    # the token path (POST /completions) retries the same way
    with pytest.raises(OpenAIEngineError, match="completions failed after 3 attempts"):
        client.generate([[1, 2]], SamplingParams())
    assert client.requests == 6


def test_rollout_through_the_server_records_turns_without_the_key(hf_server, monkeypatch, tmp_path):
    from tracegym.data.store import TrajectoryWriter
    from tracegym.envs import make
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    monkeypatch.setenv(KEY_ENV, SECRET)
    server, _, renderer = hf_server
    client = OpenAIEngine("tiny-random", base_url=server.url + "/v1", api_key_env=KEY_ENV)
    tasks = make("calculator").tasks("train", n=2, seed=0)
    path = tmp_path / "t.jsonl"
    with TrajectoryWriter(path) as writer:
        res = run_rollouts_sync("calculator", tasks, client, renderer,
                                RolloutConfig(max_turns=2, max_tokens_per_turn=6, temperature=0.0), writer=writer,
                                progress=False)
    assert res.stats.failed == 0 and len(res.trajectories) == 2
    for t in res.trajectories:
        assert t.policy == "tiny-random" and 1 <= len(t.turns) <= 2
        for turn in t.turns:
            assert turn.completion_logprobs is None
            assert turn.completion_ids == tuple(renderer.encode_completion(turn.message))
        assert list(t.turns[0].prompt_ids) == renderer.render_prompt(t.messages[:2], list(t.tools))
    assert SECRET not in path.read_text()


# --- what RL needs of a remote server ------------------------------------------------------------------

HI = [Message(role="system", content="Be brief."), Message(role="user", content="Say hi.")]


class FakeServer:
    """An httpx transport that plays an OpenAI-compatible server: ``reply(path, body) -> (status, json)``.
    It records every request body, so tests can check what the engine asked for."""

    def __init__(self, reply):
        self.reply = reply
        self.bodies: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        path = request.url.path.removeprefix("/v1")
        self.bodies.append((path, body))
        status, payload = self.reply(path, body)
        return httpx.Response(status, json=payload)


def fake_engine(reply, **options):
    server = FakeServer(reply)
    engine = OpenAIEngine("m", base_url="http://fake.invalid/v1", api_key_env=KEY_ENV, backoff_s=0.01,
                          transport=httpx.MockTransport(server), **options)
    return engine, server


def vllm_chat_choice(index, ids, logprobs, content, finish="stop"):
    """A choice as vLLM writes it with ``return_tokens_as_token_ids`` and no ``return_token_ids``."""
    return {"index": index, "message": {"role": "assistant", "content": content}, "finish_reason": finish,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                     for t, lp in zip(ids, logprobs)]}}


def test_vllm_token_ids_and_all_n_choices_of_one_chat_request(tiny):
    _, tokenizer, renderer = tiny
    end = renderer.stop_token_ids[0]
    words = ["Hello there", "Hi", "Good day to you"]
    sampled = [renderer.encode_text(w) + [end] for w in words]
    sent_lps = [[-0.25 * (k + 1) - 0.5 * j for j in range(len(ids))] for k, ids in enumerate(sampled)]

    def reply(path, body):
        assert path == "/chat/completions"
        choices = [vllm_chat_choice(k, sampled[k], sent_lps[k], words[k]) for k in (2, 0, 1)]  # any order
        return 200, {"choices": choices, "usage": {"prompt_tokens": 9, "completion_tokens": 12}}

    engine, server = fake_engine(reply, logprobs=True, renderer=renderer)
    samples = engine.chat_samples(HI, None, SamplingParams(n=3, max_tokens=16, seed=3))
    # one request for the group, asking for log-probs and vLLM's token ids
    [(path, body)] = server.bodies
    assert body["n"] == 3 and body["logprobs"] is True and body["top_logprobs"] == 0
    assert body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert body["max_completion_tokens"] == 16 and "max_tokens" not in body
    assert [s.generation.token_ids for s in samples] == [tuple(ids) for ids in sampled]
    assert [s.generation.logprobs for s in samples] == [tuple(lps) for lps in sent_lps]
    assert [s.parsed.message.content for s in samples] == words
    assert all(s.token_source == "server" and s.aligned and not s.retokenized for s in samples)
    assert engine.samples == {"server": 3, "local": 0, "misaligned": 0}
    assert engine.usage == {"prompt_tokens": 9, "completion_tokens": 12}


def test_generate_reads_vllm_completions_and_cuts_at_the_end_of_turn(tiny):
    _, _, renderer = tiny
    end = renderer.stop_token_ids[0]
    prompts = [renderer.render_prompt(HI), renderer.render_prompt(HI[1:])]

    def reply(path, body):
        assert path == "/completions"
        base = 100 if body["prompt"] == prompts[0] else 200
        choices = []
        for k in range(body["n"]):
            # prompt 1, choice 1: a server that ignored stop_token_ids and sampled past the end of the turn
            ids = [base + k, end] if (base, k) != (200, 1) else [base + k, end, 7, 8]
            choices.append({"index": k, "text": "x", "finish_reason": "stop" if len(ids) == 2 else "length",
                            "prompt_token_ids": body["prompt"],
                            "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                         "token_logprobs": [-0.1 * (j + 1) for j in range(len(ids))]}})
        return 200, {"choices": choices, "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 4}}

    engine, server = fake_engine(reply, logprobs=True, renderer=renderer)
    assert engine.capabilities == EngineCapabilities(returns_logprobs=True, exact_token_ids=True, weight_sync="none")
    require_rl_sampler(engine)
    with pytest.raises(NotImplementedError, match="weight_sync is 'none'"):  # a remote server keeps its weights
        engine.update_weights(None)
    params = SamplingParams(n=2, max_tokens=8, seed=5, stop_token_ids=tuple(renderer.stop_token_ids))
    out = engine.generate(prompts, params)
    assert [[g.token_ids for g in row] for row in out] == [[(100, end), (101, end)], [(200, end), (201, end)]]
    assert all(g.logprobs == pytest.approx((-0.1, -0.2)) for row in out for g in row)
    assert out[1][1].finish_reason == "stop"  # cut after its end-of-turn token
    bodies = sorted((b for _, b in server.bodies), key=lambda b: b["prompt"] != prompts[0])
    assert [b["prompt"] for b in bodies] == prompts  # token in: the prompt ids as they are
    assert all(b["logprobs"] == 0 and b["n"] == 2 and b["max_tokens"] == 8 for b in bodies)
    assert all(b["stop_token_ids"] == list(renderer.stop_token_ids) for b in bodies)
    # one seed per prompt (equal prompts of a group must not draw equal samples), the first unchanged
    assert bodies[0]["seed"] == 5 and bodies[1]["seed"] != 5


def test_a_server_that_changes_the_prompt_is_refused(tiny):
    _, _, renderer = tiny

    def reply(path, body):
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": [5], "prompt_token_ids": [1] + body["prompt"],
                                  "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}]}

    engine, _ = fake_engine(reply, logprobs=True, renderer=renderer)
    with pytest.raises(OpenAIEngineError, match="changed the prompt"):
        engine.generate([renderer.render_prompt(HI)], SamplingParams())


def test_without_server_ids_the_text_is_retokenized_and_flagged(tiny):
    _, tokenizer, renderer = tiny
    end = renderer.stop_token_ids[0]
    text = "Hello there, friend"
    local = renderer.encode_text(text)

    def plain(count):  # log-prob entries with token text only, no ids
        return {"content": [{"token": "?", "logprob": -1.0 - j, "top_logprobs": []} for j in range(count)]}

    def reply(path, body):
        if path == "/completions":
            return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop",
                                      "logprobs": {"tokens": ["?"] * (len(local) + 1),
                                                   "token_logprobs": [-0.5] * (len(local) + 1)}}]}
        return 200, {"choices": [
            # the end-of-turn token counted in the log-probs: ids line up once it is put back
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
             "logprobs": plain(len(local) + 1)},
            # counts that do not match: the log-probs are left out, never shifted
            {"index": 1, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
             "logprobs": plain(len(local) + 3)}]}

    engine, server = fake_engine(reply, logprobs=True, renderer=renderer)
    good, bad = engine.chat_samples(HI, None, SamplingParams(n=2))
    assert good.retokenized and good.token_source == "local" and good.aligned
    assert good.generation.token_ids == tuple(local + [end])
    assert good.generation.logprobs == tuple(-1.0 - j for j in range(len(local) + 1))
    assert bad.retokenized and not bad.aligned and bad.generation.logprobs is None
    assert bad.generation.token_ids == tuple(local)
    assert bad.server_logprobs == tuple(-1.0 - j for j in range(len(local) + 3))
    assert engine.samples == {"server": 0, "local": 2, "misaligned": 1}
    # generate (what RL calls) refuses ids the server did not give...
    with pytest.raises(OpenAIEngineError, match="returned no token ids"):
        engine.generate([[1, 2, 3]], SamplingParams(stop_token_ids=(end,)))
    # ...unless asked to take re-tokenized ones; token_ids=local never asks for vLLM's extensions
    local_engine, local_server = fake_engine(reply, logprobs=True, renderer=renderer, token_ids="local")
    assert local_engine.capabilities.exact_token_ids is False
    with pytest.raises(ValueError, match="does not return the exact token ids"):
        require_rl_sampler(local_engine)
    opted, opted_server = fake_engine(reply, logprobs=True, renderer=renderer, token_ids="local", allow_retokenized=True)
    require_rl_sampler(opted)
    [[gen]] = opted.generate([[1, 2, 3]], SamplingParams(stop_token_ids=(end,)))
    assert gen.token_ids == tuple(local + [end]) and gen.logprobs == (-0.5,) * (len(local) + 1)
    [(_, body)] = opted_server.bodies
    assert not any(key.startswith("return_") for key in body)


def test_without_a_tokenizer_retokenized_samples_have_no_ids():
    def reply(path, body):
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                                  "logprobs": {"content": [{"token": "hey", "logprob": -2.0}]}}]}

    engine, _ = fake_engine(reply, logprobs=True)
    [sample] = engine.chat_samples(HI, None, SamplingParams())
    assert sample.retokenized and sample.generation.token_ids == () and not sample.aligned
    assert sample.generation.logprobs is None and sample.server_logprobs == (-2.0,)


def test_tool_calls_are_parsed_from_text_when_the_server_has_no_tool_parser(tiny):
    _, _, renderer = tiny
    good = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    broken = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2\n</tool_call>'

    def reply(path, body):
        return 200, {"choices": [
            {"index": 0, "message": {"role": "assistant", "content": good}, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": broken}, "finish_reason": "stop"}]}

    engine, _ = fake_engine(reply, renderer=renderer)
    first, second = engine.chat_samples(HI, [ADD_TOOL], SamplingParams(n=2))
    [call] = first.parsed.message.tool_calls
    assert (call.name, call.arguments) == ("add", {"a": 2, "b": 40})
    assert first.parsed.message.content == "I will add." and first.parsed.errors == ()
    # a malformed block comes back as the renderer's own error text, for the env to show the model
    assert second.parsed.message.tool_calls == ()
    assert second.parsed.errors == renderer._parse_assistant_text(broken)[1] and "invalid JSON" in second.parsed.errors[0]
    assert engine.chat_with_errors(HI, [ADD_TOOL], SamplingParams()).message.tool_calls == (call,)
    # no tools sent, or parsing switched off: the text stays as the server wrote it
    assert engine.chat(HI, None, SamplingParams()).content == good
    off, _ = fake_engine(reply, renderer=renderer, parse_text_tool_calls=False)
    assert off.chat(HI, [ADD_TOOL], SamplingParams()) == Message(role="assistant", content=good)


@pytest.mark.parametrize("error", [
    {"error": {"message": "Unsupported parameter: 'max_completion_tokens' is not supported with this model.",
               "type": "invalid_request_error", "param": "max_completion_tokens", "code": "unsupported_parameter"}},
    {"object": "error", "message": "extra field max_completion_tokens not permitted", "param": None, "code": 400},
])
def test_max_completion_tokens_falls_back_to_max_tokens_once_and_remembers(error):
    def reply(path, body):
        if "max_completion_tokens" in body:
            return 400, error
        return 200, OK_BODY

    engine, server = fake_engine(reply)
    params = SamplingParams(max_tokens=12)
    assert engine.chat(HI, None, params) == Message(role="assistant", content="fine")
    assert engine.chat(HI, None, params).content == "fine"
    keys = [("max_completion_tokens" in b, b.get("max_completion_tokens", b.get("max_tokens"))) for _, b in server.bodies]
    assert keys == [(True, 12), (False, 12), (False, 12)]  # the second call goes straight to max_tokens
    assert engine.requests == 3
    # asked for by name: no fallback
    strict, strict_server = fake_engine(reply, max_tokens_param="max_completion_tokens")
    with pytest.raises(OpenAIEngineError) as info:
        strict.chat(HI, None, params)
    assert info.value.status_code == 400 and len(strict_server.bodies) == 1
    old, old_server = fake_engine(reply, max_tokens_param="max_tokens")
    old.chat(HI, None, params)
    assert [b["max_tokens"] for _, b in old_server.bodies] == [12]


def test_a_400_that_names_another_field_is_not_retried():
    def reply(path, body):
        return 400, {"error": {"message": "'messages' must not be empty", "param": "messages"}}

    engine, server = fake_engine(reply)
    with pytest.raises(OpenAIEngineError, match="messages"):
        engine.chat(HI, None, SamplingParams())
    assert len(server.bodies) == 1 and engine._max_tokens_key == "max_completion_tokens"


def test_refused_token_id_extensions_are_dropped_for_good(tiny):
    _, _, renderer = tiny

    def reply(path, body):
        if "return_token_ids" in body:
            return 400, {"error": {"message": "Unrecognized request argument supplied: return_token_ids",
                                   "param": "return_token_ids"}}
        return 200, {"choices": [vllm_chat_choice(0, [5, 6], [-1.0, -2.0], "ok")]}

    engine, server = fake_engine(reply, logprobs=True, renderer=renderer)
    for _ in range(2):
        [sample] = engine.chat_samples(HI, None, SamplingParams())
        assert sample.generation.token_ids == (5, 6) and sample.token_source == "server"
    sent = [b for _, b in server.bodies]
    assert len(sent) == 3 and "return_token_ids" in sent[0]
    assert all("return_token_ids" not in b and b["return_tokens_as_token_ids"] for b in sent[1:])


def test_n_choices_from_a_server_that_returns_fewer_or_refuses_n():
    def fewer(path, body):  # ignores n: one choice per request
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"seed {body['seed']}"}}]}

    engine, server = fake_engine(fewer)
    samples = engine.chat_samples(HI, None, SamplingParams(n=3, seed=9))
    assert [b.get("n", 1) for _, b in server.bodies] == [3, 2, 1]  # asks again for what is missing
    seeds = [b["seed"] for _, b in server.bodies]
    assert seeds[0] == 9 and len(set(seeds)) == 3  # never the same seed twice: the same samples again
    assert [s.parsed.message.content for s in samples] == [f"seed {s}" for s in seeds]

    def no_n(path, body):
        if body.get("n", 1) > 1:
            return 400, {"error": {"message": "'n' must be 1 for this model", "param": None}}
        return fewer(path, body)

    engine, server = fake_engine(no_n)
    assert len(engine.chat_samples(HI, None, SamplingParams(n=3, seed=1))) == 3
    assert [b.get("n", 1) for _, b in server.bodies] == [3, 1, 1, 1]
    assert len(engine.chat_samples(HI, None, SamplingParams(n=2, seed=1))) == 2
    assert [b.get("n", 1) for _, b in server.bodies][4:] == [1, 1]  # remembered


def test_generate_and_chat_samples_over_tracegym_serve_match_the_engine(hf_server):
    server, engine, renderer = hf_server
    client = make_engine("openai", model="tiny-random", base_url=server.url + "/v1", api_key_env=KEY_ENV,
                         renderer=renderer, logprobs=True)
    assert client.capabilities.exact_token_ids and client.renderer is renderer
    prompt = renderer.render_prompt(HI)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, n=3,
                            stop_token_ids=tuple(renderer.stop_token_ids))
    direct = engine.generate([prompt], params)[0]
    [samples] = client.completion_samples([prompt], params)
    assert client.requests == 1  # the group of 3 in one request
    assert [s.generation.token_ids for s in samples] == [g.token_ids for g in direct]
    for s, g in zip(samples, direct):
        assert s.token_source == "server" and s.aligned and s.prompt_token_ids == tuple(prompt)
        assert s.generation.logprobs == pytest.approx(g.logprobs, abs=1e-5)
        assert s.generation.finish_reason == g.finish_reason
    # the chat endpoint: the same group, with messages and ids
    chats = client.chat_samples(HI, None, params.model_copy(update={"stop_token_ids": ()}))
    assert [s.generation.token_ids for s in chats] == [g.token_ids for g in direct]
    assert all(s.generation.logprobs == pytest.approx(g.logprobs, abs=1e-5) for s, g in zip(chats, direct))
    assert [s.parsed.message for s in chats] == [renderer.parse_completion(g.token_ids).message for g in direct]


def test_rl_rollout_through_tracegym_serve_records_the_sampled_ids_and_logprobs(hf_server, tiny):
    from tracegym.envs import make
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    server, _, renderer = hf_server
    model = tiny[0]
    client = make_engine("openai", model="tiny-random", base_url=server.url + "/v1", api_key_env=KEY_ENV,
                         renderer=renderer, logprobs=True)
    require_rl_sampler(client)
    tasks = make("calculator").tasks("train", n=2, seed=0)
    config = RolloutConfig(max_turns=2, max_tokens_per_turn=6, temperature=0.7, samples_per_task=2,
                           measure_logprob_gap=True)
    res = run_rollouts_sync("calculator", tasks, client, renderer, config, progress=False, gap_model=model)
    assert res.stats.failed == 0 and len(res.trajectories) == 4
    assert res.stats.generate_calls >= 1  # the token path, not chat
    for t in res.trajectories:
        for turn in t.turns:
            assert turn.completion_logprobs is not None and len(turn.completion_logprobs) == len(turn.completion_ids) >= 1
    # the log-probs the server sent are those of the model under the sampling distribution
    gap = res.stats.logprob_gap
    assert gap is not None and gap.tokens == res.stats.generated_tokens and gap.max < 1e-4
    assert client.samples["local"] == 0 and client.samples["server"] == res.stats.turns


def test_a_message_level_rollout_sees_tool_calls_written_in_text(tiny):
    from tracegym.envs import make
    from tracegym.rollout import RolloutConfig, run_rollouts_sync

    _, _, renderer = tiny

    def reply(path, body):  # a server without a tool parser: the call stays in the text
        answered = any(m["role"] == "tool" for m in body["messages"])
        text = "<answer>5</answer>" if answered else '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}

    engine, _ = fake_engine(reply, renderer=renderer)
    tasks = make("calculator").tasks("train", n=1, seed=0)
    res = run_rollouts_sync("calculator", tasks, engine, renderer, RolloutConfig(max_turns=3), progress=False)
    [t] = res.trajectories
    [call] = t.turns[0].message.tool_calls
    assert (call.name, call.arguments) == ("calculate", {"expression": "2+3"}) and t.turns[0].parse_errors == ()
    assert t.turns[0].env_messages[0].role == "tool" and t.turns[0].env_messages[0].content == "5"
    assert t.turns[1].message.content == "<answer>5</answer>"
