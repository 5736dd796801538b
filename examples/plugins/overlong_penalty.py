"""A scoring pass from a plugin file: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO",
arXiv 2503.14476, section 3.4), over an episode's sampled tokens. An episode of ``n`` sampled
tokens loses nothing up to ``max_tokens - cache_tokens``, then a penalty growing linearly to 1 at
``max_tokens``, and 1 beyond; the penalty comes off its last turn's reward (and the episode's), so
group-relative estimators prefer the shorter of two equally good episodes.

    tracegym rl --plugin examples/plugins/overlong_penalty.py --config my_rl.yaml
    advantage: {intrinsic: overlong_penalty, intrinsic_options: {max_tokens: 256, cache_tokens: 64}}
"""

from tracegym.rl.scoring import SCORING_PASSES, ScoringJob, with_reward_offset


def soft_overlong_penalty(n: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's R_length(n): 0, then ((max - cache) - n) / cache, then -1 (always <= 0)."""
    start = max_tokens - cache_tokens
    if n <= start:
        return 0.0
    return -1.0 if n > max_tokens else (start - n) / cache_tokens


@SCORING_PASSES.register("overlong_penalty")
def overlong_penalty(job: ScoringJob, *, max_tokens: int, cache_tokens: int, weight: float = 1.0):
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty: need 0 < cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}")
    groups, penalties = [], []
    for group in job.groups:
        episodes = []
        for episode in group.trajectories:
            sampled = sum(len(turn.completion_ids) for turn in episode.turns)
            penalty = weight * soft_overlong_penalty(sampled, max_tokens, cache_tokens)
            penalties.append(penalty)
            episodes.append(with_reward_offset(episode, penalty))
        groups.append(group.model_copy(update={"trajectories": tuple(episodes)}))
    mean = sum(penalties) / max(len(penalties), 1)
    return groups, {"overlong/penalty_mean": mean, "overlong/penalised": float(sum(p < 0 for p in penalties))}
