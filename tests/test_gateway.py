"""Gateway sessions (``tracegym.serve.sessions``): an unmodified ``openai``-SDK agent's calls recorded
token-exact, bridged onto the sampled tokens (a model's own non-canonical JSON survives), breaks
detected and counted when the harness rewrites history, the HTTP session routes and their errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tracegym.serve import Gateway, ServerThread, SessionStore, create_app
from tracegym.types import Generation, Message, ToolCall

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
# what the model "samples" for its call: valid, but not the renderer's canonical JSON spacing
SLOPPY_CALL = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":40}}\n</tool_call>'


class ScriptedTokens:
    """A token engine that answers call k with ``scripts[k]`` (the last one again after the end)."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, scripts):
        self.scripts = [tuple(s) for s in scripts]
        self.calls = 0

    def generate(self, prompts, params):
        out = []
        for _ in prompts:
            ids = self.scripts[min(self.calls, len(self.scripts) - 1)]
            self.calls += 1
            out.append([Generation(token_ids=ids, logprobs=tuple(-0.1 * (i + 1) for i in range(len(ids))))])
        return out


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load
    from tracegym.render import get_renderer

    _, tokenizer = load("tiny-random")
    return get_renderer("tiny-random", tokenizer)


def _scripts(renderer):
    eot = renderer.stop_token_ids[0]
    call = renderer.encode_text(SLOPPY_CALL) + [eot]
    answer = renderer.encode_completion(Message(role="assistant", content="The sum is 42."))
    return call, answer


async def tool_agent(client, rewrite_history: bool = False, tools=(ADD_TOOL,)) -> str:
    """A plain openai-SDK tool loop (what a user already has): call, run the tools, call again."""
    messages = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 40?"}]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=list(tools))
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or ():
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    if rewrite_history:  # a harness that trims its context: the system prompt goes
        messages = messages[1:]
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=list(tools))
    return reply.choices[0].message.content


def test_sdk_agent_session_is_token_exact_with_the_model_s_own_json(renderer, tmp_path):
    call, answer = _scripts(renderer)
    assert renderer.parse_completion(call).message.tool_calls[0].arguments == {"a": 2, "b": 40}
    with Gateway(ScriptedTokens([call, answer]), renderer, record_dir=tmp_path) as gateway:
        text = asyncio.run(tool_agent(gateway.client("task-1/0")))
        trajectory = gateway.finish("task-1/0", reward=1.0, info={"answer": text})
    assert text == "The sum is 42." and trajectory.reward == 1.0 and trajectory.success
    first, second = trajectory.turns
    assert first.completion_ids == tuple(call) and second.completion_ids == tuple(answer)
    assert first.completion_logprobs == pytest.approx([-0.1 * (i + 1) for i in range(len(call))])
    assert trajectory.info["token_breaks"] == 0 and trajectory.metrics["gateway/token_breaks"] == 0.0
    # the second prompt extends the first prompt + the ids the model sampled, non-canonical JSON kept
    sequence = list(first.prompt_ids) + list(call)
    assert list(second.prompt_ids[:len(sequence)]) == sequence
    # ... where rendering the conversation again would not have (the test would see no bridge)
    fresh = renderer.render_prompt(list(trajectory.messages[:-1]), [ADD_TOOL])
    assert fresh[:len(sequence)] != sequence
    # one training example, the sampled ids (and only they) trained
    (example,) = renderer.build_examples(trajectory)
    trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    assert trained == list(call) + list(answer)
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.turns[-1].reward == 1.0 and trajectory.turns[0].reward == 0.0
    # recorded: one line per finished session
    (line,) = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert json.loads(line)["info"]["session"] == "task-1/0"
    # ... in the trajectory store's format: what `tracegym sft` reads back is the same trajectory
    from tracegym.data.store import read_trajectories

    assert list(read_trajectories(tmp_path / "trajectories.jsonl")) == [trajectory]


@pytest.mark.parametrize(("rewrite", "tools", "reason"), [(True, (ADD_TOOL,), "history_rewritten"),
                                                          (False, None, "tools_changed")])
