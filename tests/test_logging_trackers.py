"""Experiment trackers (``logging.backends``): the config and its old keys, missing packages, a
tracker that fails or hangs mid-run, secrets, and MLflow and W&B read back with their own readers
(``MlflowClient``; W&B's offline run file parsed into wandb's own protobuf records)."""

from __future__ import annotations

import errno
import json
import importlib.util
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tracegym.config import ConfigError, LoggingConfig, SFTConfig, dump_config, load_config
from tracegym.train import tracking
from tracegym.train.logging import MetricsLogger, read_metrics
from tracegym.train.tracking import GuardedTracker, MissingTrackerPackage, Tracker, flatten_params, redact, redact_text
from tracegym.train.tracking_mlflow import mlflow_key, mlflow_requirements
from tracegym.train.tracking_wandb import wandb_mode

HAS_MLFLOW = all(importlib.util.find_spec(m) is not None for m in ("mlflow", "sqlalchemy", "alembic"))
HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_mlflow = pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow-skinny, sqlalchemy and alembic are not installed "
                                  "(make install, or pip install 'tracegym[mlflow]')")
needs_wandb = pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (make install, or pip install 'tracegym[wandb]')")

SECRET = "sk-test-0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_tracker_env(monkeypatch, tmp_path):
    """No real key, URI or W&B home of the machine reaches a test; W&B writes its caches in tmp_path."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


# --- the config --------------------------------------------------------------------------------------


def test_old_logging_keys_edit_the_backends_list(tmp_path):
    assert LoggingConfig().backends == ["tensorboard"]
    assert LoggingConfig(tensorboard=False).backends == []
    old = LoggingConfig(wandb=True, wandb_project="p")
    assert old.backends == ["tensorboard", "wandb"] and old.wandb.project == "p"
    assert LoggingConfig(backends=["mlflow", "wandb"], wandb=False).backends == ["mlflow"]
    cfg = load_config(SFTConfig, data={"logging": {"tensorboard": False, "wandb": True}})
    assert cfg.logging.backends == ["wandb"]
    written = (dump_config(cfg, tmp_path)).read_text()  # the resolved config has the new form only
    assert "backends:\n  - wandb" in written and "tensorboard:" not in written
    assert load_config(SFTConfig, tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(("override", "message"), [
    ("logging.backends=[mlfow]", "Input should be 'tensorboard', 'mlflow' or 'wandb', got 'mlfow'"),
    ("logging.backends=[mlflow,mlflow]", "logging.backends lists mlflow more than once"),
    ("logging.tensorboard=sometimes", "logging.tensorboard must be true or false, got 'sometimes'"),
    ("logging.wandb=3", "logging.wandb is a section (project, entity, mode), got 3"),
    ("logging.wandb.mode=cloud", "Input should be 'auto', 'offline' or 'online'"),
])
def test_bad_logging_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(SFTConfig, data={}, overrides=[override])
    assert len(caught.value.problems) == 1 and "\n" not in caught.value.problems[0]
    assert message in caught.value.problems[0]


def test_wandb_runs_offline_unless_a_key_or_mode_says_online():
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k" * 40}) == "online"
    assert wandb_mode("auto", {"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode("auto", {"WANDB_MODE": "online"}) == "online"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k" * 40}) == "offline"


# --- missing packages --------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "hidden", "package"), [
    ("mlflow", "mlflow", "mlflow-skinny"), ("mlflow", "sqlalchemy", "sqlalchemy"), ("wandb", "wandb", "wandb")])
def test_missing_package_is_one_line_error_before_anything_is_touched(tmp_path, monkeypatch, backend, hidden, package):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    real_import = tracking.import_module

    def without(name: str, package: str | None = None) -> Any:  # hidden from tracegym's check only
        if name == hidden:
            raise ImportError(f"No module named {name!r}")
        return real_import(name, package)

    monkeypatch.setattr(tracking, "import_module", without)
    with pytest.raises(MissingTrackerPackage) as caught:
        MetricsLogger(tmp_path, settings=LoggingConfig(backends=["tensorboard", backend]))
    text = str(caught.value)
    assert "\n" not in text and f"the {package} package is not installed" in text
    assert f"pip install 'tracegym[{backend}]'" in text and f"logging.backends lists {backend}" in text
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]  # nothing truncated, nothing opened
    assert not (tmp_path / "tensorboard").exists()


def test_a_tracking_server_needs_no_database_packages():
    assert [r.module for r in mlflow_requirements("http://127.0.0.1:5000")] == ["mlflow"]
    assert [r.module for r in mlflow_requirements("sqlite:////tmp/x.db")] == ["mlflow", "sqlalchemy", "alembic"]


# --- failures and hangs never reach training -------------------------------------------------------------


class _Flaky(Tracker):
    """Fails (disk full) on the second step it logs; counts what it was asked."""

    name = "flaky"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.finished = False

    def log_metrics(self, step: int, scalars: Any) -> None:
        if len(self.steps) == 1:
            raise OSError(errno.ENOSPC, f"No space left on device (token {SECRET})")
        self.steps.append(step)

    def finish(self, completed: bool) -> None:
        self.finished = True


def test_a_failing_tracker_is_reported_once_and_switched_off(caplog, monkeypatch):
    monkeypatch.setenv("SOME_SERVICE_API_KEY", SECRET)
    flaky = _Flaky()
    guarded = GuardedTracker("flaky", lambda: flaky, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="tracegym.train.tracking"):
        for step in range(1, 5):
            guarded.log_metrics(step, {"loss": 1.0})
        guarded.finish(completed=True)
    assert flaky.steps == [1] and not flaky.finished and not guarded.active
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "flaky failed while logging step 2 and is off for the rest of this run" in warnings[0]
    assert "OSError" in warnings[0] and SECRET not in warnings[0] and "***" in warnings[0]


def test_a_hanging_tracker_is_cut_off_after_timeout(caplog):
    release = threading.Event()

    class Hangs(Tracker):
        calls = 0

        def log_metrics(self, step: int, scalars: Any) -> None:
            Hangs.calls += 1
            release.wait(30)

    guarded = GuardedTracker("hangs", Hangs, timeout_s=0.2)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tracegym.train.tracking"):
        for step in range(1, 4):
            guarded.log_metrics(step, {"loss": 1.0})
        guarded.finish(completed=True)
    release.set()
    assert time.monotonic() - started < 5 and Hangs.calls == 1
    assert [r.getMessage().count("TimeoutError: no answer within 0.2 s") for r in caplog.records] == [1]


def test_a_tracker_that_cannot_open_is_switched_off(caplog):
    def broken() -> Tracker:
        raise ConnectionError("server unreachable")

    with caplog.at_level(logging.WARNING, logger="tracegym.train.tracking"):
        guarded = GuardedTracker("remote", broken, timeout_s=5)
        guarded.log_params({"a": 1})
        guarded.log_metrics(1, {"loss": 1.0})
        guarded.finish(completed=False)
    assert not guarded.active and len(caplog.records) == 1
    assert "remote failed while opening" in caplog.records[0].getMessage()


# --- secrets ------------------------------------------------------------------------------------------


def test_secrets_are_masked_in_config_and_text(monkeypatch):
    monkeypatch.setenv("MY_TOKEN", SECRET)
    config = {"teacher": {"api_key_env": "OPENAI_API_KEY", "engine_options": {"api_key": "abc", "hf_token": "x1"}},
              "endpoint": f"https://bob:pa55word@example.org/v1?auth={SECRET}", "max_tokens": 64, "password": None}
    out = redact(config)
    assert out["teacher"]["api_key_env"] == "OPENAI_API_KEY"  # the name of a variable, not a secret
    assert out["teacher"]["engine_options"] == {"api_key": "***", "hf_token": "***"}
    assert out["endpoint"] == "https://bob:***@example.org/v1?auth=***"
    assert out["max_tokens"] == 64 and out["password"] is None
    assert redact_text(f"sqlite:///x.db and {SECRET}") == "sqlite:///x.db and ***"
    assert flatten_params({"a": {"b": [1, 2], "c": "s"}, "d": {}}) == {"a.b": "[1, 2]", "a.c": "s", "d": "{}"}


def test_mlflow_keys_are_valid_names():
    assert mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_key("health/kl (k3)") == "health/kl _k3_"
    assert mlflow_key("//a//b/") == "a/b"


# --- MLflow, read back by MLflow's own client -----------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """One SQLite store for the module's MLflow tests (creating one runs MLflow's migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'store.db'}"


