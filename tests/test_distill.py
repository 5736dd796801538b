"""On-policy distillation (``tracegym distill``) on the tiny random model.

A teacher equal to the student gives advantages of exactly 0 and leaves every weight where it was; a
different teacher gives ``A_t = -(log pi_student - log pi_teacher)`` on sampled tokens (checked by
hand against unpadded forward passes) and 0 elsewhere; a few CLI steps lower the exact reverse KL
to a teacher (the student plus a random LoRA perturbation) on a fixed batch, with the per-token
policy gradient and with GKD's JSD; the JSD matches hand values and autograd of the direct formula;
a teacher with another tokenizer is refused in one line; resume equals a straight run; config
mistakes are named.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tracegym.config import ConfigError, DistillConfig, load_config
from tracegym.recipes import distill as distill_recipe
from tracegym.recipes.distill import (
    check_same_tokenizer,
    distill_advantages,
    generalized_jsd,
    token_generalized_jsd,
    tokenizer_mismatch,
    train_distill,
)
from tracegym.train.checkpoint import list_checkpoints
from tracegym.train.logging import read_metrics

NON_DETERMINISTIC = ("time", "rss_mb", "rollout/tokens_per_s", "train/tokens_per_s")


def _data(out: Path, teacher: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {"name": "tiny-random"},
        "lora": {"enabled": True, "r": 8},
        "optim": {"lr": 1e-2},
        "teacher": teacher,
        "env": {"name": "calculator", "options": {"num_calls": 1}},
        "tasks": {"train": 8, "test": 2, "seed": 0},
        "tasks_per_step": 2,
        "group_size": 4,
        "rollout": {"max_turns": 1, "max_tokens_per_turn": 8, "concurrency": 8},
        "micro_batch_size": 4,
        "steps": 2,
        "eval": {"every": 0, "at_start": False},
        "output_dir": str(out),
        "logging": {"progress": False, "tensorboard": False},
    }


def _config(out: Path, *overrides: str, teacher: dict[str, Any] | None = None) -> DistillConfig:
    return load_config(DistillConfig, data=_data(out, teacher or {"model": "tiny-random"}), overrides=list(overrides))


@pytest.fixture(scope="module")
def perturbed_teacher(tmp_path_factory) -> Path:
    """A LoRA adapter folder on tiny-random with seeded random A and B (scale 0.3): the teacher is
    the student's own base plus a perturbation a rank-8 student adapter can represent."""
    import peft

    from tracegym.models import load

    model, _ = load("tiny-random")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    folder = tmp_path_factory.mktemp("teacher") / "adapter"
    wrapped.save_pretrained(str(folder))
    return folder


def _pieces(cfg: DistillConfig, teacher: torch.nn.Module, student_logprobs: str) -> dict[str, Any]:
    """One step's pieces as ``train_distill`` calls them: sample, build the batch, score with the teacher."""
    from tracegym.batch import examples_from_groups, make_batch
    from tracegym.envs import make
    from tracegym.rl.collect import collect_groups
    from tracegym.rl.policy import load_policy, make_sampler
    from tracegym.rl.tasks import tasks_at
    from tracegym.render import get_renderer

    loss_cfg = distill_recipe.policy_loss_config(cfg)
    torch.manual_seed(cfg.seed)
    model, tokenizer, _ = load_policy(cfg, loss_cfg, torch.device("cpu"))  # type: ignore[arg-type]
    renderer = get_renderer("tiny-random", tokenizer)
    sampler = make_sampler(cfg, model, tokenizer, renderer)  # type: ignore[arg-type]
    tasks = tasks_at(make("calculator", num_calls=1).tasks("train", cfg.tasks.train), cfg.seed, 0, cfg.tasks_per_step)
    groups, _ = collect_groups(sampler, cfg, tasks, renderer, seed=0)  # type: ignore[arg-type]
    data = examples_from_groups(groups, renderer)
    batch = make_batch(data.examples, pad_token_id=tokenizer.pad_token_id)
    scored, metrics = distill_recipe.score_with_teacher(
        model, teacher, batch, loss_cfg, micro_batch_size=cfg.micro_batch_size, temperature=1.0,
        student_logprobs=student_logprobs, advantage_clip=cfg.advantage_clip)
    return {"model": model, "batch": scored, "metrics": metrics, "examples": data.examples, "loss_cfg": loss_cfg}


