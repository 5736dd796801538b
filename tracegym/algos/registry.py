"""Open name -> algorithm registries: advantage estimators, policy losses and preference losses.

Each algorithm registers itself with a decorator, with the options model it accepts::

    @POLICY_LOSSES.register("cispo", options=CISPOOptions)
    def cispo(inputs: LossInputs, opts: CISPOOptions) -> tuple[Tensor, dict[str, float]]: ...

    @ADVANTAGE_ESTIMATORS.register("my_loo")          # options taken from the keyword-only
    def my_loo(groups, *, scale: float = 1.0): ...    # parameters, passed as keywords

``REGISTRY.entry(name)(arg, options)`` validates the options and calls the function: with the
options model instance as second argument, or with keyword arguments when the options came from
the signature.

Where the registries are filled from:

1. the built-in algorithms (``tracegym.algos`` imports its files);
2. installed packages that declare entry points in the group ``tracegym.algos`` (a module, imported
   by ``tracegym.plugins.load_entry_points``), e.g. ``myalgos = "mypkg.algos"``;
3. a user's module named by ``--plugin MODULE`` or the config key ``plugins:`` (imported before the
   config is validated, so its names are valid there).

Registering the same function again (a module imported twice, as a file and as a package) replaces
the entry quietly; registering a different function under a taken name is an error. Unknown names
raise a ``KeyError`` listing the registered names and the nearest one.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from pydantic import BaseModel, ConfigDict, create_model

F = TypeVar("F", bound=Callable)


class NoOptions(BaseModel):
    """An algorithm without options: any key given is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def options_from_signature(fn: Callable, name: str) -> type[BaseModel]:
    """A pydantic model of ``fn``'s keyword-only parameters (their annotations and defaults)."""
    fields: dict[str, Any] = {}
    hints: dict[str, Any] = {}
    try:
        hints = {k: v for k, v in inspect.get_annotations(fn, eval_str=True).items()}
    except Exception:  # noqa: BLE001 - unresolvable annotations: fall back to Any
        hints = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hints.get(p.name, Any), default)
    if not fields:
        return NoOptions
    model = create_model(f"{name}_options", __config__=ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True), **fields)
    return model


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered algorithm: its function and the options model it validates its options with."""

    name: str
    fn: F
    options: type[BaseModel]
    keyword_options: bool = False  # options came from fn's keyword-only parameters

    def __call__(self, arg: Any, options: BaseModel | dict[str, Any] | None = None) -> Any:
        """Run the algorithm on ``arg`` (groups or loss inputs) with validated ``options``."""
        opts = self.parse_options(options)
        if self.keyword_options:
            return self.fn(arg, **{k: getattr(opts, k) for k in type(opts).model_fields})
        return self.fn(arg, opts)

    def parse_options(self, values: dict[str, Any] | BaseModel | None) -> BaseModel:
        """Validated options (a ``pydantic.ValidationError`` names every bad key)."""
        if isinstance(values, self.options):
            return values
        if isinstance(values, BaseModel):
            values = values.model_dump()
        return self.options.model_validate(values or {})


def _same_definition(a: Callable, b: Callable) -> bool:
    """The same function, or the same definition imported twice (module + qualified name)."""
    if a is b:
        return True
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    ka, kb = key(a), key(b)
    if None not in ka and ka == kb:
        return True
    # a file loaded by path (module name "my_loss") and as a package module ("pkg.my_loss")
    try:
        return inspect.getsourcefile(a) == inspect.getsourcefile(b) and a.__qualname__ == b.__qualname__
    except (TypeError, OSError):
        return False


class Registry(Generic[F]):
    """A small typed mapping from a name to an algorithm, filled by ``@registry.register(name)``."""

    def __init__(self, kind: str, signature: str = ""):
        self.kind = kind
        self.signature = signature
        self._items: dict[str, Entry[F]] = {}

    def register(self, name: str, *, options: type[BaseModel] | None = None) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; ``options`` is its options model (default:
        built from ``fn``'s keyword-only parameters)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._items and not _same_definition(self._items[name].fn, fn):
                old = self._items[name].fn
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {getattr(old, '__module__', '?')}."
                    f"{getattr(old, '__qualname__', '?')}; pick another name"
                )
            model = options if options is not None else options_from_signature(fn, name)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                raise TypeError(f"{self.kind} {name!r}: options must be a pydantic model class, got {model!r}")
            self._items[name] = Entry(name, fn, model, keyword_options=options is None)
            return fn

        return decorator

    def entry(self, name: str) -> Entry[F]:
        if name not in self._items:  # installed packages' ``tracegym.algos`` entry points, imported once
            from tracegym.plugins import load_entry_points

            load_entry_points()
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}.{hint} Registered: {', '.join(sorted(self._items))}"
                " (a plugin module adds more: --plugin MODULE or plugins: [MODULE])"
            ) from None

    def problems(self, name: str, options: dict[str, Any] | None, name_key: str, options_key: str) -> list[str]:
        """One line per problem with ``name`` (config key ``name_key``) or its options (``options_key``);
        [] when both are fine. For ``check`` commands, which report every problem at once."""
        try:
            self.entry(name).parse_options(options)
        except KeyError as error:
            return [f"{name_key}: {error.args[0]}"]
        except ValueError as error:  # pydantic's ValidationError names every bad key
            return [f"{options_key} of {name!r}: {' '.join(str(error).split())}"]
        return []

    def get(self, name: str) -> F:
        """The registered function (KeyError with the registered names if unknown)."""
        return self.entry(name).fn

    def options(self, name: str) -> type[BaseModel]:
        """The options model of ``name``."""
        return self.entry(name).options

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests; a user replacing a built-in registers under a new name instead)."""
        self._items.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)


ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry(
    "advantage estimator",
    "(groups: Sequence[TrajectoryGroup], opts) -> list[TurnAdvantages] (one value per turn of every trajectory)",
)
"""``fn(groups, opts) -> list (per group) of list (per trajectory) of per-turn advantages``."""

POLICY_LOSSES: Registry[Callable] = Registry(
    "policy loss", "(inputs: LossInputs, opts) -> (per-token loss [B, T], metrics dict)"
)
"""``fn(inputs: LossInputs, opts) -> (per_token [B, T], metrics)``; ``compose.compute_policy_loss``
applies masks, importance weights, aggregation, KL and entropy terms once, for every loss."""

PREFERENCE_LOSSES: Registry[Callable] = Registry(
    "preference loss",
    "(inputs: PairLogps | LabelledLogps, opts) -> (per-item loss [P] or [N], metrics dict)",
)
"""``fn(inputs, opts) -> (per_item_loss, metrics)`` on sequence log-probs of whole trajectories
(``tracegym.algos.preference_inputs``): ``PairLogps`` for pair losses (dpo, dmpo), ``LabelledLogps``
for losses on single labelled trajectories (kto); the options model (a ``PreferenceOptions``) says
which with its ``data`` class attribute, and gives the per-turn weights of the sequence log-probs."""
