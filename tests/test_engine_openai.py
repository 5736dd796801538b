"""The openai engine against ``tracegym serve`` (tiny-random in a background thread), fake servers for
retries, and redaction of the API key."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tracegym.engines import make_engine
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
    with pytest.raises(NotImplementedError, match="message-level"):
        client.generate([[1, 2]], SamplingParams())


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
