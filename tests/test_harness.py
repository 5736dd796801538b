"""The ``harness`` rollout strategy (``tracegym.serve.harness``): an unmodified ``openai``-SDK agent
(``examples/harness/openai_sdk_agent.py``) played through gateway sessions, its episodes
token-exact and verified by the env; failures of the agent fail its episode only; ``tracegym rl``
and ``tracegym eval`` run it from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracegym.envs import Task, make
from tracegym.rollout import RolloutConfig
from tracegym.rollout.strategies import RolloutJob, run_strategy_sync
from tracegym.serve.harness import agent_problems, load_agent
from tracegym.types import Generation

REPO = Path(__file__).resolve().parents[1]
SDK_AGENT = str(REPO / "examples/harness/openai_sdk_agent.py") + ":run"
AGENTS_SDK_AGENT = str(REPO / "examples/harness/agents_sdk_agent.py") + ":run"  # the OpenAI Agents SDK
CALL = '<tool_call>\n{"name":"calculate","arguments":{"expression":"2 + 40"}}\n</tool_call>'  # not canonical JSON


class CalculatorScript:
    """A token engine that plays a calculator episode: a call first, the answer once its own call is in
    the prompt (the system prompt's ``<answer>42</answer>`` example rules out looking for "42"); it
    records what every request asked."""

    name = "scripted"
    returns_logprobs = True

    def __init__(self, renderer, answer: str = "42"):
        self.renderer, self.answer, self.params = renderer, answer, []

    def generate(self, prompts, params):
        self.params.append(params)
        out = []
        for prompt in prompts:
            text = self.renderer.tokenizer.decode(prompt)
            reply = f"<answer>{self.answer}</answer>" if '"expression":"2 + 40"' in text else CALL
            ids = self.renderer.encode_text(reply) + [self.renderer.stop_token_ids[0]]
            out.append([Generation(token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids))])
        return out


@pytest.fixture(scope="module")
def renderer():
    from tracegym.models import load
    from tracegym.render import get_renderer

    _, tokenizer = load("tiny-random")
    return get_renderer("tiny-random", tokenizer)


def _tasks(n: int = 2) -> list[Task]:
    return [Task(id=f"sum-{i}", data={"question": f"Ann has 2 apples and gets 40 more (case {i}). How many?", "answer": 42})
            for i in range(n)]


def _job(engine, renderer, **config) -> RolloutJob:
    cfg = RolloutConfig(samples_per_task=2, temperature=0.7, top_p=0.9, seed=3, max_tokens_per_turn=48, **config)
    return RolloutJob("calculator", _tasks(), engine, renderer, cfg, policy_name="my-adapter")


def test_sdk_agent_episodes_are_token_exact_and_verified_by_the_env(renderer):
    engine = CalculatorScript(renderer)
    result = run_strategy_sync("harness", _job(engine, renderer), {"agent": SDK_AGENT})
    assert result.stats.episodes == 4 and result.stats.kept == 4 and result.stats.failed == 0
    assert [(t.task_id, t.sample_index) for t in result.trajectories] == [("sum-0", 0), ("sum-0", 1), ("sum-1", 0), ("sum-1", 1)]
    env = make("calculator")
    for trajectory in result.trajectories:
        assert trajectory.reward == 1.0 and trajectory.success and trajectory.env == "calculator"
        assert trajectory.policy == "my-adapter" and trajectory.info["answer"] == "<answer>42</answer>"
        assert trajectory.info["token_breaks"] == 0 and len(trajectory.turns) == 2
        first, second = trajectory.turns
        # the agent's first prompt is exactly what the calculator env itself would show the model
        task = next(t for t in _tasks() if t.id == trajectory.task_id)
        import asyncio

        shown = asyncio.run(env.reset(task))
        assert list(first.prompt_ids) == renderer.render_prompt(shown, env.tool_schemas())
        # the second prompt extends the first + the sampled call (its non-canonical JSON kept)
        assert list(second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)]) == \
            list(first.prompt_ids) + list(first.completion_ids)
        assert first.completion_logprobs == pytest.approx([-0.5] * len(first.completion_ids))
        (example,) = renderer.build_examples(trajectory)
        assert [t for t, m in zip(example.input_ids, example.loss_mask) if m] == \
            list(first.completion_ids) + list(second.completion_ids)
    assert result.stats.extra == {"gateway/token_breaks": 0.0, "gateway/episodes_with_breaks": 0.0}
    # every call sampled with the rollout's settings, not the agent's defaults, each with its own seed
    assert {(p.temperature, p.top_p) for p in engine.params} == {(0.7, 0.9)}
    assert all(p.max_tokens <= 48 for p in engine.params)
    seeds = [p.seed for p in engine.params]
    assert None not in seeds and len(set(seeds)) == len(seeds) == 8
    # the same run again samples with the same seeds (a run is reproducible)
    again = CalculatorScript(renderer)
    run_strategy_sync("harness", _job(again, renderer), {"agent": SDK_AGENT})
    assert sorted(p.seed for p in again.params) == sorted(seeds)


def test_an_agents_sdk_agent_runs_unmodified_and_token_exact(renderer):
    """The OpenAI Agents SDK agent: its own tool schema (``function_tool``) reaches the prompt, its
    re-sent history (the SDK rebuilds messages from its run items) extends the sampled tokens."""
    result = run_strategy_sync("harness", _job(CalculatorScript(renderer), renderer), {"agent": AGENTS_SDK_AGENT})
    assert result.stats.kept == 4 and result.stats.extra["gateway/token_breaks"] == 0.0
    for trajectory in result.trajectories:
        assert trajectory.reward == 1.0 and len(trajectory.turns) == 2 and trajectory.info["token_breaks"] == 0
        (tool,) = trajectory.tools
        assert tool["function"]["name"] == "calculate" and "expression" in tool["function"]["parameters"]["properties"]
        first, second = trajectory.turns
        assert "Evaluate an arithmetic expression" in renderer.tokenizer.decode(first.prompt_ids)
        assert list(second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)]) == \
            list(first.prompt_ids) + list(first.completion_ids)


def test_a_wrong_answer_is_judged_by_the_env_not_the_agent(renderer):
    result = run_strategy_sync("harness", _job(CalculatorScript(renderer, answer="41"), renderer), {"agent": SDK_AGENT})
    assert [t.reward for t in result.trajectories] == [0.0] * 4 and not any(t.success for t in result.trajectories)


AGENTS = '''
import asyncio

async def raises(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("tool server down")

async def hangs(task, client):
    await asyncio.sleep(60)

async def returns_dict(task, client):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return {"score": 1}

async def never_calls(task, client):
    return 1.0

async def wrong_model(task, client):
    await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])

async def own_reward(task, client):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return len(reply.choices[0].message.content or "") % 2

def not_async(task, client):
    return 1.0
'''


@pytest.fixture()
def agents(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    return str(path)


@pytest.mark.parametrize(("name", "end_reason", "error"), [
    ("raises", "env_error", "RuntimeError: tool server down"),
    ("hangs", "timeout", "the agent ran past timeout_s=0.5"),
    ("returns_dict", "env_error", "TypeError: the agent returned dict: expected a reward (number) or an answer (str)"),
    ("never_calls", "env_error", "the agent made no model call"),
    ("wrong_model", "env_error", "NotFoundError"),
])
def test_a_failing_agent_fails_its_episode_only(renderer, agents, name, end_reason, error):
    result = run_strategy_sync("harness", _job(CalculatorScript(renderer), renderer),
                               {"agent": f"{agents}:{name}", "timeout_s": 0.5})
    assert result.trajectories == [] and len(result.failed) == 4 and result.stats.failed == 4
    assert {t.end_reason for t in result.failed} == {end_reason}
    assert all(t.error.startswith(error) for t in result.failed), result.failed[0].error
    assert result.stats.end_reasons == {end_reason: 4}


def test_zero_reward_keeps_a_failed_agent_s_sampled_turns(renderer, agents):
    result = run_strategy_sync("harness", _job(CalculatorScript(renderer), renderer, on_env_error="zero_reward"),
                               {"agent": f"{agents}:raises"})
    assert len(result.trajectories) == 4 and result.failed == []
    assert {(t.reward, t.end_reason, len(t.turns)) for t in result.trajectories} == {(0.0, "env_error", 1)}
    assert result.trajectories[0].error == "RuntimeError: tool server down"


def test_bad_agent_specs_are_one_line_errors(agents):
    assert agent_problems("chains", {"agent": "nowhere:run"}) == []
    (line,) = agent_problems("harness", {"agent": "no_such_module_xyz:run"})
    assert line.startswith("rollout.strategy_options.agent: ") and "no_such_module_xyz" in line and "\n" not in line
    (line,) = agent_problems("harness", {"agent": f"{agents}:missing"})
    assert "has no attribute 'missing'" in line
    (line,) = agent_problems("harness", {"agent": f"{agents}:not_async"})
    assert "must be an async function" in line
    (line,) = agent_problems("harness", {"agent": "no_colon"})
    assert "expected 'module:function'" in line
    assert load_agent(SDK_AGENT).__name__ == "run"
    # rollout.harness is short for strategy harness with that agent; a clash is one error
    from tracegym.config import RLConfig

    rollout = RLConfig(rollout={"harness": SDK_AGENT, "strategy_options": {"timeout_s": 9}}).rollout
    assert (rollout.strategy, rollout.strategy_options) == ("harness", {"timeout_s": 9, "agent": SDK_AGENT})
    with pytest.raises(ValueError, match="through strategy harness, not 'tree'"):
        RLConfig(rollout={"harness": SDK_AGENT, "strategy": "tree"})


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tracegym", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _rl_config(tmp_path: Path, group_size: int, rollout: str) -> Path:
    """A one-step RL config of a tiny model on 1-call calculator tasks, with ``rollout`` options."""
    config = tmp_path / "rl.yaml"
    config.write_text(f"""
model: {{name: tiny-random}}
lora: {{r: 4}}
env: {{name: calculator, options: {{num_calls: 1}}}}
tasks: {{train: 4, test: 1}}
tasks_per_step: 2
group_size: {group_size}
rollout: {{max_tokens_per_turn: 6, {rollout}}}
steps: 1
eval: {{at_start: false, every: 0}}
save_rollouts: false
output_dir: {tmp_path / "run"}
logging: {{progress: false, tensorboard: false}}
""")
    return config


def _one_rl_step(tmp_path: Path, config: Path) -> dict:
    """Run ``tracegym rl`` on ``config``; its step-1 row."""
    done = _cli(tmp_path, "rl", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("step") == 1 and "reward/mean" in r)


def test_rl_trains_on_an_agent_s_episodes_from_the_command_line(tmp_path, agents):
    """One RL step of a tiny model through an agent that returns its own reward (a reward with
    variance, so groups carry signal: the gateway's trajectories become examples and train)."""
    config = _rl_config(tmp_path, 4, f'concurrency: 8, strategy: harness, strategy_options: {{agent: "{agents}:own_reward"}}')
    step = _one_rl_step(tmp_path, config)
    assert step["gateway/token_breaks"] == 0.0 and step["env/errors"] == 0.0
    assert step["episode/turns"] == 1.0 and 0.0 < step["reward/mean"] < 1.0 and step["examples/count"] > 0
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    # a missing agent module: one line naming it, before any model is loaded
    bad = _cli(tmp_path, "rl", "--config", str(config), f"rollout.strategy_options.agent=missing_mod:run")
    assert bad.returncode == 2 and "rollout.strategy_options.agent" in bad.stderr and "missing_mod" in bad.stderr


@pytest.mark.parametrize("agent", [SDK_AGENT, AGENTS_SDK_AGENT], ids=["openai_sdk", "agents_sdk"])
def test_an_example_agent_trains_and_evaluates_from_the_command_line(tmp_path, agent):
    """Each example agent, unmodified, through one ``tracegym rl`` step and ``tracegym eval``."""
    step = _one_rl_step(tmp_path, _rl_config(tmp_path, 2, f'harness: "{agent}"'))
    assert step["env/errors"] == 0.0 and "gateway/token_breaks" in step
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    out = tmp_path / "eval"
    done = _cli(tmp_path, "eval", "--model", "tiny-random", "--env", "calculator", "--env-option", "num_calls=1",
                "--tasks", "2", "--samples", "1", "--k", "1", "--max-tokens-per-turn", "6", "--strategy", "harness",
                "--strategy-option", f"agent={agent}", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    rollout = json.loads((out / "eval.json").read_text())["rollout"]
    assert rollout["strategy"] == "harness" and rollout["episodes"] == 2
    episodes = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and all(e["info"]["token_breaks"] == 0 for e in episodes if e["turns"])
