"""The HTML report: content and escaping, and a real render in headless Chromium.

The Chromium check loads a copy of the report with a probe script added at the top of <head>. The
probe records uncaught errors (window.onerror), Content-Security-Policy violations (the report's
own CSP forbids every external load, so any attempt to fetch a script, stylesheet, font or image
from outside fires one) and, after the load event, every <img> that failed to decode. It writes
its findings into the DOM, which ``--dump-dom`` prints: no parsing of Chromium's log format, which
changes between versions. A separate ``--screenshot`` run checks the page is not blank.

Chromium is Debian's ``chromium`` package; the test is skipped when it is missing, except under CI
(``CI`` set), where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tracegym.eval.evaluate import summarize, write_eval
from tracegym.eval.report import build_report, choose_metric_keys, sample_trajectories, token_view
from tracegym.types import Message, ToolCall, Trajectory, Turn

EVIL = "<script>alert('pwned')</script>"


def make_traj(task: str, index: int, success: bool, n_turns: int, note: str = "") -> Trajectory:
    messages = [Message(role="system", content="You are an agent."), Message(role="user", content=f"Solve {task} {note}")]
    turns = []
    prompt: tuple[int, ...] = (1, 2, 3, 4)
    for i in range(n_turns):
        completion = (10 + i, 11 + i, 99)
        call = ToolCall(name="calculate", arguments={"expression": f"{i} + 1"}, id=f"c{i}")
        msg = Message(role="assistant", content=f"step {i}", tool_calls=(call,))
        result = Message(role="tool", content="Error: division by zero" if i == 1 else str(i + 1), tool_call_id=f"c{i}",
                         name="calculate")
        turns.append(Turn(prompt_ids=prompt, completion_ids=completion, message=msg, env_messages=(result,),
                          parse_errors=("bad json: {" ,) if i == 2 else ()))
        messages += [msg, result]
        prompt = prompt + completion + (50, 51)  # the tool result and the next generation prompt
    return Trajectory(env="calculator", task_id=task, split="test", sample_index=index, messages=tuple(messages),
                      turns=tuple(turns), reward=float(success), success=success, policy="smollm2-135m",
                      end_reason="terminated" if success else "max_turns",
                      tools=({"type": "function", "function": {"name": "calculate", "parameters": {}}},),
                      info={"reference_calls": [{"name": "calculate", "arguments": {"expression": "0 + 1"}}]})


def build_run_dir(root: Path) -> Path:
    """A run dir like ``runs/demo``: config, training metrics, two evaluations with trajectories."""
    run = root / "demo"
    run.mkdir()
    (run / "config.yaml").write_text(f"model: smollm2-135m\nenv: calculator\nnote: \"{EVIL}\"\nlr: 0.0002\n")
    rng = np.random.default_rng(0)
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(30):
            row = {"step": step, "time": 1700000000 + step, "reward_mean": float(min(1, step / 30 + rng.random() * 0.1)),
                   "loss": float(2.0 * np.exp(-step / 10)), "kl": float(step * 1e-3), "entropy": float(1.5 - step * 0.02),
                   "note": "text values are ignored"}
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 30, "loss": 0.1')  # a torn last line, as after a crash
    for name, p_success in (("base", 0.2), ("rl", 0.7)):
        trajs = [
            make_traj(f"task-{t}", i, bool(rng.random() < p_success), int(rng.integers(1, 4)), note=EVIL if t == 0 else "")
            for t in range(6)
            for i in range(4)
        ]
        summary = summarize(trajs, ks=[1, 2, 4], turns=[1, 2, 3], env="calculator", model=name, split="test", n_bootstrap=200)
        write_eval(run / name, summary, trajs)
    return run


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """One run dir shared by the tests that only read it (building it draws 6 plots)."""
    return build_run_dir(tmp_path_factory.mktemp("runs"))


def fake_decode(ids) -> str:
    return "".join("<|im_end|>\n" if i == 99 else f"t{i} " for i in ids)


def test_report_content_and_escaping(demo_run: Path) -> None:
    run = demo_run
    path = build_report(run, decode=fake_decode, max_trajectories=5)
    assert path == run / "report.html"
    html = path.read_text()
    # no raw user text reaches the page: the config and a user message carry a script tag
    assert EVIL not in html and "&lt;script&gt;alert(" in html
    assert "<script" not in html.lower()
    # nothing external: every src/href is a data URI or an in-page anchor
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith(("data:image/png;base64,", "#")), ref
    assert not re.search(r"https?://", html)
    # the sections are there: both evaluations in the table, the training curves, a trajectory sample
    assert html.count('<tr><td>base</td>') == 1 and html.count('<tr><td>rl</td>') == 1
    assert "reward_mean" in html and "1 unreadable lines skipped" in html
    assert html.count('<details class="trajectory">') == 10  # 5 per trajectory file
    assert "Error: division by zero" in html and "bad json: {" in html
    assert 'class="tok gen"' in html and 'class="tok ctx"' in html
    assert html.count("data:image/png;base64,") == 1 + 2 * 2 + 1  # overlay, 2 plots per eval, training
    assert not list(run.glob(".*tmp"))


def test_report_without_decoder_and_empty_dir(tmp_path: Path, demo_run: Path) -> None:
    html = build_report(demo_run, out=tmp_path / "plain.html").read_text()
    assert 'class="tok gen"' not in html and "No tokenizer given" in html
    empty = tmp_path / "empty"
    empty.mkdir()
    html = build_report(empty).read_text()
    assert "No eval.json found" in html and "No metrics.jsonl found" in html and "No trajectory files" in html
    with pytest.raises(FileNotFoundError):
        build_report(tmp_path / "missing")


def test_report_survives_a_broken_eval_json(tmp_path: Path, demo_run: Path) -> None:
    run = tmp_path / "demo"
    shutil.copytree(demo_run, run)
    (run / "sft").mkdir()
    (run / "sft" / "eval.json").write_text("{not json")
    html = build_report(run).read_text()
    assert "sft/eval.json" in html and "is not valid JSON" in html
    assert "<tr><td>rl</td>" in html  # the good evaluations still render


def test_token_view_marks_trained_tokens_and_rewrites() -> None:
    traj = make_traj("x", 0, True, 3)
    markup, stats = token_view(traj, fake_decode)
    # turn 0: prompt 4 tokens; later turns add 2 context tokens each; 3 sampled tokens per turn
    assert stats == {"trained": 9, "context": 4 + 2 + 2, "rewrites": 0, "hidden": 0}
    assert str(markup).count('class="tok gen"') == 9
    assert "&lt;|im_end|&gt;" in str(markup)  # token text is escaped
    # a turn whose prompt does not extend the previous sequence is shown whole, after a marker
    broken = traj.model_copy(update={"turns": (traj.turns[0], traj.turns[1].model_copy(update={"prompt_ids": (7, 7)}))})
    _, stats = token_view(broken, fake_decode)
    assert stats["rewrites"] == 1 and stats["context"] == 4 + 2
    _, stats = token_view(traj, fake_decode, max_tokens=5)
    assert stats["hidden"] == 4 + 9 + 4 - 5


def test_sampling_and_metric_keys() -> None:
    trajs = [make_traj("t", i, i in (5, 7), 1) for i in range(8)]
    picked = sample_trajectories(trajs, 4)
    assert [t.sample_index for t in picked] == [5, 0, 7, 1]
    rows = [{"step": i, "time": i, "grad_norm": 1.0, "kl": 0.1, "foo": 2, "reward_mean": 0.5, "s": "x"} for i in range(3)]
    assert choose_metric_keys(rows) == ["reward_mean", "kl", "grad_norm", "foo"]


# --- RL health ----------------------------------------------------------------------------------------


def write_rl_run(root: Path, name: str, health: bool, config: str | None) -> Path:
    """A run dir whose metrics.jsonl has the RL loop's usual keys, plus health signals if asked."""
    run = root / name
    run.mkdir()
    if config is not None:
        (run / "config.yaml").write_text(config)
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            row = {"step": step, "reward/mean": 0.1 * step, "train/loss": 1.0 / step, "train/entropy": 1.0 - 0.1 * step}
            if health:
                row.update({"health/reward_std": 0.5 - 0.1 * step, "health/informative_groups": float(6 - step),
                            "health/mi": 0.4 / step, "drift/kl": 0.001 * step})
            f.write(json.dumps(row) + "\n")
    return run