def _hand_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """``log p(ids[t+1] | ids[:t+1])`` for every t, from one unpadded forward pass (no batching)."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)]


# --- advantages ------------------------------------------------------------------------------------


def test_teacher_equal_to_student_gives_zero_advantages_and_leaves_the_weights(tmp_path):
    from tracegym.models import load
    from tracegym.train.optim import build_optimizer, build_scheduler
    from tracegym.train.policy_update import policy_update

    cfg = _config(tmp_path / "run", "lora.enabled=false", "optim.lr=0.1")
    teacher = load("tiny-random")[0].requires_grad_(False)  # the same weights as the student
    step = _pieces(cfg, teacher, "trainer")
    batch, model = step["batch"], step["model"]
    assert batch.loss_mask.sum() > 10
    assert torch.equal(batch.advantages, torch.zeros_like(batch.advantages))  # exactly, not approximately
    assert step["metrics"]["distill/reverse_kl"] == 0.0
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg.optim)
    metrics = policy_update(model, batch, step["loss_cfg"], optimizer, build_scheduler(optimizer, cfg.optim, 1), epochs=1,
                            micro_batch_size=cfg.micro_batch_size, temperature=1.0, max_grad_norm=1.0)
    assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0
    moved = [name for name, p in model.named_parameters() if not torch.equal(before[name], p.detach())]
    assert not moved, moved


@pytest.mark.parametrize("student_logprobs", ["sampler", "trainer"])
def test_other_teacher_gives_minus_log_ratio_on_sampled_tokens_and_zero_elsewhere(tmp_path, student_logprobs):
    from tracegym.models import load

    teacher = load("tiny-random", seed=1)[0].requires_grad_(False)  # other random weights, same tokenizer
    step = _pieces(_config(tmp_path / "run"), teacher, student_logprobs)
    batch, model = step["batch"], step["model"]
    checked = 0
    for row, example in enumerate(step["examples"]):
        teacher_logp = _hand_logprobs(teacher, list(example.input_ids))
        # the student's log-probs: the engine's, recorded while sampling (token-aligned in the example),
        # or an unpadded forward pass of the student (its LoRA B is 0 before any update)
        student_logp = (list(example.logprobs[1:]) if student_logprobs == "sampler"
                        else _hand_logprobs(model, list(example.input_ids)))
        for t in range(len(example.input_ids) - 1):
            value = float(batch.advantages[row, t])
            if example.loss_mask[t + 1]:
                assert value == pytest.approx(-(student_logp[t] - teacher_logp[t]), abs=2e-5), (row, t)
                checked += 1
            else:
                assert value == 0.0, (row, t)
        assert not batch.advantages[row, len(example.input_ids) - 1:].any()  # padding
    assert checked == int(batch.loss_mask.sum()) > 10
    mask = batch.loss_mask.bool()
    assert batch.advantages[mask].abs().mean() > 1e-2  # a real signal, not rounding noise
    kl = step["metrics"]["distill/reverse_kl"]
    assert kl == pytest.approx(float(-batch.advantages[mask].mean()), abs=1e-6)


def test_advantage_clip_bounds_every_token():
    student = torch.tensor([[-1.0, -9.0, -2.0, -3.0]])
    teacher = torch.tensor([[-2.0, -1.0, -2.5, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert distill_advantages(student, teacher, mask).tolist() == [[-1.0, 8.0, -0.5, 0.0]]
    assert distill_advantages(student, teacher, mask, clip=0.75).tolist() == [[-0.75, 0.75, -0.5, 0.0]]


# --- GKD's generalized JSD -------------------------------------------------------------------------

S = torch.tensor([0.5, 0.3, 0.2])
T = torch.tensor([0.2, 0.2, 0.6])


@pytest.mark.parametrize(
    "beta, expected",
    [
        # M = (S + T) / 2 = (0.35, 0.25, 0.4)
        # KL(T||M) = 0.2 ln(0.2/0.35) + 0.2 ln(0.2/0.25) + 0.6 ln(0.6/0.4) = 0.086727
        # KL(S||M) = 0.5 ln(0.5/0.35) + 0.3 ln(0.3/0.25) + 0.2 ln(0.2/0.4) = 0.094405
        (0.5, 0.5 * 0.086727 + 0.5 * 0.094405),
        # the end points: forward KL(T||S) = 0.2 ln(0.2/0.5) + 0.2 ln(0.2/0.3) + 0.6 ln(0.6/0.2) = 0.394816
        (0.0, 0.394816),
        # reverse KL(S||T) = 0.5 ln(0.5/0.2) + 0.3 ln(0.3/0.2) + 0.2 ln(0.2/0.6) = 0.360062
        (1.0, 0.360062),
    ],
)
def test_generalized_jsd_hand_values(beta, expected):
    value = generalized_jsd(S.log()[None], T.log()[None], beta)  # logits: log-probabilities up to a constant
    assert float(value[0]) == pytest.approx(expected, abs=1e-5)
    shifted = generalized_jsd(S.log()[None] + 3.0, T.log()[None] - 1.0, beta)  # softmax ignores a shift
    assert float(shifted[0]) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_gradient_matches_autograd_of_the_direct_formula(beta):
    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(2, 5, 7, generator=generator) * 2).requires_grad_(True)
    teacher = torch.randn(2, 5, 7, generator=generator) * 2
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    weights = torch.randn(2, 5, generator=generator)  # an arbitrary upstream gradient

    chunked = generalized_jsd(student, teacher, beta, mask=mask, chunk_rows=2)  # several chunks
    (grad,) = torch.autograd.grad((chunked * weights).sum(), student)

    s, t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    if beta == 0.0:
        direct = (t.exp() * (t - s)).sum(-1)
    elif beta == 1.0:
        direct = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
        direct = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    direct = torch.where(mask, direct, torch.zeros_like(direct))
    (expected_grad,) = torch.autograd.grad((direct * weights).sum(), student)
    assert torch.allclose(chunked, direct, atol=1e-6)
    assert torch.allclose(grad, expected_grad, atol=1e-6)
    assert not grad[~mask].any()  # unmasked positions get no gradient
    assert generalized_jsd(student, student.detach(), beta, mask=mask).abs().max() < 1e-6  # S == T: 0


def test_token_jsd_is_target_aligned_like_the_batch(tiny_model):
    """Column t of the per-token JSD compares the distributions at position t (which predicts token
    t + 1), on loss-mask columns only, whatever the micro-batch's first trained column."""
    from tracegym.batch import make_batch
    from tracegym.models import load
    from tracegym.types import TrainingExample

    student = tiny_model[0]
    teacher = load("tiny-random", seed=1)[0]
    rows = [list(range(100, 112)), list(range(200, 207))]
    masks = [[0] * 5 + [1] * 7, [0] * 4 + [1] * 3]
    examples = [TrainingExample(input_ids=ids, loss_mask=m, weights=[1.0] * len(ids), advantages=[0.0] * len(ids),
                                logprobs=[0.0] * len(ids), source=f"e/t{i}/0") for i, (ids, m) in enumerate(zip(rows, masks))]
    batch = make_batch(examples, pad_token_id=0)
    assert batch.first_loss_column == 3
    with torch.no_grad():
        values = token_generalized_jsd(student, teacher, batch, beta=0.5)
    assert values.shape == batch.loss_mask.shape
    for row, ids in enumerate(rows):
        with torch.no_grad():
            s = torch.log_softmax(student(input_ids=torch.tensor([ids])).logits[0], -1)
            t = torch.log_softmax(teacher(input_ids=torch.tensor([ids])).logits[0], -1)
        m = torch.log(0.5 * s.exp() + 0.5 * t.exp())
        direct = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)  # [L] per position
        for column in range(batch.loss_mask.shape[1]):
            expected = float(direct[column]) if batch.loss_mask[row, column] else 0.0
            assert float(values[row, column]) == pytest.approx(expected, abs=1e-6), (row, column)


