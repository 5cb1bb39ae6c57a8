"""Checks a config group against what it builds, before anything is built: every key a parameter of its
`_target_` (or of the dataclass it fills), every required parameter given, every scalar of its parameter's type,
and the same for the nested `_target_` groups (engine.proposer, engine.scheduler, ...). So `workload.output_len=abc`
or `+engine.bogus=1` is one message that names the key and the fix (exit 2; in a sweep, that job's error.json),
not a TypeError from deep inside a constructor, as Hydra's structured configs check their fields.

Owns: matching config values to Python signatures. Ignores: value ranges (each constructor checks its own).
Called only by the console scripts' modules, the ones that touch DictConfig (lab.run, lab.serve.cli, lab.train,
lab.bench_serve), and by lab.training.recipe for the drafter options it receives as a plain dict.
Annotations it cannot evaluate or judge (classes, forward references) are not checked.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, OmegaConf

from lab.errors import LabError

HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_", "_args_"})
_SEQUENCES = (list, tuple, Sequence, set, frozenset)
_MAPPINGS = (dict, Mapping)


def check_group(cfg: DictConfig, path: str, supplied: Iterable[str] = ()) -> None:
    """The `_target_` group at `path` of a composed config ('engine', 'model.source'), checked before hydra's
    instantiate builds it; `supplied`: the arguments the caller passes beside the group's settings."""
    node = OmegaConf.select(cfg, path)
    if not isinstance(node, DictConfig):
        raise LabError(f"the config has no {path} group", f"choose one: {path.split('.')[0]}=<name> (see conf/)")
    check_target_config(OmegaConf.to_container(node, resolve=True), path, supplied)


def checked_kwargs(target: Callable[..., Any], node: DictConfig, path: str) -> dict[str, Any]:
    """node's values as keyword arguments for target (a dataclass the group fills), after `check_call`."""
    values = OmegaConf.to_container(node, resolve=True)
    check_call(target, values, path)
    return values


def check_target_config(values: Mapping[str, Any], path: str, supplied: Iterable[str] = ()) -> None:
    """A `_target_` config as plain values (its nested `_target_` groups included) against its target."""
    target_name = values.get("_target_")
    if not isinstance(target_name, str):
        raise LabError(f"{path} has no _target_ (the class or function it builds)",
                       f"choose a config for {path.split('.')[0]} from conf/, or set {path}._target_")
    check_call(_locate(target_name, path), values, path, supplied)