def health_table(html: str) -> list[list[str]]:
    """The cells of the RL health table, row by row (header included)."""
    table = re.search(r'<table class="health-values">(.*?)</table>', html, re.S).group(1)
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)]


def test_report_plots_rl_health_when_logged(tmp_path: Path) -> None:
    run = write_rl_run(tmp_path, "rl", health=True, config="health:\n  min_reward_std: 0.1\n  min_mutual_information: null\n"
                                                          "drift:\n  max_policy_drift: 0.004\n")
    html = build_report(run).read_text()
    assert '<h2 id="health">RL health</h2>' in html and '<a href="#health">' in html
    assert html.count("data:image/png;base64,") == 2  # training curves + the health figure
    # one row per logged signal, the keys it was found under, the last step's value and the config's
    # thresholds (MI's is None: no line); no probe NLL was logged, so no panel for it
    assert health_table(html) == [
        ["signal", "metric", "last", "threshold"],
        ["reward std within groups", "health/reward_std", "0", "min_reward_std 0.1"],
        ["groups with signal", "health/informative_groups", "1", "–"],
        ["entropy", "train/entropy", "0.5", "–"],
        ["policy drift KL", "drift/kl", "0.005", "max_policy_drift 0.004"],
        ["MI(prompt; response)", "health/mi", "0.08", "–"],
    ]
    # an RL run without health signals (train/entropy alone is not one) has no such section
    plain = build_report(write_rl_run(tmp_path, "plain", health=False, config=None)).read_text()
    assert 'id="health"' not in plain and "RL health" not in plain
    assert plain.count("data:image/png;base64,") == 1