def _mlflow_logger(run_dir: Path, store: str, **kwargs: Any) -> MetricsLogger:
    settings = LoggingConfig(backends=["mlflow"], mlflow={"tracking_uri": store, "experiment": "tests"})
    return MetricsLogger(run_dir, settings=settings, **kwargs)


def _final_folder(run_dir: Path) -> Path:
    final = run_dir / "final"
    final.mkdir(parents=True)
    (final / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    (final / "adapter_config.json").write_text('{"r": 4}')
    return final


@needs_mlflow
def test_mlflow_run_reads_back_params_metrics_and_artifacts(tmp_path, mlflow_store, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    run_dir = tmp_path / "run"
    config = {"optim": {"lr": 1e-4, "betas": [0.9, 0.99]}, "engine_options": {"api_key": SECRET},
              "note": f"uses {SECRET}"}
    with _mlflow_logger(run_dir, mlflow_store, config=config) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": 1.0 / step, "eval/pass@1": step / 4, "note": "text is not a metric"})
        (run_dir / "report.html").write_text("<html>report</html>")
        logger.close(_final_folder(run_dir))
    client = MlflowClient(mlflow_store)
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["optim.lr"] == "0.0001" and run.data.params["optim.betas"] == "[0.9, 0.99]"
    assert run.data.params["engine_options.api_key"] == "***" and run.data.params["note"] == "uses ***"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1")] == [0.25, 0.5, 0.75]
    assert "note" not in run.data.metrics
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["final", "report.html"]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "final")) == [
        "final/adapter_config.json", "final/adapter_model.safetensors"]
    local = Path(client.download_artifacts(run.info.run_id, "report.html", str(tmp_path)))
    assert local.read_text() == "<html>report</html>"
    store_file = Path(mlflow_store[len("sqlite:///"):])
    assert SECRET.encode() not in store_file.read_bytes()  # nowhere in the store, not only not in params