# --- the command -----------------------------------------------------------------------------------


def _exact_reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor) -> float:
    """Mean over positions of the full-vocabulary KL(student || teacher): no sampling noise."""
    with torch.no_grad():
        s = torch.log_softmax(student(input_ids=ids).logits.float(), -1)
        t = torch.log_softmax(teacher(input_ids=ids).logits.float(), -1)
    return float((s.exp() * (s - t)).sum(-1).mean())


def _write_config(tmp_path: Path, teacher: str, out: Path) -> Path:
    config = tmp_path / "distill.yaml"
    config.write_text(
        "model: {name: tiny-random}\nlora: {r: 8}\noptim: {lr: 0.01}\n"
        f"teacher: {teacher}\n"
        "env: {name: calculator, options: {num_calls: 1}}\ntasks: {train: 8, test: 2}\n"
        "tasks_per_step: 2\ngroup_size: 4\nrollout: {max_turns: 1, max_tokens_per_turn: 8, concurrency: 8}\n"
        "eval: {every: 0, at_start: true}\n"
        f"output_dir: '{out}'\nlogging: {{progress: false, tensorboard: false}}\n"
    )
    return config


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("optim.lr=0.03", "steps=10"), id="policy_gradient"),
        pytest.param(("loss=jsd", "steps=6"), id="jsd"),
    ],
)
def test_cli_distill_lowers_the_reverse_kl_to_the_teacher(tmp_path, capsys, perturbed_teacher, options):
    from tracegym.cli import main
    from tracegym.models import load
    from tracegym.recipes.distill import load_teacher

    out = tmp_path / "run"
    config = _write_config(tmp_path, f"{{model: tiny-random, adapter: '{perturbed_teacher}'}}", out)
    assert main(["distill", "--config", str(config), *options]) == 0
    assert "distill done:" in capsys.readouterr().out
    rows = read_metrics(out)
    steps = int(options[-1].split("=")[1])
    assert [r["step"] for r in rows] == list(range(steps + 1))
    assert "eval/pass@1" in rows[0] and "eval/pass@1" in rows[-1]  # at the start and at the end
    for row in rows[1:]:
        for key in ("distill/reverse_kl", "distill/teacher_logprob", "distill/student_logprob", "reward/mean",
                    "train/loss", "train/grad_norm", "examples/count"):
            assert key in row and math.isfinite(row[key]), key
        assert row["train/grad_norm"] > 0
        if "loss=jsd" in options:
            assert row["train/jsd"] > 0
        else:
            assert "train/tis_weight_mean" in row  # the importance weight to the sampler (tis_cap 2.0)

    teacher = load_teacher(load_config(DistillConfig, config).teacher, "float32", torch.device("cpu"))[0]
    ids = torch.randint(0, 49152, (4, 24), generator=torch.Generator().manual_seed(0))  # a fixed batch
    before = _exact_reverse_kl(load("tiny-random")[0], teacher, ids)
    after = _exact_reverse_kl(load(str(out / "final"))[0], teacher, ids)
    assert before > 0.01 and after < 0.85 * before, (before, after)