def test_health_thresholds_and_figure_lines() -> None:
    from tracegym.eval.plots import health_figure
    from tracegym.eval.report import health_thresholds

    # no health section: HealthConfig's defaults, said to be defaults
    assert health_thresholds({"model": {"name": "x"}}) == {"health/reward_std": (0.05, "default min_reward_std 0.05"),
                                                            "health/mi": (0.05, "default min_mutual_information 0.05")}
    assert health_thresholds({"health": {"min_reward_std": 0.2, "min_mutual_information": None},
                              "policy": {"max_policy_drift": 0.01}}) == {
        "health/reward_std": (0.2, "min_reward_std 0.2"), "health/drift_kl": (0.01, "max_policy_drift 0.01"),
        "drift/kl": (0.01, "max_policy_drift 0.01")}
    rows = [{"step": s, "health/reward_std": 0.3 / s} for s in (1, 2, 3)]
    fig = health_figure(rows, [{"title": "reward std", "key": "health/reward_std", "threshold": 0.1,
                                "threshold_label": "min_reward_std 0.1"}], x_key="step")
    curve, line = fig.axes[0].lines
    assert list(curve.get_xdata()) == [1.0, 2.0, 3.0] and list(curve.get_ydata()) == pytest.approx([0.3, 0.15, 0.1])
    assert list(line.get_ydata()) == [0.1, 0.1] and line.get_linestyle() == "--"
    assert line.get_label() == "min_reward_std 0.1"
    assert len(health_figure(rows, [{"title": "t", "key": "health/reward_std"}]).axes[0].lines) == 1  # no threshold
    with pytest.raises(ValueError, match="at least one panel"):
        health_figure(rows, [])


# --- headless Chromium ----------------------------------------------------------------------------

PROBE = """<script>
window.__problems = [];
window.addEventListener('error', function (e) { window.__problems.push('error: ' + e.message); });
document.addEventListener('securitypolicyviolation', function (e) {
  window.__problems.push('csp: ' + e.violatedDirective + ' ' + e.blockedURI); });
window.addEventListener('load', function () {
  var imgs = document.images, broken = 0;
  for (var i = 0; i < imgs.length; i++) { if (!imgs[i].complete || imgs[i].naturalWidth === 0) broken++; }
  var out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({images: imgs.length, broken: broken, problems: window.__problems,
                                    details: document.querySelectorAll('details').length});
  document.body.appendChild(out);
});
</script>"""