def test_rewritten_history_is_a_counted_break_never_a_guess(renderer, rewrite, tools, reason):
    call, answer = _scripts(renderer)

    async def agent(client):
        if tools is None:  # the harness declares one more tool on its second call
            other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
            first = await client.chat.completions.create(model="policy", tools=[ADD_TOOL], messages=[
                {"role": "user", "content": "What is 2 + 40?"}])
            messages = [{"role": "user", "content": "What is 2 + 40?"}, first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": "x", "content": "42"}]
            await client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL, other])
        else:
            await tool_agent(client, rewrite_history=rewrite)

    with Gateway(ScriptedTokens([call, answer]), renderer) as gateway:
        asyncio.run(agent(gateway.client("s")))
        stats = gateway.sessions.stats()
        trajectory = gateway.finish("s")
    assert stats["open"] == [{"id": "s", "calls": 2, "token_breaks": 1}]
    assert trajectory.info["token_breaks"] == 1 and trajectory.info["break_reasons"] == [reason]
    assert trajectory.info["break_at_calls"] == [1]
    # the second call's prompt is the template's own rendering of what the harness sent
    examples = renderer.build_examples(trajectory)
    assert len(examples) == 2  # cut at the break: each part trains on exactly what the model saw
    assert [t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m] == list(call) + list(answer)
    assert gateway.sessions.stats()["token_breaks"] == 1


def test_session_routes_over_http(renderer, tmp_path):
    call, answer = _scripts(renderer)
    store = SessionStore(tmp_path, model="scripted")
    app = create_app(ScriptedTokens([call, answer]), renderer, "scripted", api_key="sk-gw", sessions=store)
    with ServerThread(app) as srv:
        auth = {"Authorization": "Bearer sk-gw"}
        body = {"model": "scripted", "messages": [{"role": "user", "content": "2 + 40?"}], "tools": [ADD_TOOL]}
        # the session routes need the key too
        assert httpx.post(srv.url + "/s/a/v1/chat/completions", json=body).status_code == 401
        assert httpx.get(srv.url + "/sessions").status_code == 401
        # a session chosen by header on the plain path is the same session as by path
        first = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={**auth, "X-Tracegym-Session": "a"}).json()
        body["messages"] += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": "c", "content": "42"}]
        httpx.post(srv.url + "/s/a/v1/chat/completions", json=body, headers=auth).raise_for_status()
        assert httpx.get(srv.url + "/s/a/v1/models", headers=auth).json()["data"][0]["id"] == "scripted"
        # streaming and n > 1 are refused with the parameter named, and nothing is recorded
        for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n")):
            refused = httpx.post(srv.url + "/s/a/v1/chat/completions", json={**body, **extra}, headers=auth)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        assert httpx.get(srv.url + "/sessions", headers=auth).json()["open"] == [{"id": "a", "calls": 2, "token_breaks": 0}]
        bad = httpx.post(srv.url + "/s/a/end", json={"reward": "high"}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward"
        ended = httpx.post(srv.url + "/s/a/end", json={"reward": 0.5, "info": {"task": "t1"}}, headers=auth).json()
        assert ended["token_breaks"] == 0 and len(ended["trajectory"]["turns"]) == 2
        assert ended["trajectory"]["reward"] == 0.5 and ended["trajectory"]["info"]["task"] == "t1"
        again = httpx.post(srv.url + "/s/a/end", headers=auth)
        assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"
        assert httpx.get(srv.url + "/sessions", headers=auth).json() == {"open": [], "finished": 1, "token_breaks": 0}
    assert len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 1


def test_a_plain_server_has_no_sessions(renderer):
    call, _ = _scripts(renderer)
    with ServerThread(create_app(ScriptedTokens([call]), renderer, "scripted")) as srv:
        response = httpx.post(srv.url + "/s/a/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 404 and response.json()["error"]["code"] == "no_sessions"
        # and a plain call is not recorded anywhere
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}]).choices


def test_an_empty_session_cannot_be_merged():
    store = SessionStore()
    store.get("empty")
    with pytest.raises(ValueError, match="session 'empty' made no chat call"):
        store.finish("empty")
    with pytest.raises(KeyError, match="no session 'never'"):
        store.finish("never")


def test_calls_whose_prompt_happens_to_extend_are_no_break():
    # a fresh rendering that extends the previous call's tokens anyway is no break (the check is on
    # the ids, as the trainer's example builder does it)
    from tracegym.serve.sessions import RecordedCall, Session

    def recorded(prompt, completion, bridged=None, why=None):
        return RecordedCall(messages=(Message(role="user", content="q"),), tools=(), prompt_ids=tuple(prompt),
                            completion_ids=tuple(completion), logprobs=None, finish_reason="stop",
                            reply=Message(role="assistant", content="a", tool_calls=(ToolCall(name="x", arguments={}),)),
                            parse_errors=(), bridged_from=bridged, why_not_bridged=why)

    session = Session("s", calls=[recorded([1, 2], [3]), recorded([1, 2, 3, 4], [5], why="history_rewritten"),
                                  recorded([9, 9], [5], why="new_conversation")])
    assert session.token_breaks() == [2]
