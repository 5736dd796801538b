"""``tracegym judge TRAJECTORIES.jsonl --base-url URL --model NAME --out DIR``: score saved episodes
with an LLM judge (the judge ``reward.judge`` uses in RL) and measure how it agrees with the
episodes' verifiable rewards, before a run trains on it.

Writes ``DIR/judged.jsonl`` (every episode with ``info["judge"]``: its score, None in a task group
the judge could not score, and the raw replies), ``DIR/judge.json`` (agreement: Spearman
with a bootstrap interval over tasks and the within-task pairwise accuracy; cost; failures; position
bias) and ``DIR/judge_cache.jsonl`` (a second run over the same episodes pays nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "judge"
HELP = "Score saved trajectories with an LLM judge (OpenAI-compatible) and report its agreement with their rewards."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trajectories", help="a trajectories.jsonl (of tracegym eval or rollout)")
    parser.add_argument("--base-url", required=True, help="the judge's OpenAI-compatible root, /v1 included")
    parser.add_argument("--model", required=True, help="the judge's model name")
    parser.add_argument("--api-key-env", default=None, help="environment variable holding the judge's API key")
    parser.add_argument("--mode", choices=["rubric", "ranking"], default="rubric",
                        help="rubric: each episode alone; ranking: a task's episodes together (RULER-style)")
    parser.add_argument("--rubric", default=None, help="the rubric text, or @FILE to read it from a file")
    parser.add_argument("--no-position-bias", action="store_true", help="ranking: judge each group once (no shuffled re-judging)")
    parser.add_argument("--max-tokens", type=int, default=512, help="the judge's reply budget (default 512)")
    parser.add_argument("--concurrency", type=int, default=8, help="judge requests in flight (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="shuffles and the bootstrap (default 0)")
    parser.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from tracegym.config.rl import JudgeConfig
    from tracegym.data.store import read_trajectories_checked
    from tracegym.rl.judge import Judge, agreement, episode_raw
    from tracegym.types import TrajectoryGroup

    try:
        rubric = args.rubric
        if rubric is not None and rubric.startswith("@"):
            rubric = Path(rubric[1:]).read_text(encoding="utf-8").strip()
        cfg = JudgeConfig(base_url=args.base_url, model=args.model, api_key_env=args.api_key_env, mode=args.mode,
                          position_bias=not args.no_position_bias, max_tokens=args.max_tokens,
                          concurrency=args.concurrency, **({"rubric": rubric} if rubric else {}))
        episodes, bad = read_trajectories_checked(args.trajectories)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in bad:
        print(f"warning: skipped {line}", file=sys.stderr)
    episodes = [t for t in episodes if t.turns]  # failed episodes (env errors) have nothing to judge
    if not episodes:
        print(f"error: {args.trajectories}: no episode with turns to judge", file=sys.stderr)
        return 2
    by_task: dict[str, list] = {}
    for t in episodes:
        by_task.setdefault(t.task_id, []).append(t)
    groups = [TrajectoryGroup(env=ts[0].env, task_id=task, trajectories=tuple(ts)) for task, ts in by_task.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    judge = Judge(cfg, out / "judge_cache.jsonl")
    try:
        judged, stats = judge.score_groups(groups, seed=args.seed)
    finally:
        judge.close()
    kept = [(g, r) for g, r in zip(groups, judged) if r.scores is not None]
    from tracegym.files import atomic_write_text

    lines = []  # every episode, with its score (None in a group the judge could not score) and the raw replies
    for group, judgment in zip(groups, judged):
        for i, t in enumerate(group.trajectories):
            verdict = {"mode": cfg.mode, "score": judgment.scores[i] if judgment.scores is not None else None,
                       "raw": episode_raw(judgment, i, cfg.mode)}
            lines.append(t.model_copy(update={"info": {**t.info, "judge": verdict}}).model_dump_json())
    atomic_write_text(out / "judged.jsonl", "".join(line + "\n" for line in lines))
    summary = {"judge": {"model": cfg.model, "mode": cfg.mode, "position_bias_check": cfg.position_bias},
               "source": str(args.trajectories),
               "agreement": agreement([g for g, _ in kept], [r.scores for _, r in kept], seed=args.seed) if kept else None,
               **{key.split("/", 1)[1]: value for key, value in stats.metrics().items()}}
    atomic_write_text(out / "judge.json", json.dumps(summary, indent=2) + "\n")
    a = summary["agreement"] or {}
    ci = a.get("spearman_ci")
    scored = sum(len(g.trajectories) for g, _ in kept)
    print(f"judged {scored} of {len(episodes)} episodes ({stats.failed_groups} task groups not scored: "
          f"{stats.parse_failures} unparsed replies, {stats.errors} failed requests)")
    if a:
        print(f"agreement with the rewards: Spearman {a['spearman']:.3f}"
              + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
              + (f", within-task pairwise accuracy {a['pairwise_accuracy']:.3f} over {a['pairs']} pairs" if a["pairs"] else ""))
    bias = f", position bias {summary['position_bias']:.3f}" if "position_bias" in summary else ""
    print(f"cost: {stats.calls} requests ({stats.cache_hits} cached), {stats.tokens} tokens, {stats.seconds:.1f} s{bias}")
    print(f"wrote {out / 'judge.json'} and {out / 'judged.jsonl'}")
    return 0 if kept else 1
