"""Env.snapshot() / Env.restore(): an episode branches from a prefix and continues exactly as the
original would (same observation, reward and termination for the same next action), for every
built-in env; snapshots are deep copies; envs that cannot branch say so clearly; check_env checks it."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from typing import Any, Callable

import pytest

from tracegym.envs import Env, EnvSnapshot, SnapshotUnsupported, Task, ToolEnv, make, tool
from tracegym.envs.check import check_env
from tracegym.types import Message, StepResult, ToolCall


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def call(name: str, id: str = "b0", **arguments: Any) -> Message:
    return Message(role="assistant", tool_calls=(ToolCall(name=name, arguments=arguments, id=id),))


def outcome(step: StepResult) -> tuple[Any, ...]:
    return (step.messages, step.reward, step.terminated, step.truncated, step.info)


@pytest.fixture(scope="module")
def search_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The search index in a temporary cache folder (never the user's)."""
    import os

    from tracegym.environments import search

    folder = tmp_path_factory.mktemp("tg_snapshot_cache")
    old = os.environ.get("TRACEGYM_CACHE")
    os.environ["TRACEGYM_CACHE"] = str(folder)
    search._backends.clear()
    yield folder
    search._backends.clear()
    if old is None:
        os.environ.pop("TRACEGYM_CACHE", None)
    else:
        os.environ["TRACEGYM_CACHE"] = old


# name -> (options, an alternative action that is not the expert's, as a function of the env)
BUILTIN: dict[str, tuple[dict[str, Any], Callable[[Any], Message]]] = {
    "calculator": ({"num_calls": 3}, lambda env: call("calculate", expression="2 ** 10 + 1")),
    "frozenlake": ({}, lambda env: call("move", direction="left")),
    "sokoban": ({}, lambda env: call("move", direction="up")),
    "service": ({}, lambda env: call("ask_user", question="What is your name and zip code?")),
    "search": ({"corpus_size": 2000}, lambda env: call("search", query="river mountain")),
}


@pytest.fixture(params=sorted(BUILTIN))
def builtin(request: pytest.FixtureRequest) -> tuple[Callable[[], Env], Callable[[Any], Message]]:
    name = request.param
    if name == "search":
        request.getfixturevalue("search_cache")
    options, alternative = BUILTIN[name]
    return (lambda: make(name, **options)), alternative


def test_every_builtin_env_can_branch(builtin: Any) -> None:
    factory, _ = builtin
    env = factory()
    assert env.can_branch and env.branch_refusal() is None


def test_restore_then_same_action_gives_identical_observation(builtin: Any) -> None:
    """SPECS 2: at every step of the expert's episode on several tasks, branch with the expert's
    action and with another action: each, replayed after a restore into the same instance and into
    a fresh one, gives the identical observation, reward, termination and info."""
    factory, alternative = builtin
    probe = factory()
    tasks = probe.tasks("test", n=3, seed=0) + probe.tasks("train", n=2, seed=1)
    branched = 0
    for task in tasks:
        env = factory()
        run(env.reset(task))
        for _ in range(40):
            snap = env.snapshot()
            assert isinstance(snap, EnvSnapshot) and snap.task_id == task.id
            expert, other = env.expert_action(), alternative(env)
            other_first = outcome(run(env.step(other)))
            assert outcome(run(factory_restored(factory, snap).step(other))) == other_first
            env.restore(snap)
            assert outcome(run(env.step(other))) == other_first  # the same snapshot, restored twice
            env.restore(snap)
            expert_first = outcome(run(env.step(expert)))
            fresh = factory()
            fresh.restore(snap)
            assert fresh.expert_action() == expert
            assert outcome(run(fresh.step(expert))) == expert_first
            branched += 1
            if expert_first[2] or expert_first[3]:
                break
        assert expert_first[2] and expert_first[4]["success"] == 1  # the expert, branched at every step, still solves it
    assert branched >= len(tasks) * 2


def test_snapshot_is_independent_of_later_mutation(builtin: Any) -> None:
    factory, alternative = builtin
    env = factory()
    task = env.tasks("test", n=2, seed=3)[1]
    run(env.reset(task))
    run(env.step(env.expert_action()))
    snap = env.snapshot()
    key = env.state_key()
    expert = env.expert_action()
    expected = outcome(run(factory_restored(factory, snap).step(expert)))
    # Mutate the env every way we can: further steps, bad calls, and its attributes in place.
    for action in (alternative(env), call("no_such_tool")):
        if not env.done:
            run(env.step(action))
    for value in vars(env).values():
        if isinstance(value, dict) and value and all(isinstance(v, int) for v in value.values()):
            for k in value:
                value[k] += 1000  # counters
        elif isinstance(value, (list, set)):
            value.clear()
    env.turn = 99
    # The snapshot did not move: restoring it (into the mutated env and a fresh one) gives the old point.
    env.restore(snap)
    assert env.turn == 1 and env.state_key() == key
    assert outcome(run(env.step(expert))) == expected
    assert outcome(run(factory_restored(factory, snap).step(expert))) == expected