def test_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, capsys):
    from tracegym.cli import main
    from tracegym.models import load

    model, tokenizer = load("tiny-random")
    tokenizer.add_tokens(["<extra_token>"])  # one more id: every later id would be off
    model.resize_token_embeddings(len(tokenizer))
    folder = tmp_path / "other_teacher"
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    out = tmp_path / "run"
    config = _write_config(tmp_path, f"{{model: '{folder}'}}", out)
    capsys.readouterr()  # the save's progress bars
    assert main(["distill", "--config", str(config), "steps=1"]) == 1
    err = capsys.readouterr().err
    # one error line (transformers may draw a loading progress bar before it), no traceback
    (line,) = [text for text in err.splitlines() if "error" in text.lower()]
    assert "Traceback" not in err and line == err.strip().splitlines()[-1], err
    assert line.startswith("error: teacher") and "does not share the student's tokenizer" in line and "49153" in line, err
    assert not list_checkpoints(out) and not (out / "metrics.jsonl").exists()


class _FakeTokenizer:
    def __init__(self, ids: dict[str, int], size: int = 10):
        self.ids, self.size, self.all_special_tokens = ids, size, ["<|im_start|>", "<|im_end|>"]

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.ids[token]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ids.get(text[:12], 7), len(text)]


def test_tokenizer_mismatch_names_what_differs(tokenizer):
    import copy

    same = {"<|im_start|>": 1, "<|im_end|>": 2}
    assert tokenizer_mismatch(_FakeTokenizer(same), _FakeTokenizer(dict(same))) is None
    swapped = _FakeTokenizer({"<|im_start|>": 2, "<|im_end|>": 1})
    assert "'<|im_start|>' has id 1 for the student but 2" in tokenizer_mismatch(_FakeTokenizer(same), swapped)
    probe = _FakeTokenizer({**same, "Hello world!": 3})  # same size and special ids, a probe differs
    assert "tokenizes differently" in tokenizer_mismatch(_FakeTokenizer(same), probe)
    assert "vocabulary sizes differ (10 vs 11)" in tokenizer_mismatch(_FakeTokenizer(same), _FakeTokenizer(same, 11))
    check_same_tokenizer(tokenizer, copy.deepcopy(tokenizer), "tiny-random")  # the real one agrees with itself
    with pytest.raises(ValueError, match="does not share the student's tokenizer"):
        check_same_tokenizer(_FakeTokenizer(same), swapped, "t")