def _locate(dotted: str, path: str) -> Any:
    """The object a `_target_` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue   # NOTE: this prefix is not a module; a shorter one may be
            raise          # NOTE: the module exists but a dependency of it is missing: not a config error
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise LabError(f"{path}._target_ {dotted!r} does not exist ({obj.__name__} has no {attr!r})",
                               f"point {path}._target_ at a class or function of the lab package")
            obj = getattr(obj, attr)
        return obj
    raise LabError(f"{path}._target_ {dotted!r} does not exist (no module {parts[0]!r})",
                   f"point {path}._target_ at a class or function of the lab package")


def check_call(target: Callable[..., Any], values: Mapping[str, Any], path: str, supplied: Iterable[str] = ()
               ) -> None:
    """Would target(**values, **supplied) bind, and are values' scalars of the annotated types? path: the values'
    key in the config ('engine', 'model.source'; '' for its top level)."""
    name = getattr(target, "__qualname__", repr(target))
    params = _parameters(target)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    supplied = set(supplied)
    known = [k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and k not in supplied]
    keys = [k for k in values if k not in HYDRA_KEYS]
    partial = bool(values.get("_partial_"))   # NOTE: a partial's missing arguments come later
    for key in keys:
        if key not in params and not takes_any:
            close = difflib.get_close_matches(key, known, n=1)
            raise LabError(f"{path or 'the config'} has no setting {key!r} ({name} takes: {', '.join(known)})",
                           f"did you mean {_join(path, close[0])}?" if close
                           else f"remove {_join(path, key)}, or use one of those")
    for key, param in params.items():
        if (param.default is param.empty and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
                and key not in values and key not in supplied and not partial):
            raise LabError(f"{_join(path, key)} is required ({name} has no default for it)", f"set {_join(path, key)}")
    module_globals = vars(sys.modules.get(getattr(target, "__module__", ""), types.ModuleType("_")))
    for key in keys:
        value = values[key]
        if isinstance(value, Mapping) and "_target_" in value:
            check_target_config(value, _join(path, key))
            continue
        if key not in params:
            continue
        annotation = _evaluate(params[key].annotation, module_globals)
        if annotation is not None:
            check_value(annotation, value, _join(path, key))


def check_value(annotation: Any, value: Any, path: str) -> None:
    """value against a type (int | None, Literal['a', 'b'], list[int]); path: its key, for the message."""
    if _accepts(annotation, value) is False:
        expected = _describe(annotation)
        raise LabError(f"{path} must be {expected}, got {value!r}", f"set {path} to {expected}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _parameters(target: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):   # NOTE: builtins without a signature: nothing to check
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}


def _evaluate(annotation: Any, module_globals: dict[str, Any]) -> Any:
    """The annotation as an object (modules use `from __future__ import annotations`); None if unknown."""
    if annotation is inspect.Parameter.empty:
        return None
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, module_globals)  # noqa: S307 - our own modules' annotations
    except Exception:  # noqa: BLE001 - a name imported only for type checking: leave it unchecked
        return None


def _members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _accepts(annotation: Any, value: Any) -> bool | None:
    """True / False where the annotation decides, None where it cannot judge the value (a class, a protocol)."""
    verdicts = [_accepts_one(member, value) for member in _members(annotation)]
    if True in verdicts:
        return True
    return None if None in verdicts else False


def _accepts_one(member: Any, value: Any) -> bool | None:
    origin = get_origin(member) or member
    if member is Any or member is object:
        return True
    if member is type(None):
        return value is None
    if origin is Literal:
        return value in get_args(member)
    if member is bool:
        return isinstance(value, bool)
    if member is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if member is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if member is str:
        # NOTE: YAML and Hydra's override parser read `name=123` as a number; it is still a fine string
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if member is Path:
        return isinstance(value, str)
    if inspect.isclass(origin) and issubclass(origin, _MAPPINGS):
        return isinstance(value, Mapping)
    if inspect.isclass(origin) and issubclass(origin, _SEQUENCES) and not issubclass(origin, str):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in get_args(member) if a is not Ellipsis]
        if len(args) != 1:
            return True
        items = [_accepts(args[0], item) for item in value]
        return False if False in items else True
    return None


_WORDS: dict[Any, tuple[str, str]] = {int: ("an integer", "integers"), float: ("a number", "numbers"),
                                     bool: ("true or false", "booleans"), str: ("a string", "strings"),
                                     Path: ("a string", "strings"), type(None): ("null", "nulls")}


def _describe(annotation: Any, plural: bool = False) -> str:
    """What a value must be, in words: 'an integer or null', "one of 'native', 'fast'", 'a list of integers'."""
    words = []
    for member in _members(annotation):
        origin = get_origin(member) or member
        if member in _WORDS:
            words.append(_WORDS[member][plural])
        elif origin is Literal:
            words.append(("values among " if plural else "one of ") + ", ".join(repr(v) for v in get_args(member)))
        elif inspect.isclass(origin) and issubclass(origin, _MAPPINGS):
            words.append("mappings" if plural else "a mapping")
        elif inspect.isclass(origin) and issubclass(origin, _SEQUENCES):
            args = [a for a in get_args(member) if a is not Ellipsis]
            of = f" of {_describe(args[0], plural=True)}" if len(args) == 1 else ""
            words.append(("lists" if plural else "a list") + of)
        else:
            words.append(getattr(member, "__name__", str(member)))
    return " or ".join(words)