def factory_restored(factory: Callable[[], Env], snap: EnvSnapshot) -> Env:
    env = factory()
    env.restore(snap)
    return env


def test_restored_state_is_not_shared_with_the_snapshot(builtin: Any) -> None:
    """Two instances restored from one snapshot and stepped differently do not affect each other."""
    factory, alternative = builtin
    env = factory()
    run(env.reset(env.tasks("test", n=1, seed=5)[0]))
    snap = env.snapshot()
    a, b = factory_restored(factory, snap), factory_restored(factory, snap)
    expert = a.expert_action()
    for action in (alternative(a), call("no_such_tool")):
        if not a.done:
            run(a.step(action))
    assert outcome(run(b.step(expert))) == outcome(run(factory_restored(factory, snap).step(expert)))


def test_snapshot_at_the_end_and_before_reset(builtin: Any) -> None:
    factory, _ = builtin
    env = factory()
    fresh_snap = env.snapshot()  # before any episode: restores to "no episode yet"
    run(env.reset(env.tasks("test", n=1, seed=0)[0]))
    while True:
        step = run(env.step(env.expert_action()))
        if step.terminated or step.truncated:
            break
    done = env.snapshot()
    other = factory_restored(factory, done)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        run(other.step(call("no_such_tool")))
    env.restore(fresh_snap)
    with pytest.raises(RuntimeError, match="before reset"):
        run(env.step(call("no_such_tool")))


def test_search_backend_is_shared_not_copied(search_cache: Any) -> None:
    env = make("search")
    run(env.reset(env.tasks("test", n=1, seed=0)[0]))
    run(env.step(env.expert_action()))
    snap = env.snapshot()
    assert "_backend" not in snap.state
    assert all(value is not env._backend for value in snap.state.values())
    fresh = factory_restored(lambda: make("search"), snap)
    assert fresh._backend is env._backend  # the process-wide index, loaded at restore like at reset


def test_service_backend_and_user_are_copied() -> None:
    env = make("service")
    run(env.reset(env.tasks("test", n=1, seed=0)[0]))
    run(env.step(env.expert_action()))
    snap = env.snapshot()
    assert snap.state["db"] is not env.db and snap.state["db"] == env.db
    assert snap.state["user"] is not env.user
    assert snap.state["user"].goal is snap.state["goal"]  # aliasing inside the state is kept
    fresh = factory_restored(lambda: make("service"), snap)
    assert fresh.user.goal is fresh.goal and fresh.db is not snap.state["db"]


# --- ToolEnv bookkeeping ---------------------------------------------------------------------------


class Dice(ToolEnv):
    """A branchable env with an RNG, a per-episode list and ToolEnv counters."""

    name = "dice"
    branchable = True
    default_max_turns = 16

    def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
        offset = 500_000 if split == "test" else 0
        return [Task(id=f"{split}-{seed}-{i}", split=split, data={"seed": offset + seed * 1000 + i}) for i in range(n)]

    async def reset(self, task: Task) -> list[Message]:
        self.task, self.rng, self.rolls = task, random.Random(task.data["seed"]), []
        return [Message(role="user", content=f"Game {task.data['seed']}: roll until the total reaches 12, then answer it.")]

    @tool
    def roll(self, echo: str = "") -> str:
        """Roll a die.

        Args:
            echo: Text repeated in the output (for long outputs).
        """
        self.rolls.append(self.rng.randint(1, 6))
        return f"{self.rolls[-1]} {echo}"

    def score_answer(self, answer: str) -> float:
        return float(answer == str(sum(self.rolls)))

    def expert_action(self) -> Message:
        if sum(self.rolls) < 12:
            return call("roll", id=f"r{self.turn}")
        return Message(role="assistant", content=f"<answer>{sum(self.rolls)}</answer>")


