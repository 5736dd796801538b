"""What every config is built on: the ``_Section`` base model, and loading a YAML file (plus
``key.sub=value`` overrides) into a config class with errors that name every problem at once
(``ConfigError``), writing the resolved config (``dump_config``) and listing its fields for the docs
(``describe_fields``). Nothing here knows a recipe; the sections are in ``shared`` and the recipe
modules."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )


def _merge_under(defaults: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``defaults`` filled in where it has no key (nested dicts merged key by key)."""
    out = dict(defaults)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_under(out[key], value)
        else:
            out[key] = value
    return out


class ConfigError(ValueError):
    """Every problem of a config at once, one readable line (or short block) per problem."""

    def __init__(self, problems: Sequence[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {p}" for p in self.problems))


C = TypeVar("C", bound=BaseModel)


def _section_at(cls: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The config class found by following ``loc`` (field names) down from ``cls``."""
    current: type[BaseModel] | None = cls
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = (annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel)
                   else _optional_section(annotation))
    return current


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _yaml_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each key path of a YAML mapping document to its 1-based line number."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                path = prefix + (str(key_node.value),)
                lines[path] = key_node.start_mark.line + 1
                walk(value_node, path)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


def _describe_errors(
    cls: type[BaseModel],
    error: ValidationError,
    where: Mapping[tuple[str, ...], str],
) -> list[str]:
    """Turn pydantic's errors into messages that name the key, where it is, and what is allowed."""
    problems: list[str] = []
    # A union field (``list[str] | Literal["all-linear"]``) fails once per branch, with the branch
    # tag (``list[str]``) inside the location: merge those into one message per key.
    merged: dict[tuple, list[dict]] = {}
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "(" in p)))
        merged.setdefault(loc, []).append(err)
    for loc, errs in merged.items():
        key_path = tuple(str(p) for p in loc)
        origin = where.get(key_path, "")
        at = f" ({origin})" if origin else ""
        first = errs[0]
        if first["type"] == "extra_forbidden":
            section = _section_at(cls, loc[:-1])
            allowed = sorted(section.model_fields) if section else []
            bad = str(loc[-1])
            near = difflib.get_close_matches(bad, allowed, n=1, cutoff=0.0)
            hint = f"; did you mean '{_dotted(loc[:-1] + (near[0],))}'?" if near else ""
            problems.append(f"unknown key '{_dotted(loc)}'{at}{hint} allowed keys here: {', '.join(allowed)}")
            continue
        got = first.get("input")
        given = "" if isinstance(got, dict) else f", got {got!r}"
        message = " or ".join(dict.fromkeys(e["msg"] for e in errs))
        problems.append(f"bad value for '{_dotted(loc)}'{at}: {message}{given}")
    return problems


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-4``) and ``1e-4`` is a string;
    learning rates are written the short way, so floats are resolved as in YAML 1.2.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: Sequence[str]) -> list[tuple[tuple[str, ...], Any, str]]:
    """``["lora.r=8", "optim.lr=1e-4"]`` -> ``[(("lora", "r"), 8, "lora.r=8"), ...]``.

    Values are parsed as YAML, so ``8`` is an int, ``1e-4`` a float, ``null`` None and
    ``[a,b]`` a list; quote a value to keep it a string (``model.name='123'``).
    """
    parsed = []
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(f"override {item!r} is not of the form key.sub=value")
            continue
        try:
            value = _yaml_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problems.append(f"override {item!r}: value is not valid YAML ({exc.__class__.__name__})")
            continue
        parsed.append((tuple(key.split(".")), value, item))
    if problems:
        raise ConfigError(problems, "command-line overrides")
    return parsed


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], where: dict[tuple[str, ...], str] | None = None
) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (a new dict; ``data`` is not changed).

    ``where`` (if given) records that each overridden key came from the command line, for errors.
    """
    import copy

    result = copy.deepcopy(data)
    for path, value, item in parse_overrides(overrides):
        node = result
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    [f"override {item!r}: '{'.'.join(path[: i + 1])}' is a value ({child!r}), not a section"],
                    "command-line overrides",
                )
            node = child
        node[path[-1]] = value
        if where is not None:
            where[path] = f"command line {item!r}"
    return result


def load_config(
    cls: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    data: Mapping[str, Any] | None = None,
) -> C:
    """Read a YAML file (or ``data``), apply overrides, validate into ``cls``.

    Raises ``ConfigError`` naming every bad key (with file line or override, nearest valid key and
    the allowed keys) and every bad value (with the allowed values).
    """
    where: dict[tuple[str, ...], str] = {}
    source = "config"
    raw: Any = dict(data or {})
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError([f"config file not found: {path}"], source)
        text = path.read_text(encoding="utf-8")
        try:
            raw = _yaml_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], source) from None
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError([f"the top level must be a mapping of keys, got {type(raw).__name__}"], source)
        where = {k: f"{path}:{line}" for k, line in _yaml_lines(text).items()}
    raw = apply_overrides(raw, overrides, where)
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe_errors(cls, exc, where), source) from None


def dump_config(config: BaseModel, run_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (every default filled in) as YAML into ``run_dir``; returns the path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    header = f"# resolved {type(config).__name__}: defaults filled in, overrides applied\n"
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(header + body, encoding="utf-8")
    tmp.replace(target)
    return target


def describe_fields(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field, sections expanded; used by the docs."""
    rows = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append((key, "section", "", field.description or ""))
            rows.extend(describe_fields(annotation, key + "."))
            continue
        optional = _optional_section(annotation)
        if optional is not None:  # a section that is off by default (``env.injection``)
            rows.append((key, "section", repr(field.get_default(call_default_factory=True)), field.description or ""))
            rows.extend(describe_fields(optional, key + "."))
            continue
        type_name = str(annotation).replace("typing.", "")
        if isinstance(annotation, type):
            type_name = annotation.__name__
        default = field.get_default(call_default_factory=True)
        rows.append((key, type_name, repr(default), field.description or ""))
    return rows


def _optional_section(annotation: Any) -> type[BaseModel] | None:
    """``X`` for an annotation ``X | None`` whose ``X`` is a config section, else None."""
    import types
    import typing

    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None
