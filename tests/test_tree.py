"""Tree-search rollouts (``tracegym.rollout.tree``) and the ``tree`` estimator (``tracegym.algos.tree``).

The estimator against the hand values of SPECS.md section 2 and against GRPO on depth-1 trees; the
1/L token weights (every node weighs 1 in total) through examples, batch and loss; the rollouts on
the two-turn toy env of ``test_mc_continuation`` with scripted engines (structure, shared prefixes
token-exact, fork-point choice, budget, refusals); the hf engine prefilling a fork's prompt once; and
``tracegym rl ... rollout.strategy=tree advantage.estimator=tree`` end to end.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from test_mc_continuation import RENDERER, ScriptEngine, TwoStep, is_turn0, text_of
from tracegym.algos import aggregate, estimate
from tracegym.algos.tree import TREE_KEY, tree_turn_values
from tracegym.batch import examples_from_groups, make_batch
from tracegym.config import TreeConfig
from tracegym.envs.base import Env, Task
from tracegym.rollout import RolloutConfig
from tracegym.rollout.branches import BranchingUnsupported
from tracegym.rollout.tree import fork_points, run_tree_rollouts_sync
from tracegym.types import Generation, Message, StepResult, Trajectory, TrajectoryGroup, Turn, group_trajectories


# --- the estimator ---------------------------------------------------------------------------------


def flat(nested) -> list[float]:
    return [float(v) for v in nested] if not isinstance(nested[0], list) else [v for part in nested for v in flat(part)]


def spec_tree() -> tuple[list[float], list[list[str]]]:
    """root -> a {leaves 1, 0}, b {0, 0}: two turns per leaf, the first shared under a or b."""
    return [1.0, 0.0, 0.0, 0.0], [["a", "0:1"], ["a", "1:1"], ["b", "2:1"], ["b", "3:1"]]


def test_treerl_matches_the_spec_values():
    rewards, nodes = spec_tree()
    adv, weights, segments = tree_turn_values(rewards, nodes, "treerl", "1/L")
    s = 1 / math.sqrt(2)  # (0.25 + 0.25) / sqrt(2) = 0.3536
    expected = [[0.5 * s, 1.25], [0.5 * s, -0.75], [-0.5 * s, -0.25], [-0.5 * s, -0.25]]
    assert flat(adv) == pytest.approx(flat(expected), abs=1e-12)
    assert round(adv[0][0], 4) == 0.3536
    assert weights == [[0.5, 1.0]] * 4 and segments == 6
    local, _, _ = tree_turn_values(rewards, nodes, "local", "none")
    # V(a) - V(root) = 0.25; leaf 0: V - V(a) = 0.5; leaf 2: 0 - V(b) = 0
    assert flat(local) == pytest.approx(flat([[0.25, 0.5], [0.25, -0.5], [-0.25, 0.0], [-0.25, 0.0]]))
    leaves, weights, _ = tree_turn_values(rewards, nodes, "grpo_leaves", "1/sqrtL")
    assert flat(leaves) == pytest.approx([0.75, 0.75] + [-0.25, -0.25] * 3)
    assert weights[0] == pytest.approx([1 / math.sqrt(2), 1.0])


def test_leaf_loo_normalises_the_leaf_rewards_first():
    rewards, nodes = spec_tree()
    adv, _, _ = tree_turn_values(rewards, nodes, "local", "none", leaf_loo=True)
    loo = [1.0 - 0.0, 0.0 - 1 / 3, 0.0 - 1 / 3, 0.0 - 1 / 3]  # R_i - mean of the others
    root = sum(loo) / 4
    assert adv[0] == pytest.approx([(loo[0] + loo[1]) / 2 - root, loo[0] - (loo[0] + loo[1]) / 2])


def _trajectory(task: str, index: int, rewards: list[float], nodes: list[str] | None = None) -> Trajectory:
    turns, context = [], (1, 2)
    for k, r in enumerate(rewards):  # each prompt extends the last: one example per trajectory
        completion = (50 + k, 60 + k)
        turns.append(Turn(prompt_ids=context, completion_ids=completion, completion_logprobs=(-0.5, -0.5),
                          message=Message(role="assistant", content="x"), reward=r))
        context = context + completion + (7,)  # the observation's token
    info = {TREE_KEY: {"nodes": nodes, "parent": None, "fork_turn": 0}} if nodes is not None else {}
    return Trajectory(env="toy", task_id=task, sample_index=index, messages=(), turns=tuple(turns), reward=sum(rewards),
                      info=info)


def test_on_independent_chains_local_is_grpo_mean_centred_and_treerl_twice_that():
    groups = group_trajectories([_trajectory("t", i, [0.0, r]) for i, r in enumerate([1.0, 0.0, 0.0, 1.0, 1.0])])
    centred = estimate("dr_grpo", groups).advantages  # R_i - mean R on every turn
    local = estimate("tree", groups, {"mode": "local", "weight": "none"})
    treerl = estimate("tree", groups, {"mode": "treerl"})
    # a chain is one segment of one leaf: every turn gets V(leaf) - V(root)
    assert flat(local.advantages) == pytest.approx(flat(centred))
    assert flat(treerl.advantages) == pytest.approx([2 * a for a in flat(centred)])
    assert local.weights == [[[1.0, 1.0]] * 5] and treerl.weights == [[[1.0, 1.0]] * 5]
    assert treerl.metrics == {"tree_segments": 5.0, "tree_shared_turns": 0.0}


def random_tree(rng: random.Random, leaves: int, depth: int) -> list[list[str]]:
    """Leaves built by forking a random earlier leaf at a random turn, as the rollouts do."""
    paths = [[f"0:{k}" for k in range(depth)]]
    for leaf in range(1, leaves):
        parent, t = rng.randrange(leaf), rng.randrange(depth)
        paths.append(paths[parent][:t] + [f"{leaf}:{k}" for k in range(t, depth)])
    return paths


@pytest.mark.parametrize("mode", ["treerl", "local", "grpo_leaves"])
def test_leaves_of_equal_reward_give_exactly_zero(mode: str):
    # rewards equal but not representable: the float means of a segment and of the root differed in the last bits
    # (up to 2.6e-16), which has_signal counted as signal, so skip_uniform_groups trained on such trees
    nodes = [["a", "b"], ["a", "c"], ["a", "c"], ["d"], ["d"], ["e"]]
    for reward in (0.1, 0.2, 0.7, 1 / 3):
        for leaf_loo in (False, True):
            advantages, weights, segments = tree_turn_values([reward] * 6, nodes, mode, "1/L", leaf_loo)
            assert advantages == [[0.0, 0.0]] * 3 + [[0.0]] * 3, (reward, leaf_loo)
            assert weights[0] == [1 / 3, 1.0] and segments == 5  # weights and structure unchanged
    trajectories = [_trajectory("t", i, [0.0, 0.7], [f"{i // 2}", f"{i}:1"]) for i in range(4)]
    result = estimate("tree", group_trajectories(trajectories), {"mode": mode})
    assert result.advantages == [[[0.0, 0.0]] * 4]
    # a subtree of equal leaves next to a different one: its segments differ from each other by exactly 0
    advantages, _, _ = tree_turn_values([0.1, 0.1, 0.1, 1.0, 0.1, 0.1], nodes, "local", "none")
    assert advantages[1][1] == 0.0 and advantages[0][1] == 0.0


def test_zero_reward_failed_leaves_have_their_turn_rewards_zeroed():
    from tracegym.algos import episode_reward_problems
    from tracegym.rollout.tree import TreeStats, _Tree, _tree_result

    ok = _trajectory("t", 0, [0.5, 1.0], ["a", "0:1"])
    failed = _trajectory("t", 1, [0.5], ["a"]).model_copy(update={"end_reason": "env_error", "error": "boom"})
    result = _tree_result([_Tree(task=Task(id="t"), leaves=[ok, failed])], RolloutConfig(on_env_error="zero_reward"),
                          TreeStats(), 0, 0)
    kept = {t.sample_index: t for t in result.trajectories}
    assert kept[1].reward == 0.0 and [t.reward for t in kept[1].turns] == [0.0]  # used to keep the turn's 0.5
    assert kept[0].reward == 1.5 and [t.reward for t in kept[0].turns] == [0.5, 1.0]
    assert episode_reward_problems(group_trajectories(result.trajectories)) == []


@pytest.mark.parametrize("seed", range(5))
def test_every_node_weighs_one_in_total_with_1_over_L(seed: int):
    rng = random.Random(seed)
    nodes = random_tree(rng, leaves=8, depth=4)
    _, weights, _ = tree_turn_values([float(rng.random() < 0.5) for _ in nodes], nodes, "treerl", "1/L")
    total: dict[str, float] = {}
    for path, w in zip(nodes, weights):
        for node, value in zip(path, w):
            total[node] = total.get(node, 0.0) + value
    assert len(total) > 8 + 3  # some nodes are shared
    assert all(v == pytest.approx(1.0) for v in total.values())


class TokenRenderer:
    """The one method ``examples_from_groups`` calls: the template-independent default."""

    def build_examples(self, trajectory, **kw):
        from tracegym.render.trajectory_examples import build_examples

        return build_examples(trajectory, **kw)


def test_token_weights_reach_the_tokens_and_count_a_shared_prefix_once():
    # two leaves sharing turn 0 ("a"), then a turn of their own
    group = TrajectoryGroup(env="toy", task_id="t", trajectories=(
        _trajectory("t", 0, [0.0, 1.0], ["a", "0:1"]), _trajectory("t", 1, [0.0, 0.0], ["a", "1:1"])))
    result = estimate("tree", [group], {"mode": "local"})
    assert result.weights == [[[0.5, 1.0], [0.5, 1.0]]]
    data = examples_from_groups([group], TokenRenderer(), result.advantages, weights=result.weights)
    batch = make_batch(data.examples, pad_token_id=0)
    for row, example in enumerate(data.examples):
        trained = [w for w, m in zip(example.weights, example.loss_mask) if m]
        assert trained == [0.5, 0.5, 1.0, 1.0]  # two tokens per turn
        assert batch.weights[row][batch.loss_mask[row].bool()].tolist() == trained
    # token_mean with sample weights = mean over the distinct tree tokens: the shared turn's two
    # tokens once (values 1, 2), each leaf's own turn (3, 3 and 5, 5): (1 + 2 + 3 + 3 + 5 + 5) / 6
    per_token = torch.zeros_like(batch.loss_mask)
    for row, own in enumerate((3.0, 5.0)):
        cols = batch.loss_mask[row].nonzero().flatten().tolist()
        per_token[row, cols] = torch.tensor([1.0, 2.0, own, own])
    loss = aggregate(per_token, batch.loss_mask, "token_mean", normalizers=batch.normalizers, sample_weights=batch.weights)
    assert float(loss) == pytest.approx(19.0 / 6.0)
    unweighted = aggregate(per_token, batch.loss_mask, "token_mean", normalizers=batch.normalizers)
    assert float(unweighted) == pytest.approx(22.0 / 8.0)  # the shared tokens counted twice


def test_an_estimator_with_badly_shaped_weights_is_named():
    from tracegym.algos import EstimatorResult
    from tracegym.algos.registry import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("test_bad_weights")
    def bad(groups):
        return EstimatorResult([[[0.0] * len(t.turns) for t in g.trajectories] for g in groups], weights=[[[1.0]]])

    try:
        groups = group_trajectories([_trajectory("t", 0, [0.0, 1.0])])
        with pytest.raises(ValueError, match="test_bad_weights.*2 turns but 1 token weights"):
            estimate("test_bad_weights", groups)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test_bad_weights")


# --- the rollouts -----------------------------------------------------------------------------------


def turn_script(text: str) -> list[str]:
    return ["good", "bad", "meh"] if is_turn0(text) else ["bonus", "x", "y"]


def run(engine, tree: TreeConfig, leaves: int = 6, n_tasks: int = 2, env=TwoStep, **config):
    tasks = env().tasks(n=n_tasks)
    return run_tree_rollouts_sync(env, tasks, engine, RENDERER, RolloutConfig(max_turns=4, **config), tree, leaves)


def test_a_tree_has_its_leaves_and_branches_repeat_the_prefix_token_exactly():
    engine = ScriptEngine(turn_script)
    result, stats = run(engine, TreeConfig(branch="uniform", branches=2), leaves=6)
    assert (stats.trees, stats.leaves, stats.rounds, stats.forks, stats.failed) == (2, 12, 1, 4, 0)
    by_task = {}
    for t in result.trajectories:
        by_task.setdefault(t.task_id, []).append(t)
    for leaves in by_task.values():
        assert [t.sample_index for t in leaves] == list(range(6))
        first = leaves[:3]  # init_chains = ceil(6 / 2): independent chains, own nodes
        assert [t.info[TREE_KEY]["parent"] for t in first] == [None] * 3
        assert [t.info[TREE_KEY]["nodes"] for t in first] == [[f"{i}:0", f"{i}:1"] for i in range(3)]
        for leaf in leaves[3:]:
            info = leaf.info[TREE_KEY]
            parent = leaves[info["parent"]]
            assert info["fork_turn"] == 1  # two-turn episodes: the only boundary is after turn 0
            assert info["nodes"] == [parent.info[TREE_KEY]["nodes"][0], f"{leaf.sample_index}:1"]
            shared, new = leaf.turns[0], leaf.turns[1]
            assert shared == parent.turns[0]  # tokens, log-probs, observation and reward as recorded
            assert new.prompt_ids == parent.turns[1].prompt_ids  # the branch continues from the same prompt
            assert leaf.reward == 0.125 + (0.5 if text_of(new.completion_ids).startswith("bonus") else 0.0) + (
                1.0 if text_of(shared.completion_ids).startswith("good") else 0.0)
    # the shared turns cost no generation: 12 leaves' tokens minus the 6 repeated turn-0 actions
    repeated = sum(len(t.turns[0].completion_ids) for t in result.trajectories if t.info[TREE_KEY]["parent"] is not None)
    assert stats.generated_tokens == stats.chain_tokens - repeated == result.stats.generated_tokens
    # every branch of a fork asked for the fork's prompt: the engine saw it with its siblings
    assert result.stats.kept == 12 and result.stats.success_rate == pytest.approx(
        sum(t.success for t in result.trajectories) / 12)


class Unsure(ScriptEngine):
    """Samples like ScriptEngine; the log-probs say the policy is unsure after "meh" (-3 per token)."""

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        fixed = []
        for prompt, gens in zip(prompts, out):
            lp = -3.0 if "meh" in text_of(prompt) else -0.1
            fixed.append([g.model_copy(update={"logprobs": tuple(lp for _ in g.token_ids)}) for g in gens])
        return fixed


def test_entropy_branching_forks_where_the_policy_was_least_sure():
    result, stats = run(Unsure(turn_script), TreeConfig(branch="entropy", branches=3, init_chains=3), leaves=6, n_tasks=1)
    assert stats.forks == 1
    branched = [t for t in result.trajectories if t.info[TREE_KEY]["parent"] is not None]
    assert len(branched) == 3 and {t.info[TREE_KEY]["parent"] for t in branched} == {2}  # leaf 2 played "meh"
    points = fork_points(result.trajectories[:3], entropy_tokens=2)
    assert [(leaf, t) for leaf, t, _ in points] == [(0, 1), (1, 1), (2, 1)]
    assert [round(score, 6) for _, _, score in points] == [0.1, 0.1, 3.0]


def test_rounds_fork_deeper_and_the_token_budget_stops_them():
    class ThreeStep(TwoStep):  # a third turn, so a second round can fork at turn 2
        async def step(self, message, parse_errors=()):
            self.turn += 1
            if self.turn < 3:
                return StepResult(messages=(Message(role="user", content="next"),), reward=0.0)
            return StepResult(reward=1.0, terminated=True)

    result, stats = run(ScriptEngine(turn_script), TreeConfig(branch="uniform", init_chains=2, rounds=3, branches=1),
                        leaves=8, n_tasks=1, env=ThreeStep)
    assert (stats.leaves, stats.rounds) == (8, 3)
    assert {t.info[TREE_KEY]["fork_turn"] for t in result.trajectories} >= {0, 1}
    _, budgeted = run(ScriptEngine(turn_script), TreeConfig(init_chains=2, rounds=3, max_tokens_per_tree=1),
                      leaves=8, n_tasks=1, env=ThreeStep)
    assert (budgeted.leaves, budgeted.rounds) == (2, 0)  # the first chains spent the budget


def test_one_turn_episodes_fork_at_the_root():
    class OneStep(TwoStep):
        async def step(self, message, parse_errors=()):
            return StepResult(reward=float(message.content == "good"), terminated=True)

    result, stats = run(ScriptEngine(turn_script), TreeConfig(), leaves=4, n_tasks=1, env=OneStep)
    assert (stats.leaves, stats.root_forks) == (4, 1)
    assert all(t.info[TREE_KEY]["parent"] is None for t in result.trajectories)


def test_an_env_that_cannot_branch_is_refused_by_name():
    class Plain(TwoStep):
        name = "plain"
        branchable = False

    with pytest.raises(BranchingUnsupported, match="tree rollouts: env 'plain'"):
        run(ScriptEngine(turn_script), TreeConfig(), leaves=4, env=Plain)


def test_the_hf_engine_prefills_a_forks_prompt_once(tiny_model):
    from tracegym.engines.hf import HFEngine
    from tracegym.render import get_renderer

    model, tokenizer = tiny_model
    renderer = get_renderer("tiny-random", tokenizer)
    engine = HFEngine(model, tokenizer=tokenizer, max_batch_size=16, pad_token_id=tokenizer.eos_token_id)
    config = RolloutConfig(max_turns=3, max_tokens_per_turn=4, temperature=1.0, seed=0)
    # TwoStep always goes on after turn 0: the one fork (3 branches) is after turn 0 of leaf 0
    result, stats = run_tree_rollouts_sync(TwoStep, TwoStep().tasks(n=1), engine, renderer, config,
                                           TreeConfig(branch="uniform", branches=3, init_chains=1), 4)
    assert (stats.leaves, stats.forks, stats.root_forks) == (4, 1, 0)
    fork_prompt = result.trajectories[0].turns[1].prompt_ids
    assert all(t.turns[1].prompt_ids == fork_prompt for t in result.trajectories)
    # the 3 branches send that prompt in one generate call: computed once, copied to the other 2 rows
    reused_before = engine.prefix_tokens_reused
    assert stats.prefix_tokens_reused >= 2 * len(fork_prompt) and stats.prefill_tokens > 0
    assert stats.generated_tokens < stats.chain_tokens  # leaf 0's turn 0 was not sampled 3 more times
    assert reused_before == stats.prefix_tokens_reused  # a fresh engine: all of it from this call


def test_rl_runs_tree_rollouts_with_the_tree_estimator_from_the_cli(tmp_path):
    from tracegym.cli import main
    from tracegym.train.logging import read_metrics

    config = tmp_path / "rl.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 4}\nenv: {name: frozenlake, options: {size: 3, hole_fraction: 0.0}}\n"
        "tasks: {train: 2, test: 1}\ntasks_per_step: 1\ngroup_size: 4\n"
        "rollout: {max_turns: 3, max_tokens_per_turn: 4, concurrency: 8}\nsteps: 1\nskip_uniform_groups: false\n"
        "eval: {at_start: false, every: 0}\n"
        f"output_dir: '{tmp_path / 'run'}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    assert main(["rl", "--config", str(config), "rollout.strategy=tree", "rollout.tree.branch=uniform",
                 "advantage.estimator=tree", "advantage.options.mode=local"]) == 0
    row = read_metrics(tmp_path / "run")[-1]
    assert row["tree/leaves"] == 4.0 and row["tree/forks"] >= 1.0
    assert row["tree/generated_tokens"] <= row["tree/chain_tokens"]
    assert row["examples/count"] == 4.0 and "advantage/tree_segments" in row
    saved = [Trajectory.model_validate_json(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert sorted(t.sample_index for t in saved) == [0, 1, 2, 3] and all(TREE_KEY in t.info for t in saved)
