"""MLflow as a tracker (``mlflow`` in ``logging.backends``): one MLflow run per tracegym run.

The store is ``logging.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else an embedded SQLite
database in ``<output_dir>/mlflow/mlflow.db`` with the artifacts beside it (``mlflow/artifacts``).
The config goes in as params (dotted keys), each logged step's scalars as metrics at that step, the
final model folder under ``final/`` and ``report.html`` as artifacts. The run id is kept in
``<output_dir>/mlflow_run_id``, so ``--resume`` continues the same MLflow run (steps logged after the
checkpoint by the crashed part stay in MLflow's history: its metrics are append-only).

Only ``mlflow-skinny`` is needed (plus ``sqlalchemy`` and ``alembic`` for a SQLite store); the full
``mlflow`` package works too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tracegym.config.shared import LoggingConfig
from tracegym.train.tracking import Requirement, Tracker, flatten_params, read_run_id, redact_text

__all__ = ["MlflowTracker", "mlflow_key", "mlflow_requirements", "mlflow_uri", "open_mlflow"]

ID_FILE = "mlflow_run_id"
STORE_DIR = "mlflow"
_INSTALL = "pip install 'tracegym[mlflow]' (mlflow-skinny, sqlalchemy, alembic)"
_MAX_PARAMS = 100  # per log_batch call (MLflow's limit)
_MAX_METRICS = 1000
_MAX_VALUE = 6000  # characters of a param value MLflow keeps
_BAD_KEY_CHARS = re.compile(r"[^\w.\- /]")


def mlflow_uri(run_dir: Path, settings: LoggingConfig, environ: Mapping[str, str]) -> str:
    """The tracking URI: the config's, else ``MLFLOW_TRACKING_URI``, else SQLite in the run dir."""
    uri = settings.mlflow.tracking_uri or environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{(run_dir / STORE_DIR / 'mlflow.db').resolve()}"


def mlflow_requirements(uri: str) -> list[Requirement]:
    """What opening ``uri`` imports: mlflow, and SQLAlchemy with alembic for a database store."""
    needs = [Requirement("mlflow", "mlflow-skinny", _INSTALL)]
    if not uri.startswith(("http://", "https://", "file:", "databricks")):
        needs += [Requirement("sqlalchemy", "sqlalchemy", _INSTALL), Requirement("alembic", "alembic", _INSTALL)]
    return needs


def _sqlite_artifacts(uri: str) -> str | None:
    """Artifact root of an experiment created in a SQLite store: ``artifacts/`` beside the database
    (MLflow's own default is ``./mlruns`` under the working directory)."""
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return (Path(uri[len("sqlite:///"):]).resolve().parent / "artifacts").as_uri()


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: ``eval/pass@1`` -> ``eval/pass_at_1``, other characters -> ``_``."""
    key = _BAD_KEY_CHARS.sub("_", key.replace("@", "_at_"))
    return re.sub("/+", "/", key).strip("/") or "_"


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class MlflowTracker(Tracker):
    """One MLflow run through ``MlflowClient`` (no global MLflow state is touched)."""

    name = "mlflow"

    def __init__(self, client: Any, run_id: str, resumed: bool):
        self.client = client
        self.run_id = run_id
        self.resumed = resumed

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = {mlflow_key(k): v[:_MAX_VALUE] for k, v in flatten_params(params).items()}
        if self.resumed:  # params are write-once: keep those already there, say which changed
            before = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k in flat if k in before and before[k] != flat[k])
            if changed:
                print(f"mlflow: resumed run keeps its first values of {', '.join(changed)}")
            flat = {k: v for k, v in flat.items() if k not in before}
        for part in _chunks([Param(k, v) for k, v in flat.items()], _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=list(part))

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for part in _chunks(metrics, _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=list(part))

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
        else:
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, completed: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if completed else "KILLED")


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # noqa: BLE001 - another run created it meanwhile
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def open_mlflow(run_dir: Path, settings: LoggingConfig, resume_step: int | None, uri: str) -> MlflowTracker:
    """Open (or, resumed, continue) the MLflow run of ``run_dir`` in the store at ``uri``."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = _experiment_id(client, settings.mlflow.experiment, _sqlite_artifacts(uri))
    id_file = run_dir / ID_FILE
    run_id = read_run_id(id_file, resume_step is not None)
    if run_id is not None:
        try:
            client.update_run(run_id, status="RUNNING")
        except Exception:  # noqa: BLE001 - not in this store (the URI changed): a new run
            run_id = None
    resumed = run_id is not None
    if run_id is None:
        run = client.create_run(experiment_id, run_name=run_dir.name,
                                tags={"tracegym.output_dir": str(run_dir.resolve())})
        run_id = run.info.run_id
        id_file.write_text(run_id, encoding="utf-8")
    print(f"mlflow: {'continuing' if resumed else 'started'} run {run_id} in {redact_text(uri)} "
          f"(experiment {settings.mlflow.experiment!r})")
    return MlflowTracker(client, run_id, resumed)