def test_rng_state_and_tool_counters_round_trip() -> None:
    env = Dice(max_turns=6, max_tool_output_chars=40)
    run(env.reset(env.tasks("test", 1)[0]))
    run(env.step(call("roll", echo="x" * 100)))  # a cut output
    run(env.step(call("roll", echo=7)))  # bad arguments
    run(env.step(call("nope")))  # unknown tool
    run(env.step(Message(role="assistant", content="<tool_call>{"), ["invalid JSON"]))  # a parse error
    snap = env.snapshot()
    assert snap.turn == 4
    rolls = [outcome(run(env.step(call("roll")))) for _ in range(2)]  # the RNG moves on; turn 6 truncates
    assert rolls[-1][3] and rolls[-1][4]["turns"] == 6
    counters = {"tool_calls": 5, "tool_errors": 2, "tool_timeouts": 0, "parse_errors": 1, "tool_output_truncated": 3}  # 2 error texts cut too
    assert {k: rolls[-1][4][k] for k in counters} == counters
    for target in (Dice(max_turns=6, max_tool_output_chars=40), env):
        target.restore(snap)
        assert [outcome(run(target.step(call("roll")))) for _ in range(2)] == rolls  # same dice, same counters, same cut


def test_tool_bookkeeping_helpers() -> None:
    env = Dice()
    run(env.reset(env.tasks("test", 1)[0]))
    run(env.step(call("nope")))
    book = env.tool_bookkeeping()
    assert book["turn"] == 1 and book["counters"]["tool_errors"] == 1 and book["done"] is False
    env.counters["tool_errors"] = 50
    assert book["counters"]["tool_errors"] == 1
    other = Dice()
    other.restore_tool_bookkeeping(book)
    book["counters"]["tool_errors"] = 7
    assert other.turn == 1 and other.counters["tool_errors"] == 1 and other._episode_started


def test_a_running_timed_out_tool_blocks_branching() -> None:
    release = threading.Event()

    class Stuck(Dice):
        @tool(timeout=0.05)
        def wait(self) -> str:
            """Wait for the test to release the call."""
            release.wait(10)
            self.rolls.append(100)  # a late change of the state, after the step returned
            return "done"

    env = Stuck()
    run(env.reset(env.tasks("test", 1)[0]))
    step = run(env.step(call("wait")))
    assert "timed out" in step.messages[0].content
    assert not env.can_branch
    assert "tool 'wait' still runs in the background" in env.branch_refusal()
    with pytest.raises(SnapshotUnsupported, match="cannot branch: a timed-out call of tool 'wait'"):
        env.snapshot()
    release.set()
    deadline = time.monotonic() + 10
    while not env.can_branch and time.monotonic() < deadline:
        time.sleep(0.01)
    assert env.can_branch
    assert env.snapshot().state["rolls"] == [100]


# --- envs that cannot branch -----------------------------------------------------------------------


class Plain(Dice):
    name = "plain"
    branchable = False


class Handle(Dice):
    name = "handle"

    async def reset(self, task: Task) -> list[Message]:
        messages = await super().reset(task)
        self.lock = threading.Lock()  # a resource, not data
        return messages


def test_an_env_that_does_not_implement_it_refuses_clearly() -> None:
    env = Plain()
    run(env.reset(env.tasks("test", 1)[0]))
    assert env.can_branch is False
    message = "env 'plain' (Plain) cannot branch: it does not implement snapshot/restore"
    with pytest.raises(SnapshotUnsupported, match=message.replace("(", r"\(").replace(")", r"\)")):
        env.snapshot()
    snap = Dice().snapshot()
    with pytest.raises(SnapshotUnsupported, match="cannot branch"):
        env.restore(snap)
    assert issubclass(SnapshotUnsupported, NotImplementedError)


def test_an_uncopyable_attribute_names_itself() -> None:
    env = Handle()
    run(env.reset(env.tasks("test", 1)[0]))
    with pytest.raises(SnapshotUnsupported, match=r"attribute 'lock' \(lock\) cannot be copied.*snapshot_exclude"):
        env.snapshot()

    class SharedHandle(Handle):
        snapshot_exclude = ("lock",)

    shared = SharedHandle()
    run(shared.reset(shared.tasks("test", 1)[0]))
    snap = shared.snapshot()
    assert "lock" not in snap.state
    other = SharedHandle()
    own_lock = other.lock = threading.Lock()
    other.restore(snap)
    assert other.lock is own_lock  # an excluded resource stays the target's own


