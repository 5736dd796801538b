"""``tracegym renderers check`` and the renderer plugin point, in process.

- The conformance suite passes on the fixture of every shipped family (the real tokenizers and chat
  templates of tests/fetch_tokenizers.py, SmolLM2's own, ``hermes.jinja`` and ``smollm2.jinja``),
  with the renderer the folder gets by itself (DeepSeek-V3's template refuses its call turns under
  this transformers: those rows are SKIP, see tests/test_render_deepseek_v3.py).
- It fails, naming the first differing token as text, on a deliberately broken template and on
  renderers with a deliberate bug (continue_prompt, history_preserving, stop tokens).
- The example plugin renderer (examples/plugins/bracket_renderer.py, a made-up template) passes its
  own conformance run and works where the built-ins do: rollout, sft's data, rl, serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fetch_tokenizers import folder_for_test

from tracegym.cli import main
from tracegym.models import load_tokenizer
from tracegym.render import Gemma3Renderer, Qwen3Renderer, get_renderer, hermes_chat_template, renderer_name_for
from tracegym.render.chatml import smollm2_chat_template
from tracegym.render.conformance import CONVERSATIONS, run_conformance

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "plugins" / "bracket_renderer.py")


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["renderers", "check", *args])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("smollm2-135m")


def _saved(tokenizer, template: str, folder: Path) -> Path:
    previous = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        tokenizer.save_pretrained(str(folder))
    finally:
        tokenizer.chat_template = previous
    return folder


def _edit_template(folder: Path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in the folder's chat template (chat_template.jinja or tokenizer_config.json)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        assert old in jinja.read_text(encoding="utf-8")
        jinja.write_text(jinja.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
        return
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert old in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(old, new)
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.mark.parametrize("family,renderer", [("qwen3", "qwen3"), ("llama3", "llama3"), ("gemma3", "gemma3"),
                                             ("llama3_1", "llama3.1"), ("deepseek_v3", "deepseek_v3")])
def test_check_passes_on_every_fetched_family(capsys, family, renderer):
    code, out = _check(capsys, str(folder_for_test(family)))
    assert code == 0, out
    assert f"renderer {renderer!r}" in out and " 0 failed" in out and "FAIL" not in out
    assert out.count("golden ") >= len(CONVERSATIONS) and "stop_tokens" in out


@pytest.mark.parametrize("template,renderer", [("own", "smollm2"), ("smollm2.jinja", "smollm2"), ("hermes.jinja", "hermes")])
def test_check_passes_on_smollm2_tokenizer_folders(capsys, smollm2_tokenizer, tmp_path, template, renderer):
    source = {"own": smollm2_tokenizer.chat_template, "smollm2.jinja": smollm2_chat_template(),
              "hermes.jinja": hermes_chat_template()}[template]
    folder = _saved(smollm2_tokenizer, source, tmp_path / "model")
    code, out = _check(capsys, str(folder), "--renderer", renderer)
    assert code == 0 and " 0 failed" in out and "FAIL" not in out, out


def test_a_broken_template_fails_with_the_first_differing_token(capsys, tmp_path):
    folder = tmp_path / "broken_llama"
    shutil.copytree(folder_for_test("llama3"), folder)
    _edit_template(folder, "'<|eot_id|>'", "'<|eot_id|>\\n'")
    code, out = _check(capsys, str(folder), "--renderer", "llama3")
    assert code == 1
    golden = [line for line in out.splitlines() if line.startswith("golden ") and "FAIL" in line]
    assert len(golden) == len(CONVERSATIONS), out
    assert "renderer '<|start_header_id|>' vs template '\\n'" in golden[0], golden[0]


def test_renderer_bugs_are_caught():
    gemma = Gemma3Renderer(_fixture_tokenizer("gemma3"))

    class NoNewline(Gemma3Renderer):  # continue_prompt forgets the template's "\n" after a turn
        after_turn = ""

    class ClaimsHistory(Qwen3Renderer):  # says history is kept where Qwen3's template drops <think> blocks
        history_preserving = True

    class NoStops(Gemma3Renderer):
        stop_tokens = ("<eos>",)

    def failed(renderer):
        return {(r.check, r.case): r.detail for r in run_conformance(renderer) if r.status == "FAIL"}

    assert failed(gemma) == {}
    broken = failed(NoNewline(gemma.tokenizer))
    assert set(check for check, _ in broken) == {"continue"}
    assert "renderer '<start_of_turn>' vs template '\\n'" in broken[("continue", "chat")]
    claims = failed(ClaimsHistory(_fixture_tokenizer("qwen3")))
    assert ("extension", "chat") in claims and "'<think>'" in claims[("extension", "chat")]
    assert "'<end_of_turn>'" in failed(NoStops(gemma.tokenizer))[("stop_tokens", "-")]


def _fixture_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder_for_test(name)))


# --- the plugin point -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bracket_folder(smollm2_tokenizer, tmp_path_factory) -> Path:
    from tracegym.plugins import load_plugins

    (module,) = load_plugins([EXAMPLE])
    return _saved(smollm2_tokenizer, module.CHAT_TEMPLATE, tmp_path_factory.mktemp("bracket_model"))


def test_example_plugin_renderer_is_short_and_passes_its_conformance_run(capsys, bracket_folder):
    assert len(Path(EXAMPLE).read_text(encoding="utf-8").splitlines()) <= 80
    code, out = _check(capsys, str(bracket_folder), "--plugin", EXAMPLE, "--renderer", "bracket")
    assert code == 0 and "renderer 'bracket' (BracketRenderer)" in out and " 0 failed" in out, out


def test_example_plugin_renderer_fails_on_a_template_that_differs(capsys, bracket_folder, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(bracket_folder, folder)
    _edit_template(folder, "'result'", "'tool'")
    code, out = _check(capsys, str(folder), "--plugin", EXAMPLE, "--renderer", "bracket")
    row = next(line for line in out.splitlines() if line.startswith("golden ") and "tool_call " in line)
    assert code == 1 and "FAIL" in row and "'result'" in row and "'tool'" in row, out


def test_example_plugin_renderer_in_rollout_sft_rl_and_serve(bracket_folder, tmp_path, monkeypatch):
    # rollout: the scripted expert's turns through the plugin renderer, token in / token out
    out = tmp_path / "rollout"
    assert main(["rollout", "--plugin", EXAMPLE, "--renderer", "bracket", "--env", "calculator", "--policy", "expert",
                 "--model", "tiny-random", "--tasks", "2", "--no-progress", "--no-logprob-gap", "--out", str(out)]) == 0
    trajectory = json.loads((out / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()[0])
    renderer = get_renderer("bracket", load_tokenizer("tiny-random"))
    last = trajectory["turns"][-1]
    shown = renderer.tokenizer.decode(last["prompt_ids"] + last["completion_ids"])
    assert "<|im_start|>[result]\n" in shown and ">>> calculate " in shown and shown.endswith("<|im_end|>")

    # sft: its data path (the renderer of model.renderer builds the examples)
    from tracegym.config import SFTConfig
    from tracegym.recipes.sft import load_data

    cfg = SFTConfig(model={"name": "tiny-random", "renderer": "bracket"}, data={"train_files": [str(out / "trajectories.jsonl")]},
                    batch_size=1, micro_batch_size=1)
    _, examples, _ = load_data(cfg, get_renderer(cfg.model.renderer, renderer.tokenizer))
    assert examples and "[assistant]" in renderer.tokenizer.decode(examples[0].input_ids)

    # rl: the policy's renderer
    from tracegym.config import RLConfig
    from tracegym.rl.policy import make_renderer

    rl_cfg = RLConfig(model={"name": "tiny-random", "renderer": "bracket"}, env={"name": "calculator"})
    assert make_renderer(rl_cfg, renderer.tokenizer).name == "bracket"

    # serve: `tracegym serve --plugin FILE --renderer bracket` builds its app with the plugin's renderer
    import tracegym.engines
    import tracegym.models
    import tracegym.serve
    import tracegym.serve.launch as launch

    built = {}
    monkeypatch.setattr(tracegym.models, "load", lambda model, dtype="float32": (None, renderer.tokenizer))
    monkeypatch.setattr(tracegym.engines, "make_engine", lambda *args, **kwargs: "engine")
    monkeypatch.setattr(launch, "create_app", lambda engine, rend, model, **kwargs: built.setdefault("renderer", rend))
    monkeypatch.setattr(tracegym.serve, "serve", lambda model, host, port, renderer=None, **kwargs: launch.build_app(model, renderer=renderer))
    assert main(["serve", "tiny-random", "--plugin", EXAMPLE, "--renderer", "bracket"]) == 0
    assert type(built["renderer"]).__name__ == "BracketRenderer"


def test_a_saved_folder_naming_an_unregistered_renderer_says_so(tmp_path):
    (tmp_path / "tracegym.json").write_text(json.dumps({"renderer": "not_loaded_plugin"}))
    with pytest.raises(ValueError, match=r"tracegym.json: key 'renderer' names 'not_loaded_plugin'.*--plugin"):
        renderer_name_for(str(tmp_path))


def test_list_shows_the_families(capsys):
    assert main(["renderers"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"smollm2", "hermes", "qwen3", "llama3", "llama3.1", "gemma3", "deepseek_v3"} <= set(names)
