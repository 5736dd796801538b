"""Progress without a terminal: plain progress lines, the heartbeat, and the CLI's warning filter.

The line timing tests drive ``ProgressBar`` with a fake clock, so they never sleep; only the
heartbeat test uses real time (a 0.05 s interval).
"""

from __future__ import annotations

import io
import re
import time
import warnings
from typing import Sequence

from tracegym.cli import hide_dependency_future_warnings, main
from tracegym.envs.base import Env, Task
from tracegym.rollout import run_rollouts_sync
from tracegym.rollout.runner import _progress_bar
from tracegym.train.logging import ProgressBar
from tracegym.types import Message, ParsedCompletion, StepResult

PLAIN_LINE = re.compile(r"^(sft|rl|rollout) (step|episode) \d+/\d+ ")


class FakeStream(io.StringIO):
    """An in-memory stdout that says whether it is a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plain_bar(total: int, stream: FakeStream, clock: FakeClock, **kwargs) -> ProgressBar:
    # No heartbeat: its thread sleeps in real time, and a fake clock jumping 36 s could wake it.
    return ProgressBar(total, "rl", stream=stream, clock=clock, heartbeat=False, **kwargs)


def test_plain_lines_at_first_update_then_every_interval_and_at_the_last_step():
    stream, clock = FakeStream(tty=False), FakeClock()
    with _plain_bar(8, stream, clock) as bar:
        for step in range(1, 9):
            clock.now += 12.0  # 12 s per step: lines at steps 1, 4 (36 s after 1), 7, and 8 (last)
            bar.update(1, info=f"reward 0.{step}")
    lines = stream.lines()
    assert [line.split(" | ")[0] for line in lines] == ["rl step 1/8", "rl step 4/8", "rl step 7/8", "rl step 8/8"]
    assert lines[0] == "rl step 1/8 | reward 0.1 | 12.0 s/step | eta 1m24s"
    assert lines[1] == "rl step 4/8 | reward 0.4 | 12.0 s/step | eta 48s"
    assert lines[-1] == "rl step 8/8 | reward 0.8 | 12.0 s/step | took 1m36s"


def test_plain_lines_show_tokens_per_second_and_fast_rates_per_second():
    stream, clock = FakeStream(tty=False), FakeClock()
    with ProgressBar(100, "sft", stream=stream, clock=clock, heartbeat=False) as bar:
        clock.now += 0.5
        bar.update(1, info="loss 1.2500", tokens=1000)
    assert stream.lines() == ["sft step 1/100 | loss 1.2500 | 2.00 step/s 2000.0 tok/s | eta 50s"]


def test_a_resumed_run_counts_from_its_completed_step():
    stream, clock = FakeStream(tty=False), FakeClock()
    with _plain_bar(10, stream, clock, completed=6) as bar:
        clock.now += 5.0
        bar.update(1)
    # The rate and ETA use only the step run here, not the six done before the resume.
    assert stream.lines() == ["rl step 7/10 | 5.0 s/step | eta 15s"]


def test_heartbeat_prints_while_a_step_is_long_and_stops_on_close():
    stream = FakeStream(tty=False)
    bar = ProgressBar(3, "rl", stream=stream, interval_s=0.05)
    bar.update(1, info="reward 0.5")
    time.sleep(0.28)  # step 2 "runs" for several intervals
    bar.close()
    lines = stream.lines()
    assert lines[0].startswith("rl step 1/3 | reward 0.5 | ")
    beats = [line for line in lines if line.endswith(")") and "still running" in line]
    assert len(beats) >= 2, lines
    assert all(re.fullmatch(r"rl step 2/3 still running \(\d+s\)", line) for line in beats), beats
    after_close = len(stream.lines())
    time.sleep(0.12)
    assert len(stream.lines()) == after_close  # the heartbeat thread is gone


def test_heartbeat_reports_steps_that_finished_between_lines():
    stream = FakeStream(tty=False)
    with ProgressBar(5, "rl", stream=stream, interval_s=0.1) as bar:
        bar.update(1, info="reward 0.1")
        bar.update(1, info="reward 0.2")  # too soon after the first line to print
        time.sleep(0.15)
    lines = stream.lines()
    assert lines[0].startswith("rl step 1/5 | reward 0.1 | ")
    assert lines[1].startswith("rl step 2/5 | reward 0.2 | "), lines


def test_heartbeat_also_covers_the_wait_before_the_first_step():
    stream = FakeStream(tty=False)
    with ProgressBar(4, "sft", stream=stream, interval_s=0.05):
        time.sleep(0.12)
    assert any(line.startswith("sft step 1/4 still running") for line in stream.lines()), stream.lines()


def test_heartbeat_after_the_last_step_says_finishing():
    stream = FakeStream(tty=False)
    with ProgressBar(1, "sft", stream=stream, interval_s=0.05) as bar:
        bar.update(1)
        time.sleep(0.12)  # e.g. the final model being saved
    lines = stream.lines()
    assert lines[0].startswith("sft step 1/1 | ")
    assert re.fullmatch(r"sft step 1/1 done, finishing \(\d+s\)", lines[1]), lines


def test_a_terminal_gets_the_rich_bar_and_no_plain_lines():
    stream, clock = FakeStream(tty=True), FakeClock()
    with ProgressBar(3, "rl", stream=stream, clock=clock, interval_s=0.01) as bar:
        for _ in range(3):
            clock.now += 1.0
            bar.update(1, info="reward 0.5")
        time.sleep(0.05)  # a heartbeat thread (there must be none) would have printed by now
    assert stream.getvalue()  # rich drew its bar on the "terminal"
    assert not any(PLAIN_LINE.match(line) for line in stream.lines())
    assert "still running" not in stream.getvalue()


def test_disabled_prints_nothing():
    stream = FakeStream(tty=False)
    with ProgressBar(3, "rl", enabled=False, stream=stream, interval_s=0.01) as bar:
        bar.update(1, info="reward 0.5")
        time.sleep(0.05)
    assert stream.getvalue() == ""


def test_a_broken_stdout_turns_the_lines_off_instead_of_failing():
    class ClosedStream(FakeStream):
        def write(self, text):
            raise OSError("broken pipe")

    with ProgressBar(2, "rl", stream=ClosedStream(tty=False), interval_s=0.01) as bar:
        bar.update(1)
        bar.update(1)


# --- rollouts ------------------------------------------------------------------------------------


def test_rollout_progress_helper_prints_episode_lines_when_not_a_terminal():
    stream, clock = FakeStream(tty=False), FakeClock()
    with _progress_bar(4, True, stream=stream, clock=clock, heartbeat=False) as bar:
        for _ in range(4):
            clock.now += 2.0
            bar.update(1, tokens=50)
    assert stream.lines() == [
        "rollout episode 1/4 | 2.0 s/episode 25.0 tok/s | eta 6s",
        "rollout episode 4/4 | 2.0 s/episode 25.0 tok/s | took 8s",
    ]


class _OneStepEnv(Env):
    name = "one-step"

    def tasks(self, split="train", n=100, seed=0):
        return [Task(id=f"t{i}", split=split) for i in range(n)]

    def tool_schemas(self):
        return []

    async def reset(self, task):
        return [Message(role="user", content="go")]

    async def step(self, message, parse_errors=()):
        return StepResult(messages=(), reward=1.0, terminated=True)

    def expert_action(self):
        return Message(role="assistant", content="done")


class _CharRenderer:
    """One token per character; enough of a renderer for the expert path."""

    name = "chars"
    history_preserving = True

    def render_prompt(self, messages: Sequence[Message], tools=None) -> list[int]:
        return [ord(c) for m in messages for c in m.content]

    def continue_prompt(self, previous_prompt, completion_ids, new_messages) -> list[int]:
        return list(previous_prompt) + list(completion_ids) + [ord(c) for m in new_messages for c in m.content]

    def encode_completion(self, message: Message) -> list[int]:
        return [ord(c) for c in message.content]

    def parse_completion(self, completion_ids) -> ParsedCompletion:
        text = "".join(chr(i) for i in completion_ids)
        return ParsedCompletion(message=Message(role="assistant", content=text), ended_with_eot=True)

    @property
    def stop_token_ids(self) -> list[int]:
        return []


def test_run_rollouts_prints_plain_progress_to_a_redirected_stdout(capsys):
    # Under pytest's capture sys.stdout is no terminal, as under nohup or CI.
    result = run_rollouts_sync(_OneStepEnv, [Task(id="a"), Task(id="b")], "expert", _CharRenderer(), progress=True)
    assert len(result.trajectories) == 2
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines[-1].startswith("rollout episode 2/2 | ")
    assert "tok/s" in lines[-1]


# --- the CLI's warning filter --------------------------------------------------------------------


def _shown(category: type[Warning], module: str, message: str = "deprecated") -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_dependency_future_warnings()
        warnings.warn_explicit(message, category, filename="x.py", lineno=1, module=module)
    return bool(caught)


def test_cli_hides_future_warnings_of_transformers_and_peft_only():
    assert not _shown(FutureWarning, "transformers.modeling_utils")
    assert not _shown(FutureWarning, "transformers")
    assert not _shown(FutureWarning, "peft.tuners.lora")
    assert _shown(FutureWarning, "tracegym.train.rl")  # tracegym's own warnings still show
    assert _shown(FutureWarning, "transformers_extra")  # a different package that only starts alike
    assert _shown(DeprecationWarning, "transformers.modeling_utils")  # other categories still show
    assert _shown(UserWarning, "peft.tuners.lora")
    # peft's note on saving an adapter of a base it cannot look up (a tracegym model name) is hidden
    saving = "Could not find a config file in smollm2-135m - will assume that the vocabulary was not modified."
    assert not _shown(UserWarning, "peft.utils.save_and_load", saving)
    assert _shown(UserWarning, "tracegym.train.checkpoint", saving)


def test_cli_entry_installs_the_filter(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([]) == 0  # no command: prints the help
        warnings.warn_explicit("deprecated", FutureWarning, filename="x.py", lineno=1, module="transformers.x")
        warnings.warn_explicit("deprecated", FutureWarning, filename="x.py", lineno=1, module="tracegym.x")
    assert [str(w.message) for w in caught] == ["deprecated"]
    assert caught[0].filename == "x.py" and capsys.readouterr().out
