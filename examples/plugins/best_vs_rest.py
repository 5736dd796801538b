"""An advantage estimator in a plain module: the best episode of each group gets +margin, the others
share -margin. Use it with ``tracegym rl --plugin examples/plugins/best_vs_rest.py ...
advantage.estimator=best_vs_rest``."""

from tracegym.algos.registry import ADVANTAGE_ESTIMATORS


@ADVANTAGE_ESTIMATORS.register("best_vs_rest")
def best_vs_rest(groups, *, margin: float = 1.0):  # keyword-only parameters are the options
    out = []
    for group in groups:
        best = max(range(len(group)), key=lambda i: group.rewards[i])
        rest = -margin / max(len(group) - 1, 1)
        out.append([[margin if i == best else rest] * len(t.turns)  # one value per turn
                    for i, t in enumerate(group.trajectories)])
    return out