@needs_mlflow
def test_mlflow_resume_continues_the_same_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    with _mlflow_logger(tmp_path, mlflow_store, config={"steps": 4}) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": float(step)})
    client = MlflowClient(mlflow_store)
    run_id = (tmp_path / "mlflow_run_id").read_text()
    assert client.get_run(run_id).info.status == "KILLED"  # ended without a final model
    with _mlflow_logger(tmp_path, mlflow_store, config={"steps": 6}, resume_step=2) as logger:
        assert (tmp_path / "mlflow_run_id").read_text() == run_id
        assert client.get_run(run_id).info.status == "RUNNING"
        logger.log(3, {"loss": 30.0})
        logger.log(4, {"loss": 40.0})
        logger.close(_final_folder(tmp_path))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["steps"] == "4"  # params are write-once
    # metrics.jsonl drops the crashed part's step 3; MLflow's history is append-only and keeps both.
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 30.0, 40.0]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss")) == [
        (1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]
    with _mlflow_logger(tmp_path, mlflow_store) as logger:  # a fresh run in the same folder: a new MLflow run
        assert (tmp_path / "mlflow_run_id").read_text() != run_id


@needs_mlflow
def test_mlflow_failing_mid_run_does_not_stop_the_run(tmp_path, mlflow_store, monkeypatch, caplog):
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_batch

    def disk_full_after_step_1(self, run_id, metrics=(), **kwargs):
        if any(m.step >= 2 for m in metrics):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", disk_full_after_step_1)
    with caplog.at_level(logging.WARNING, logger="tracegym.train.tracking"):
        with _mlflow_logger(tmp_path, mlflow_store) as logger:
            for step in (1, 2, 3):
                logger.log(step, {"loss": float(step)})
            logger.close(_final_folder(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    failures = [r.getMessage() for r in caplog.records if "mlflow failed" in r.getMessage()]
    assert failures == ["tracking: mlflow failed while logging step 2 and is off for the rest of this run "
                        "(OSError: [Errno 28] No space left on device)"]
    run_id = (tmp_path / "mlflow_run_id").read_text()
    client = MlflowClient(mlflow_store)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1]
    assert client.list_artifacts(run_id) == []  # switched off: the end of the run was not logged either


# --- W&B offline, read back from its run file -----------------------------------------------------------


def _wandb_records(run_dir: Path, wait_s: float = 30.0) -> list[Any]:
    """The run file's records once W&B's service process has written the exit record (it writes the
    file on its own and may still be flushing when ``finish`` returns, on a loaded machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = _read_wandb_file(run_dir)
        except Exception:  # a chunk still being written: read again
            if time.monotonic() > deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _read_wandb_file(run_dir: Path) -> list[Any]:
    """The records of the W&B offline run file: a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each a 7-byte header (checksum, length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes; a record is a protobuf ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, parts, pos, block = [], [], 7, 32768
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        assert kind in (1, 2, 3, 4), f"chunk type {kind} at byte {pos}"
        parts.append(raw[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def _wandb_view(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}  # decoded values, nested keys merged
    history: list[tuple[int, dict[str, str]]] = []
    artifacts: list[tuple[str, str, list[str]]] = []
    exit_code = None
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            for item in items:  # a top-level key with a JSON value, or a nested key path with a leaf
                path = [item.key] if item.key else list(item.nested_key)
                node = config
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = json.loads(item.value_json)
        elif kind == "history":
            keys = [(item.key or ".".join(item.nested_key), item.value_json) for item in record.history.item]
            values = {key: value for key, value in keys if not key.startswith("_")}
            history.append((record.history.step.num, values))
        elif kind == "artifact":
            artifacts.append((record.artifact.name, record.artifact.type,
                              sorted(entry.path for entry in record.artifact.manifest.contents)))
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"config": config, "history": history, "artifacts": artifacts, "exit_code": exit_code}


@needs_wandb
def test_wandb_offline_run_reads_back_and_holds_no_secret(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_API_KEY", SECRET + "-wandb-key-padding-0123456")  # a key, yet mode says offline
    settings = LoggingConfig(backends=["wandb"], wandb={"mode": "offline", "project": "tests"})
    config = {"optim": {"lr": 1e-4}, "engine_options": {"api_key": SECRET}}
    with MetricsLogger(tmp_path, settings=settings, config=config) as logger:
        for step in (1, 2):
            logger.log(step, {"loss": 1.0 / step, "eval/pass@1": 0.5})
        (tmp_path / "report.html").write_text("<html></html>")
        logger.close(_final_folder(tmp_path))
    run_id = (tmp_path / "wandb_run_id").read_text()
    view = _wandb_view(_wandb_records(tmp_path))
    assert view["config"].get("optim") == {"lr": 1e-4}, (f"config records read back: {view['config']}; record kinds: "
                                                         f"{[r.WhichOneof('record_type') for r in _wandb_records(tmp_path)]}")
    assert view["config"].get("engine_options") == {"api_key": "***"}
    assert [(step, json.loads(v["loss"]), json.loads(v["eval/pass@1"])) for step, v in view["history"]] == [
        (1, 1.0, 0.5), (2, 0.5, 0.5)]
    assert sorted(view["artifacts"]) == [
        (f"final-{run_id}", "model", ["adapter_config.json", "adapter_model.safetensors"]),
        (f"report-{run_id}", "report", ["report.html"])]
    assert view["exit_code"] == 0
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


# --- a recipe end to end -------------------------------------------------------------------------------


@needs_mlflow
@needs_wandb
def test_sft_logs_to_every_backend(tmp_path, tokenizer):
    from mlflow.tracking import MlflowClient

    from tracegym.data.store import TrajectoryWriter
    from tracegym.recipes.sft import train_sft
    from tracegym.render import get_renderer
    from tracegym.types import Message, Trajectory, Turn

    renderer = get_renderer("tiny-random", tokenizer)
    data = tmp_path / "train.jsonl"
    with TrajectoryWriter(data) as writer:
        for a in (2, 3):
            asked, said = Message(role="user", content=f"{a} + 1?"), Message(role="assistant", content=f"{a + 1}")
            turn = Turn(prompt_ids=tuple(renderer.render_prompt([asked])),
                        completion_ids=tuple(renderer.encode_completion(said)), message=said, reward=1.0)
            writer.write(Trajectory(env="toy", task_id=f"t{a}", messages=(asked, said), turns=(turn,), reward=1.0,
                                    success=True, policy="expert"))
    cfg = load_config(SFTConfig, data={
        "model": {"name": "tiny-random"}, "data": {"train_files": [str(data)]}, "batch_size": 2,
        "micro_batch_size": 2, "max_steps": 1, "max_length": 256, "output_dir": str(tmp_path / "sft"),
        "logging": {"progress": False, "backends": ["tensorboard", "mlflow", "wandb"]}})
    result = train_sft(cfg)
    run_dir = tmp_path / "sft"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")  # the embedded default store
    run = client.get_run((run_dir / "mlflow_run_id").read_text())
    assert run.info.status == "FINISHED" and run.data.params["lora.r"] == str(cfg.lora.r)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]
    assert "final/adapter_model.safetensors" in [a.path for a in client.list_artifacts(run.info.run_id, "final")]
    assert (run_dir / "mlflow" / "artifacts").is_dir()  # beside the store, not under the working directory
    view = _wandb_view(_wandb_records(run_dir))
    assert [step for step, values in view["history"] if "loss" in values] == [1]
    assert any(kind == "model" and "adapter_model.safetensors" in files for _, kind, files in view["artifacts"])
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")) and result.final_dir is not None