def find_chromium() -> str | None:
    for name in (os.environ.get("TRACEGYM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def run_chromium(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
    ]
    return subprocess.run([chromium, *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; the CI script must install Debian's 'chromium' package")
        pytest.skip("chromium not installed (apt-get install chromium); required under CI")
    return found


def test_report_renders_in_chromium(tmp_path: Path, demo_run: Path, chromium: str) -> None:
    report = build_report(demo_run, decode=fake_decode, max_trajectories=3, out=tmp_path / "report.html")
    html = report.read_text()
    # The report's CSP forbids scripts; the probe copy allows inline scripts and nothing else, so
    # CSP violations still report any external load.
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
    assert csp in html
    probed = html.replace(csp, csp + "; script-src 'unsafe-inline'").replace("<head>", "<head>" + PROBE, 1)
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(probed)

    result = run_chromium(chromium, tmp_path / "profile-dom", "--dump-dom", probe_page.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    match = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert match, f"the probe did not run; stderr: {result.stderr[-2000:]}"
    probe = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert probe["problems"] == [], probe
    assert probe["images"] == 6 and probe["broken"] == 0, probe
    assert probe["details"] >= 6 + 2 + 1
    assert "Uncaught" not in result.stderr
    # the rendered DOM has the table text
    assert re.search(r"<td>rl</td><td>calculator</td><td>rl</td><td>test</td><td[^>]*>6 × 4</td>", dom), dom[:3000]

    shot = tmp_path / "report.png"
    result = run_chromium(chromium, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,1600",
                          "--hide-scrollbars", report.as_uri())
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]  # (H, W, 3) floats in [0, 1]
    assert pixels.shape[:2] == (1600, 1280)
    # not blank: many distinct colours (plots, badges, text) and real contrast
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 200
    assert pixels.std() > 0.05
    keep = os.environ.get("TRACEGYM_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


# --- commands -------------------------------------------------------------------------------------


def test_compare_command(tmp_path: Path, demo_run: Path, capsys) -> None:
    from tracegym.cli import main
    from tracegym.commands.compare import compare

    run = demo_run
    out = tmp_path / "cmp"
    assert main(["compare", str(run / "base"), str(run / "rl" / "eval.json"), "--labels", "b,r", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "b" in printed and "Δpass@1" in printed
    saved = json.loads((out / "compare.json").read_text())
    assert saved["turns"] == 3 and saved["k"] == 4 and saved["labels"] == ["b", "r"]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"

    # the paired difference agrees with the two pass@1 values on the same tasks
    result = compare([str(run / "base"), str(run / "rl")], turns=2, k=2)
    base, rl = result["summaries"]
    expected = rl["pass_at"]["2"]["1"] - base["pass_at"]["2"]["1"]
    assert result["rows"][1]["Δpass@1"].startswith(f"{expected:+.3f}")
    assert result["rows"][0]["pass@k"].startswith("k=2: ")

    assert main(["compare", str(run / "base"), str(run / "rl"), "--labels", "only-one"]) == 2
    assert main(["compare", str(run / "base"), str(run / "rl"), "--turns", "9"]) == 2
    assert main(["compare", str(run / "base"), str(tmp_path / "nowhere")]) == 2
    assert "error:" in capsys.readouterr().err


def test_report_command(tmp_path: Path, demo_run: Path, capsys) -> None:
    from tracegym.cli import main

    run = tmp_path / "demo"
    shutil.copytree(demo_run, run)
    assert main(["report", str(run), "--tokenizer", "none", "--max-trajectories", "2"]) == 0
    html = (run / "report.html").read_text()
    assert html.count('<details class="trajectory">') == 4
    # a tokenizer that cannot load leaves a warning and a report without the token view
    assert main(["report", str(run), "--tokenizer", str(tmp_path / "no-such-tokenizer")]) == 0
    assert "warning: tokenizer" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
