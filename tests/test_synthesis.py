"""Teacher synthesis (``tracegym/recipes/synthesize.py``, ``tracegym/data/filters.py``, ``tracegym synthesize``): the filters on hand-made and
real trajectories, re-rendering for the student's template, the command with the scripted expert and
with ``tracegym serve`` (tiny-random) on loopback as the teacher, the API key, and argument errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from tracegym.environments.calculator import CalculatorEnv
from tracegym.render import get_renderer
from tracegym.rollout import RolloutConfig, run_rollouts
from tracegym.data.filters import (
    FILTERS,
    apply_filters,
    dedupe_filter,
    is_recovery,
    pareto_filter,
    parse_filters,
    recovered_errors,
    recovery_filter,
    register_filter,
    success_filter,
)
from tracegym.recipes.synthesize import retokenize, synthesize
from tracegym.types import Message, ToolCall, Trajectory, Turn

KEY = "sk-synth-test-5be81c0a"


# --- hand-made trajectories -------------------------------------------------------------------------


def _traj(task: str, calls: int, tokens: int, *, success: bool = True, reward: float | None = None,
          sample: int = 0, answer: str = "42", call_id: str = "c", error_at: int | None = None) -> Trajectory:
    """One episode of ``task``: ``calls`` tool-call turns then an answer turn; ``tokens`` completion
    tokens in all; the tool answer of call ``error_at`` is an error."""
    system, user = Message(role="system", content="sys"), Message(role="user", content=f"question {task}")
    messages, turns = [system, user], []
    per_turn = [tokens // (calls + 1)] * (calls + 1)
    per_turn[-1] += tokens - sum(per_turn)
    for i in range(calls):
        call = ToolCall(name="calculate", arguments={"expression": f"{i} + 1"}, id=f"{call_id}{i}")
        assistant = Message(role="assistant", tool_calls=(call,))
        text = "Error: tool 'calculate' failed" if i == error_at else str(i + 1)
        answer_msg = Message(role="tool", content=text, tool_call_id=call.id, name="calculate")
        messages += [assistant, answer_msg]
        turns.append(Turn(prompt_ids=(1,), completion_ids=(7,) * per_turn[i], message=assistant, env_messages=(answer_msg,)))
    final = Message(role="assistant", content=f"<answer>{answer}</answer>")
    messages.append(final)
    turns.append(Turn(prompt_ids=(1,), completion_ids=(7,) * per_turn[-1], message=final))
    return Trajectory(env="calculator", task_id=task, sample_index=sample, messages=tuple(messages), turns=tuple(turns),
                      success=success, reward=(1.0 if success else 0.0) if reward is None else reward)


def _costs(trajectories):
    return [(sum(len(m.tool_calls) for m in t.messages), t.num_generated_tokens) for t in trajectories]


# --- filters -----------------------------------------------------------------------------------------


def test_success_keeps_successes_and_min_reward_keeps_exactly_reward_at_least_tau():
    trajs = [_traj("a", 1, 10, success=True, reward=1.0, sample=0), _traj("a", 1, 10, success=False, reward=0.5, sample=1),
             _traj("a", 1, 10, success=False, reward=0.49, sample=2), _traj("b", 1, 10, success=True, reward=0.7, sample=0)]
    assert [(t.task_id, t.sample_index) for t in success_filter(trajs)] == [("a", 0), ("b", 0)]
    assert [t.reward for t in success_filter(trajs, min_reward=0.5)] == [1.0, 0.5, 0.7]
    assert [t.reward for t in success_filter(trajs, min_reward=1.0)] == [1.0]


def test_pareto_keeps_the_non_dominated_successes_of_each_task():
    # the spec's case: (2,12) is dominated by (2,5); the other three trade calls for tokens
    task_a = [_traj("a", c, n, sample=i) for i, (c, n) in enumerate([(1, 10), (2, 5), (2, 12), (3, 3)])]
    assert _costs(pareto_filter(task_a)) == [(1, 10), (2, 5), (3, 3)]
    # equal on one cost and better on the other dominates; an exact tie dominates nobody
    ties = [_traj("t", 2, 5, sample=0), _traj("t", 2, 6, sample=1), _traj("t", 2, 5, sample=2), _traj("t", 1, 7, sample=3)]
    assert [t.sample_index for t in pareto_filter(ties)] == [0, 2, 3]
    # tasks are compared only within themselves; failures pass through whatever they cost
    mixed = [_traj("a", 1, 4, sample=0), _traj("b", 5, 50, sample=0), _traj("a", 9, 99, success=False, sample=1),
             _traj("a", 2, 8, sample=2)]
    assert [(t.task_id, t.sample_index) for t in pareto_filter(mixed)] == [("a", 0), ("b", 0), ("a", 1)]
    assert pareto_filter([]) == []


def test_dedupe_drops_repeats_within_a_task_whatever_their_call_ids():
    trajs = [_traj("a", 1, 10, sample=0, call_id="x"), _traj("a", 1, 12, sample=1, call_id="y"),  # same actions
             _traj("a", 1, 10, sample=2, answer="41"), _traj("b", 1, 10, sample=0, call_id="x")]   # other answer, other task
    assert [(t.task_id, t.sample_index) for t in dedupe_filter(trajs)] == [("a", 0), ("a", 2), ("b", 0)]


class _ClumsyCalculator(CalculatorEnv):
    """The calculator whose expert first writes an expression the tool cannot parse, then solves the task."""

    def expert_action(self) -> Message:
        if self.turn == 0:
            bad = ToolCall(name="calculate", arguments={"expression": "twelve times four"}, id="bad")
            return Message(role="assistant", tool_calls=(bad,))
        return super().expert_action()


def _expert_run(env_factory, renderer, tasks, samples=1):
    config = RolloutConfig(max_turns=8, samples_per_task=samples)
    return asyncio.run(run_rollouts(env_factory, tasks, "expert", renderer, config, progress=False)).trajectories


@pytest.fixture(scope="module")
def calc_tasks():
    return CalculatorEnv(num_calls=2).tasks("train", n=2, seed=0)


@pytest.fixture(scope="module")
def smollm2_renderer(tokenizer):
    return get_renderer("smollm2", tokenizer)


def test_recovery_finds_a_real_tool_error_the_agent_recovered_from(calc_tasks, smollm2_renderer):
    clumsy = _expert_run(lambda: _ClumsyCalculator(num_calls=2), smollm2_renderer, calc_tasks)
    clean = _expert_run(lambda: CalculatorEnv(num_calls=2), smollm2_renderer, calc_tasks)
    errors = [m.content for m in clumsy[0].messages if m.role == "tool" and m.content.startswith("Error")]
    assert errors and "calculate" in errors[0]  # what the env itself answered
    assert all(t.success for t in clumsy + clean) and clumsy[0].metrics["tool_errors"] == 1
    assert [recovered_errors(t) for t in clumsy] == [1, 1] and not any(is_recovery(t) for t in clean)
    # interleaved as a teacher run would give them: task 0 clean, task 0 clumsy, task 1 clean, task 1 clumsy
    both = [clean[0], clumsy[0], clean[1], clumsy[1]]
    assert recovery_filter(both) == [clumsy[0], clumsy[1]]
    assert recovery_filter(both, prefer=True) == [clumsy[0], clean[0], clumsy[1], clean[1]]
    assert recovery_filter(both, prefer=True, per_task=1) == [clumsy[0], clumsy[1]]
    # an error that ends the episode (no assistant message after it) or a failed episode is no recovery
    assert recovered_errors(_traj("a", 2, 10, error_at=1)) == 1 and is_recovery(_traj("a", 2, 10, error_at=0))
    assert recovered_errors(_traj("a", 0, 10)) == 0
    assert not is_recovery(_traj("a", 2, 10, error_at=0, success=False))
    last_error = clumsy[0].model_copy(update={"messages": clean[0].messages + (Message(role="tool", content="Error: late"),)})
    assert recovered_errors(last_error) == 0


def test_filters_compose_in_order_and_count_each_step():
    # the same actions once failed (sample 0), once succeeded (sample 1): the order decides what survives
    trajs = [_traj("a", 1, 10, success=False, sample=0), _traj("a", 1, 10, success=True, sample=1),
             _traj("b", 2, 20, sample=0), _traj("b", 1, 30, sample=1)]
    kept, counts = apply_filters(trajs, "dedupe,success")
    assert [(t.task_id, t.sample_index) for t in kept] == [("b", 0), ("b", 1)]
    assert [(c.filter, c.before, c.after) for c in counts] == [("dedupe", 4, 3), ("success", 3, 2)]
    kept, counts = apply_filters(trajs, ["success", "pareto", "dedupe"])
    assert [(t.task_id, t.sample_index) for t in kept] == [("a", 1), ("b", 0), ("b", 1)]
    assert [(c.before, c.after) for c in counts] == [(4, 3), (3, 3), (3, 3)]
    kept, counts = apply_filters(trajs, "success:min_reward=1.0,recovery:prefer:per_task=1")
    assert [(t.task_id, t.sample_index) for t in kept] == [("a", 1), ("b", 0)]
    assert counts[1].filter == "recovery:prefer:per_task=1"
    assert apply_filters(trajs, "none") == (trajs, []) and apply_filters(trajs, None)[0] == trajs


def test_filter_specs_are_checked_and_users_can_add_filters():
    assert [str(s) for s in parse_filters(" success , recovery:prefer ")] == ["success", "recovery:prefer"]
    with pytest.raises(ValueError, match="did you mean 'success'"):
        parse_filters("sucess")
    with pytest.raises(ValueError, match="no option 'prefer'.*takes min_reward"):
        parse_filters("success:prefer")
    with pytest.raises(ValueError, match="per_task must be an integer"):
        parse_filters("recovery:per_task=0")
    with pytest.raises(ValueError, match="min_reward must be a number"):
        parse_filters("success:min_reward=high")
    with pytest.raises(ValueError, match="has no option"):
        parse_filters("dedupe:x=1")

    def shortest(trajectories, *, n: int = 1):
        return sorted(trajectories, key=lambda t: t.num_generated_tokens)[:n]

    register_filter("shortest", shortest)
    try:
        kept, _ = apply_filters([_traj("a", 1, 30), _traj("a", 1, 10, sample=1)], "shortest:n=1")
        assert [t.sample_index for t in kept] == [1]
    finally:
        del FILTERS["shortest"]


# --- re-rendering for the student --------------------------------------------------------------------


def _trained_spans(example):
    """The masked (trained) runs of token ids of one example."""
    spans, current = [], []
    for token, mask in zip(example.input_ids, example.loss_mask):
        if mask:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_retokenize_moves_a_hermes_trajectory_to_the_smollm2_template(calc_tasks, tokenizer, smollm2_renderer):
    hermes = get_renderer("hermes", tokenizer)
    [recorded] = _expert_run(lambda: _ClumsyCalculator(num_calls=2), hermes, calc_tasks[:1])
    recorded = recorded.model_copy(update={"turns": tuple(  # a token-level teacher's log-probs
        t.model_copy(update={"completion_logprobs": (-0.5,) * len(t.completion_ids)}) for t in recorded.turns)})
    student = retokenize(recorded, smollm2_renderer)
    # the messages are the truth; the ids are the student's template, not the teacher's
    assert student.messages == recorded.messages and student.reward == recorded.reward and student.success
    assert [t.message for t in student.turns] == [t.message for t in recorded.turns]
    assert [t.env_messages for t in student.turns] == [t.env_messages for t in recorded.turns]
    assert [t.state_key for t in student.turns] == [t.state_key for t in recorded.turns]
    assert all(t.completion_logprobs is None for t in student.turns)
    assert "<tool_response>" in tokenizer.decode(recorded.turns[1].prompt_ids)
    assert "<tool_response>" not in tokenizer.decode(student.turns[1].prompt_ids)
    # exactly what the runner records when the student's renderer is used from the start
    [direct] = _expert_run(lambda: _ClumsyCalculator(num_calls=2), smollm2_renderer, calc_tasks[:1])
    ids = [(t.prompt_ids, t.completion_ids) for t in student.turns]
    assert ids == [(t.prompt_ids, t.completion_ids) for t in direct.turns]
    # training masks cover the assistant messages' tokens and nothing else
    [example] = smollm2_renderer.build_examples(student)
    spans = _trained_spans(example)
    assistant = [m for m in student.messages if m.role == "assistant"]
    assert len(spans) == len(assistant) == len(student.turns)
    for span, message in zip(spans, assistant):
        assert span == smollm2_renderer.encode_completion(message)
        parsed = smollm2_renderer.parse_completion(span).message  # ids and raw text aside, the same message
        assert parsed.content == message.content
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in message.tool_calls]
        assert tokenizer.decode(span).endswith("<|im_end|>")
    assert sum(example.loss_mask) == student.num_generated_tokens
    assert not example.has_logprobs


def test_retokenize_turns_a_message_only_trajectory_into_turns(calc_tasks, smollm2_renderer):
    [recorded] = _expert_run(lambda: CalculatorEnv(num_calls=2), smollm2_renderer, calc_tasks[:1])
    message_only = recorded.model_copy(update={"turns": ()})
    rebuilt = retokenize(message_only, smollm2_renderer)
    assert [(t.prompt_ids, t.completion_ids, t.env_messages) for t in rebuilt.turns] == \
        [(t.prompt_ids, t.completion_ids, t.env_messages) for t in recorded.turns]
    assert [t.reward for t in rebuilt.turns] == [0.0] * (len(rebuilt.turns) - 1) + [recorded.reward]
    broken = recorded.model_copy(update={"messages": recorded.messages[:2]})
    with pytest.raises(ValueError, match="turns are not in its messages"):
        retokenize(broken, smollm2_renderer)


def test_a_local_token_level_teacher_is_re_rendered_for_the_student(calc_tasks, smollm2_renderer, tmp_path):
    # tiny-random through the hf engine with the Hermes template (token ids and log-probs of its own)
    result = synthesize("calculator", {"num_calls": 2}, calc_tasks[:1], "tiny-random", smollm2_renderer, 2, "none",
                        tmp_path, config=RolloutConfig(max_turns=2, max_tokens_per_turn=8), teacher_renderer="hermes")
    assert result.summary["teacher"] == {"kind": "hf", "model": "tiny-random", "renderer": "hermes"}
    recorded, kept = result.teacher_trajectories, result.trajectories
    assert len(kept) == len(recorded) == 2 and all(t.policy == "tiny-random" for t in kept)
    assert all(turn.completion_logprobs is not None for t in recorded for turn in t.turns)
    for teacher_t, student_t in zip(recorded, kept):
        assert student_t.messages == teacher_t.messages
        first_prompt = smollm2_renderer.render_prompt(list(teacher_t.messages[:2]), list(teacher_t.tools))
        assert student_t.turns[0].prompt_ids == tuple(first_prompt)
        assert all(turn.completion_logprobs is None for turn in student_t.turns)
        assert student_t.info["renderer"] == "smollm2" and student_t.info["teacher"] == "tiny-random"


# --- the command ---------------------------------------------------------------------------------------


def _read(path: Path) -> list[Trajectory]:
    from tracegym.data.store import read_trajectories

    return list(read_trajectories(path))


def test_cli_with_the_expert_teacher_writes_sft_ready_data(tmp_path, capsys, smollm2_renderer):
    from tracegym.cli import main
    from tracegym.recipes.sft import load_sft_examples

    out = tmp_path / "synth"
    rc = main(["synthesize", "--env", "calculator", "--env-option", "num_calls=2", "--tasks", "3", "--samples", "3",
               "--teacher", "expert", "--student", "smollm2-135m", "--filters", "success,pareto,dedupe",
               "--no-progress", "--parquet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 9 and summary["success_rate"] == 1.0 and summary["teacher"] == {"kind": "expert"}
    assert summary["student"] == {"model": "smollm2-135m", "renderer": "smollm2"}
    # the scripted expert repeats itself: success and pareto keep all 9, dedupe leaves one per task
    assert summary["filters"] == [{"filter": "success", "before": 9, "after": 9}, {"filter": "pareto", "before": 9, "after": 9},
                                  {"filter": "dedupe", "before": 9, "after": 3}]
    assert summary["kept"] == summary["kept_tasks"] == 3
    assert "filter dedupe: kept 3 of 9" in printed
    kept = _read(out / "trajectories.jsonl")
    assert len(kept) == 3 and len({t.task_id for t in kept}) == 3 and len(_read(out / "teacher.jsonl")) == 9
    assert all(t.policy == "expert" and t.info["tokenizer"] == "smollm2-135m" for t in kept)
    assert (out / "trajectories.parquet").is_file()
    data = load_sft_examples([out / "trajectories.jsonl"], smollm2_renderer, max_length=4096)
    assert data.counts["kept_trajectories"] == 3 and data.counts["examples"] == 3
    assert data.counts["loss_tokens"] == sum(t.num_generated_tokens for t in kept) == summary["generated_tokens"]

    # and tracegym sft trains on it
    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{name: tiny-random}}\ndata: {{train_files: ['{out / 'trajectories.jsonl'}']}}\n"
                      f"batch_size: 2\nmicro_batch_size: 2\noutput_dir: '{tmp_path / 'sft'}'\n"
                      "logging: {progress: false, tensorboard: false}\n")
    assert main(["sft", "--config", str(config), "max_steps=1", "lora.r=4"]) == 0
    assert "sft done: 1 steps" in capsys.readouterr().out


@pytest.fixture(scope="module")
def teacher_server(tiny_model):
    from tracegym.engines.hf import HFEngine
    from tracegym.serve import ServerThread, create_app

    model, tokenizer = tiny_model
    renderer = get_renderer("tiny-random", tokenizer)
    engine = HFEngine(model, tokenizer, stop_token_ids=renderer.stop_token_ids)
    app = create_app(engine, renderer, "tiny-random", max_context=2048, api_key=KEY)
    with ServerThread(app) as server:
        yield server.url + "/v1"


def _all_output(out: Path, captured) -> str:
    written = "".join(p.read_text() for p in sorted(out.iterdir()) if p.suffix in (".json", ".jsonl"))
    return written + captured.out + captured.err


def test_cli_against_tracegym_serve_drops_the_random_teachers_failures(teacher_server, tmp_path, capsys, monkeypatch,
                                                                      smollm2_renderer):
    from tracegym.cli import main

    monkeypatch.setenv("SYNTH_TEACHER_KEY", KEY)
    common = ["synthesize", "--env", "calculator", "--env-option", "num_calls=1", "--tasks", "2", "--samples", "2",
              "--teacher", teacher_server, "--api-key-env", "SYNTH_TEACHER_KEY", "--max-turns", "2",
              "--max-tokens-per-turn", "12", "--seed", "5", "--no-progress"]
    out = tmp_path / "rejected"
    rc = main(common + ["--filters", "success", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1 and "no trajectory passed the filters" in captured.err
    summary = json.loads((out / "summary.json").read_text())
    teacher = summary["teacher"]
    assert teacher["kind"] == "openai" and teacher["model"] == "tiny-random"  # the server's only model
    assert teacher["api_key_env"] == "SYNTH_TEACHER_KEY" and teacher["usage"]["completion_tokens"] > 0
    recorded = _read(out / "teacher.jsonl")
    assert summary["episodes"] == 4 and summary["teacher_failed"] == 0 and len(recorded) == 4
    assert summary["success_rate"] == 0.0 and not any(t.success for t in recorded)
    assert summary["rendered"] == 4 and summary["filters"] == [{"filter": "success", "before": 4, "after": 0}]
    assert summary["kept"] == 0 and _read(out / "trajectories.jsonl") == []
    assert KEY not in _all_output(out, captured)

    # without filters every episode is kept, re-rendered, masks on the teacher's assistant messages
    out = tmp_path / "all"
    assert main(common + ["--filters", "none", "--teacher-model", "tiny-random", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    kept = _read(out / "trajectories.jsonl")
    assert len(kept) == 4 and all(t.policy == "tiny-random" for t in kept)
    for t in kept:
        [example] = smollm2_renderer.build_examples(t)
        assistant = [m for m in t.messages if m.role == "assistant"]
        assert _trained_spans(example) == [smollm2_renderer.encode_completion(m) for m in assistant]
    assert KEY not in _all_output(out, captured)

    # a wrong key: every request is refused, the episodes fail, and that key is not written either
    wrong = "sk-wrong-key-77a1e5"
    monkeypatch.setenv("SYNTH_TEACHER_KEY", wrong)
    out = tmp_path / "refused"
    assert main(common + ["--teacher-model", "tiny-random", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["teacher_failed"] == 4 and summary["end_reasons"] == {"engine_error": 4}
    assert "401" in summary["errors"][0]
    assert wrong not in _all_output(out, captured) and KEY not in _all_output(out, captured)


@pytest.mark.parametrize("argv, message", [
    (["--filters", "success,sucess"], "did you mean 'success'"),
    (["--filters", "recovery:per_task=0"], "per_task must be an integer"),
    (["--teacher-model", "gpt-4o"], "teacher model id is only for an endpoint"),
    (["--teacher", "no-such-model"], "no-such-model"),
    (["--teacher", "tiny-random", "--teacher-renderer", "nonsense"], "no renderer"),
    (["--student", "no-such-student"], "--student no-such-student"),
    (["--student-renderer", "hermez"], "did you mean 'hermes'"),
    (["--temperature", "-1"], "--temperature"),
    (["--env", "calculatr"], "calculator"),
    (["--env-option", "nope=1"], "nope"),
])
def test_bad_arguments_give_one_line_errors_with_exit_code_2(argv, message, tmp_path, capsys):
    from tracegym.cli import main

    base = {"--env": "calculator", "--teacher": "expert", "--tasks": "1", "--out": str(tmp_path / "x")}
    args = ["synthesize", "--no-progress"]
    for flag, value in base.items():
        if flag not in argv:
            args += [flag, value]
    assert main(args + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def test_a_plugin_module_can_add_a_filter_for_the_command(tmp_path, capsys):
    from tracegym.cli import main

    plugin = tmp_path / "my_filters.py"
    plugin.write_text(
        "from tracegym.data.filters import register_filter\n\n"
        "def first_sample(trajectories, *, keep: int = 0):\n"
        "    return [t for t in trajectories if t.sample_index == keep]\n\n"
        "register_filter('first_sample', first_sample)\n"
    )
    out = tmp_path / "synth"
    try:
        rc = main(["synthesize", "--plugin", str(plugin), "--env", "calculator", "--tasks", "2", "--samples", "3",
                   "--teacher", "expert", "--filters", "first_sample:keep=2", "--no-progress", "--out", str(out)])
        assert rc == 0, capsys.readouterr().err
        assert [t.sample_index for t in _read(out / "trajectories.jsonl")] == [2, 2]
        assert "filter first_sample:keep=2: kept 2 of 6" in capsys.readouterr().out
    finally:
        FILTERS.pop("first_sample", None)


def test_a_config_file_sets_everything_and_its_filters_carry_options(tmp_path, capsys):
    """--config: the same run as the flags, filters as YAML items with options, the resolved config
    written beside the data; KEY=VALUE overrides apply."""
    from tracegym.cli import main

    config = tmp_path / "synth.yaml"
    config.write_text(
        "env: {name: calculator, options: {num_calls: 2}}\ntasks: 2\nsamples: 3\nteacher: {source: expert}\n"
        "filters:\n  - success: {min_reward: 1.0}\n  - {recovery: {prefer: true, per_task: 2}}\n  - pareto\n"
        "  - dedupe\n"
        f"output_dir: '{tmp_path / 'from_file'}'\n")
    assert main(["synthesize", "--config", str(config), "tasks=3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "from_file"
    summary = json.loads((out / "summary.json").read_text())
    # the expert solves all 9 (3 tasks by the override x 3 samples); recovery keeps 2 per task, dedupe 1
    assert [c["filter"] for c in summary["filters"]] == ["success:min_reward=1.0", "recovery:prefer:per_task=2",
                                                         "pareto", "dedupe"]
    assert [c["after"] for c in summary["filters"]] == [9, 6, 6, 3]
    assert "filter recovery:prefer:per_task=2: kept 6 of 9" in printed
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["tasks"] == 3 and resolved["filters"][0] == "success:min_reward=1.0"
    # the resolved config reproduces the run
    again = tmp_path / "again"
    assert main(["synthesize", "--config", str(out / "config.yaml"), f"output_dir={again}", "--no-progress"]) == 0
    assert [(t.task_id, t.messages) for t in _read(again / "trajectories.jsonl")] == \
        [(t.task_id, t.messages) for t in _read(out / "trajectories.jsonl")]


@pytest.mark.parametrize("extra, message", [
    (["filters=[sucess]"], "did you mean 'success'"),
    (["filters=[{recovery: {prefer: 3}}]"], "prefer must be true or false"),
    (["filters=[{success: 1, pareto: 2}]"], "one mapping"),
    (["tasks=0"], "'tasks'"),
    (["--tasks", "5"], "--tasks cannot be used with --config: set tasks=VALUE"),
    (["--teacher", "expert"], "set teacher.source=VALUE"),
])
def test_a_bad_config_names_the_key_with_exit_code_2(extra, message, tmp_path, capsys):
    from tracegym.cli import main

    config = tmp_path / "synth.yaml"
    config.write_text(f"env: {{name: calculator}}\ntasks: 1\noutput_dir: '{tmp_path / 'x'}'\n")
    assert main(["synthesize", "--config", str(config), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "x").exists()


def test_without_config_the_flags_are_required_and_overrides_refused(tmp_path, capsys):
    from tracegym.cli import main

    assert main(["synthesize", "--env", "calculator", "--no-progress"]) == 2
    assert "--teacher, --out required (or --config FILE)" in capsys.readouterr().err
    assert main(["synthesize", "tasks=3", "--env", "calculator", "--teacher", "expert", "--out", str(tmp_path)]) == 2
    assert "need --config" in capsys.readouterr().err