def test_a_custom_env_without_toolenv_and_custom_state_hooks() -> None:
    class Counter(Env):
        name = "counter"

        def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
            return [Task(id=f"{split}{i}", split=split) for i in range(n)]

        def tool_schemas(self) -> list[dict[str, Any]]:
            return []

        async def reset(self, task: Task) -> list[Message]:
            self.count = 0
            return [Message(role="user", content="count")]

        async def step(self, message: Message, parse_errors: Any = ()) -> StepResult:
            self.count += 1
            return StepResult(messages=(Message(role="tool", content=str(self.count)),))

        def expert_action(self) -> Message:
            return Message(role="assistant", content="go")

    assert not Counter().can_branch

    class Custom(Counter):
        def snapshot_state(self) -> Any:
            return {"count": self.count}

        def restore_state(self, state: Any) -> None:
            self.count = state["count"]

    env = Custom()
    run(env.reset(Task(id="x")))
    run(env.step(env.expert_action()))
    snap = env.snapshot()
    assert snap.turn is None and snap.task_id is None
    run(env.step(env.expert_action()))
    other = Custom()
    other.restore(snap)
    assert run(other.step(other.expert_action())).messages[0].content == "2"


def test_restore_rejects_other_classes_and_objects() -> None:
    calc = make("calculator")
    run(calc.reset(calc.tasks("test", 1)[0]))
    snap = calc.snapshot()
    with pytest.raises(ValueError, match="cannot restore a snapshot of .*CalculatorEnv .* into .*FrozenLakeEnv"):
        make("frozenlake").restore(snap)
    with pytest.raises(TypeError, match="restore needs an EnvSnapshot"):
        calc.restore(snap.state)  # type: ignore[arg-type]


def test_mcp_envs_refuse_to_branch() -> None:
    from tracegym.envs.mcp import MCPServerConfig, MCPToolEnv

    class Remote(MCPToolEnv):
        name = "remote"
        branchable = True  # even when opted in: the servers' state is out of reach
        mcp_servers = (MCPServerConfig("units", sys.executable, ["-c", "pass"]),)

        def tasks(self, split: str = "train", n: int = 100, seed: int = 0) -> list[Task]:
            return []

        async def reset(self, task: Task) -> list[Message]:
            return []

        def expert_action(self) -> Message:
            return Message(role="assistant", content="")

    for scope in ("shared", "per_episode"):
        env = Remote(scope=scope)
        assert not env.can_branch
        with pytest.raises(SnapshotUnsupported, match=f"env 'remote' \\(Remote\\) cannot branch: .*MCP server processes \\(scope='{scope}'\\)"):
            env.snapshot()
        assert env._mcp_provider is None  # asking started no server


# --- check_env -------------------------------------------------------------------------------------


def test_check_env_skips_envs_that_cannot_branch() -> None:
    report = check_env(Plain, n_tasks=4, raise_on_failure=False)
    assert report.ok and "branching" not in report.passed
    assert report.skipped["branching"] == "env 'plain' (Plain) cannot branch: it does not implement snapshot/restore"
    assert "skip  branching: env 'plain'" in str(report)


def test_check_env_passes_a_branchable_env() -> None:
    report = check_env(Dice, n_tasks=4, raise_on_failure=False)
    assert report.ok, str(report)
    assert "branching" in report.passed and not report.skipped


class Hidden(Dice):
    """State the snapshot cannot see: the dice live in a class attribute shared by all instances."""

    name = "hidden"
    shared_rng = random.Random(0)

    async def reset(self, task: Task) -> list[Message]:
        messages = await super().reset(task)
        type(self).shared_rng = random.Random(task.data["seed"])
        return messages

    @tool
    def roll(self, echo: str = "") -> str:
        """Roll a die.

        Args:
            echo: Ignored.
        """
        self.rolls.append(self.shared_rng.randint(1, 6))
        return str(self.rolls[-1])


class Shallow(Dice):
    """A snapshot that is not a copy: later steps change it."""

    name = "shallow"

    def snapshot_state(self) -> Any:
        return {"rolls": self.rolls, "rng": self.rng, **self.tool_bookkeeping(), "task": self.task}

    def restore_state(self, state: Any) -> None:
        self.rolls, self.rng, self.task = state["rolls"], state["rng"], state["task"]
        self.restore_tool_bookkeeping(state)

    def snapshot(self) -> EnvSnapshot:
        return EnvSnapshot(env=self.name, env_class=f"{__name__}.Shallow", state=self.snapshot_state())

    def restore(self, snapshot: EnvSnapshot) -> None:
        self.restore_state(snapshot.state)  # no copy


@pytest.mark.parametrize("broken", [Hidden, Shallow])
def test_check_env_catches_a_broken_snapshot(broken: type[Env]) -> None:
    report = check_env(broken, n_tasks=4, raise_on_failure=False)
    assert "branching" in report.failures, str(report)
    problems = report.failures["branching"]
    assert any("replayed step" in p or "expert's next action differs" in p or "state_key" in p for p in problems)
    assert "determinism" in report.passed and "expert" in report.passed