def _final_tensors(final_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(final_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    assert tensors
    return tensors


def _reproducible(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in NON_DETERMINISTIC and not k.startswith("time/")} for r in rows]


def test_resume_matches_straight_run_exactly(tmp_path, perturbed_teacher):
    teacher = {"model": "tiny-random", "adapter": str(perturbed_teacher)}
    common = ("steps=4", "optim.warmup_steps=2", "optim.schedule=cosine", "eval.every=2", "tasks.train=3")
    straight = train_distill(_config(tmp_path / "a", *common, teacher=teacher))

    cfg = _config(tmp_path / "b", *common, "checkpoint.every=2", teacher=teacher)
    interrupted = train_distill(cfg, stop_at_step=3)  # "killed" after step 3: the last checkpoint is step 2
    assert interrupted.final_dir is None and [s for s, _ in list_checkpoints(cfg.output_dir)] == [2]
    resumed = train_distill(cfg, resume=True)
    assert resumed.step == 4 and [r["step"] for r in resumed.history] == [3, 4]

    a, b = _reproducible(read_metrics(straight.run_dir)), _reproducible(read_metrics(resumed.run_dir))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b  # every step once, identical numbers (KL, losses, TIS weights, grad norms, eval)
    assert len({r["distill/reverse_kl"] for r in a[1:]}) > 1
    fa, fb = _final_tensors(straight.final_dir), _final_tensors(resumed.final_dir)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert torch.equal(fa[key], fb[key]), key
    with pytest.raises(FileExistsError, match="--resume"):
        train_distill(cfg)


@pytest.mark.parametrize(
    "override, named, nearest",
    [
        ("teacher.modle=x", "teacher.modle", "teacher.model"),
        ("jsd_bta=0.1", "jsd_bta", "jsd_beta"),
        ("rollout.max_turn=2", "rollout.max_turn", "rollout.max_turns"),
    ],
)
def test_bad_config_key_exits_2_naming_the_nearest_key(tmp_path, capsys, override, named, nearest):
    from tracegym.cli import main

    config = tmp_path / "distill.yaml"
    config.write_text(f"model: {{name: tiny-random}}\noutput_dir: '{tmp_path / 'run'}'\n")
    assert main(["distill", "--config", str(config), override]) == 2
    err = capsys.readouterr().err
    assert f"unknown key '{named}'" in err and f"did you mean '{nearest}'?" in err, err
    assert not (tmp_path / "run").exists()  # rejected before anything is written


def test_bad_values_are_named(tmp_path, capsys):
    from tracegym.cli import main

    with pytest.raises(ConfigError) as info:
        load_config(DistillConfig, data={"loss": "kl", "jsd_beta": 2})
    text = str(info.value)
    assert "'loss'" in text and "'jsd'" in text and "'jsd_beta'" in text
    with pytest.raises(ConfigError, match="rollout.strategy must be 'chains'"):
        load_config(DistillConfig, data={"rollout": {"strategy": "tree"}})
    with pytest.raises(ConfigError, match="rollout.temperature must be > 0"):
        load_config(DistillConfig, data={"rollout": {"temperature": 0}})
    config = tmp_path / "distill.yaml"
    config.write_text("model: {name: tiny-random}\nenv: {name: calculatr}\n")
    assert main(["distill", "--config", str(config)]) == 2
    assert "'env.name'" in capsys.readouterr().err
