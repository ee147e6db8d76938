"""Name -> factory tables for models and datasets, and ``package.module:function`` resolution.

Plain dicts on purpose: a reader sees every built-in in one place. Each built-in is its import path, resolved like
a user's own (``mymodels:build``) when it is first built: the tables themselves import no model code, so reading and
checking a config needs no torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.core.errors import ConfigError
from kiln.core.text import first_line
from kiln.core.user_errors import (
    MAIN_GUARD,
    exit_call,
    is_user_file,
    relative_path,
    user_code_error,
    user_exit_error,
    user_frame,
    where,
)

if TYPE_CHECKING:
    from torch import nn

    from kiln.core.data import DatasetSplits

MODELS: dict[str, str] = {
    "cnn": "kiln.models.cnn:small_cnn",
    "resnet18": "kiln.models.cnn:resnet18",
    "transformer": "kiln.models.transformer:transformer",
    "bert_base": "kiln.models.transformer:bert_base",
    "mlp_embed": "kiln.models.mlp:mlp_embed",
    "token_classifier": "kiln.models.token_classifier:token_classifier",
    "mlp_regressor": "kiln.models.token_classifier:mlp_regressor",
}

DATASETS: dict[str, str] = {
    "digits": "kiln.models.datasets:digits",
    "digits_ids": "kiln.models.datasets:digits_ids",
    "synthetic": "kiln.models.datasets:synthetic",
    "synthetic_rgb": "kiln.models.datasets:synthetic_rgb",
    "synthetic_tokens": "kiln.models.datasets:synthetic_tokens",
    "synthetic_text": "kiln.models.datasets:synthetic_text",
    "synthetic_regression": "kiln.models.datasets:synthetic_regression",
}

# Which built-in dataset a built-in model trains on when the config names none: it must fit the model's
# default input (plain ``synthetic`` is 1x8x8, which neither ResNet-18 nor BERT-base takes).
DEFAULT_DATASET: dict[str, str] = {
    "cnn": "digits",
    "transformer": "digits",
    "mlp_embed": "digits_ids",
    "resnet18": "synthetic_rgb",
    "bert_base": "synthetic_tokens",
    "token_classifier": "synthetic_text",
    "mlp_regressor": "synthetic_regression",
}


# What each kind of user code is and a typical name for it, for the examples in error hints: a data function's
# example must look like one ('mydata:load'), not like the model factory's ('mymodels:build').
KINDS: dict[str, tuple[str, str, str]] = {  # kind -> (what it is, example module, example function)
    "model": ("model factory", "mymodels", "build"),
    "dataset": ("data function", "mydata", "load"),
    "data": ("data function", "mydata", "load"),
    "train.loss": ("loss function", "mylosses", "loss"),
    "calibration": ("calibration reader", "myreader", "batches"),
    "calibration reader": ("calibration reader", "myreader", "batches"),
}


# What Kiln is doing when it calls each kind of user code, for the error that code raises.
DOING: dict[str, str] = {"model": "building the model", "dataset": "loading data"}

# What each factory should do instead of exiting, for the error when it calls sys.exit()
RETURNS: dict[str, str] = {"model": "return the model", "dataset": "return the DatasetSplits"}


# How resolve_callable imports a module. kiln.pipeline.user_code sets its import_fresh, which reloads a user's
# module whose files changed since it was loaded, so that the code a stage runs is the code its cache key hashes
# (that version of the code is the pipeline's, a layer above this one).
_import: Callable[[str], ModuleType] = importlib.import_module


def use_importer(importer: Callable[[str], ModuleType]) -> None:
    """Import the modules of user code with ``importer`` (``importlib.import_module``'s signature)."""
    global _import
    _import = importer


def example_path(kind: str, module: str | None = None) -> str:
    """An import path of the form ``kind`` expects (``mydata:load`` for a dataset), in ``module`` if given."""
    _, default_module, function = KINDS.get(kind, ("function", "mypkg", "function"))
    return f"{module or default_module}:{function}"


def check_name(ref: str, table: dict[str, str], kind: str) -> None:
    """A name that is neither a built-in of ``table`` nor an import path is a ConfigError: the import path with a
    colon where a dot stands for it (``mymodels.build``), else the built-ins; nothing is imported."""
    if ref in table or ":" in ref:
        return
    if colon := _with_colon(ref):
        hint = f"write '{colon}' for '{ref}': an import path puts a colon before the function"
    elif table:
        hint = f"use one of {sorted(table)} or an import path like '{example_path(kind)}'"
    else:
        hint = f"give an import path 'module:function', like '{example_path(kind)}'"
    raise ConfigError(f"unknown {kind} '{ref}'", hint=hint)


def _with_colon(ref: str) -> str | None:
    """``mymodels:build`` for ``mymodels.build``, where the part before the last dot is a module on the import
    path; None otherwise."""
    module_name, _, attr = ref.rpartition(".")
    return f"{module_name}:{attr}" if module_name and attr.isidentifier() and _findable(module_name) else None


def _findable(module_name: str) -> bool:
    """Whether ``module_name`` can be imported, told by the import system's finders without importing it or its
    packages (``importlib.util.find_spec`` imports the parents): checking a config runs no user code."""
    parts = module_name.split(".")
    locations: list[str] | None = None  # sys.path for the top-level name, then each package's own folders
    for depth in range(1, len(parts) + 1):
        if not parts[depth - 1].isidentifier():
            return False
        name = ".".join(parts[:depth])
        finders = [f for f in sys.meta_path if hasattr(f, "find_spec")]
        spec = next((s for f in finders if (s := f.find_spec(name, locations)) is not None), None)
        if spec is None or (depth < len(parts) and not spec.submodule_search_locations):
            return False
        locations = list(spec.submodule_search_locations or [])
    return True


def resolve_callable(ref: str, table: dict[str, str], kind: str) -> Callable[..., Any]:
    """A built-in name from ``table`` or an import path ``package.module:function``."""
    check_name(ref, table, kind)
    ref = table.get(ref, ref)
    module_name, _, attr = ref.partition(":")
    try:
        module = _import(module_name)
    except ImportError as exc:
        if _import_inside(exc, module_name):
            raise _inner_import_error(exc, module_name, kind, ref) from None
        hint = (
            "run kiln from the folder holding the module, or put it next to the config (the kiln command imports "
            "from both); from Python (load_config, run_pipeline), add its folder to sys.path or PYTHONPATH"
        )
        raise ConfigError(f"cannot import module '{module_name}' for {kind} '{ref}': {exc}", hint=hint) from None
    except Exception as exc:  # the user's module itself fails (SyntaxError, an exception at import time)
        raise ConfigError(
            f"importing module '{module_name}' for {kind} '{ref}' failed: {type(exc).__name__}: {first_line(exc)}"
            + _import_site(exc),
            hint=f"fix the error in {module_name}",
        ) from None
    except SystemExit as exc:  # a script that exits at import time: left alone, it would end Kiln's command
        raise ConfigError(
            f"importing module '{module_name}' for {kind} '{ref}' called {exit_call(exc)}{_import_site(exc)}",
            hint=f"keep {module_name} from exiting when imported: {MAIN_GUARD}",
        ) from None
    fn = getattr(module, attr, None)
    if fn is None and (mine := _shadowed(module, module_name)) is not None:
        found = getattr(module, "__file__", None) or "built into Python"
        raise ConfigError(
            f"module '{module_name}' for {kind} '{ref}' is imported from {found}, not from your {mine}: another "
            "module of that name comes first",
            hint=f"rename {mine.name} (e.g. to {mine.stem}_model.py) and the module in {kind}.name with it",
        )
    if not callable(fn):
        what = KINDS.get(kind, ("function",))[0]
        found = f"is not a callable {what}" if hasattr(module, attr) else f"is not defined, so there is no {what}"
        close = difflib.get_close_matches(attr, [n for n, v in vars(module).items() if callable(v)], n=1)
        raise ConfigError(
            f"'{attr}' in module '{module_name}' {found} (for {kind} '{ref}')",
            hint=f"write '{module_name}:{close[0]}' for '{ref}'"
            if close
            else f"point {kind} at a function, e.g. '{example_path(kind, module_name)}'",
        )
    return fn


def _params_fix(factory: Callable[..., Any], params: dict[str, Any] | None, section: str, fallback: str) -> str:
    """The fix for params a factory refused: the parameter it takes nearest a name it does not (``layers`` for
    ``layrs``), else ``fallback``."""
    try:
        parameters = inspect.signature(factory).parameters.items()
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return fallback
    takes = [n for n, p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for name in params or {}:
        if name not in takes and (close := difflib.get_close_matches(name, takes, n=1)):
            return f"write '{close[0]}' for '{name}' in {section}.params (it takes {', '.join(takes)})"
    return fallback


def _shadowed(module: Any, module_name: str) -> Path | None:
    """A file on the import path named like ``module_name`` that is not the module Python imported (a user's
    ``io.py`` or ``test.py``: Python's own module of that name, or an installed package's, comes first)."""
    found = getattr(module, "__file__", None)
    relative = Path(*module_name.split(".")).with_suffix(".py")
    for entry in sys.path:
        candidate = Path(entry or ".") / relative
        if candidate.is_file() and (found is None or candidate.resolve() != Path(found).resolve()):
            return candidate
    return None


def _call_factory(
    ref: str, table: dict[str, str], kind: str, params: dict[str, Any] | None, expected: type, hint: str
) -> Any:
    factory = resolve_callable(ref, table, kind)
    section = "model" if kind == "model" else "data"
    params_hint = f"fix {section}.params in the config"
    try:
        obj = factory(**(params or {}))
    except SystemExit as exc:  # sys.exit() in the factory: an error, never the end of the command
        raise user_exit_error(exc, DOING[kind], f"{KINDS[kind][0]} '{ref}'", RETURNS[kind]) from exc
    except Exception as exc:
        # Raised in the user's file: their function and line. Otherwise the call itself failed (an unknown
        # keyword, an invalid value in a built-in): a config mistake.
        name = f"{KINDS[kind][0]} '{ref}'"
        err = user_code_error(exc, DOING[kind], name, _params(exc, params))
        if err is not None:
            raise err from exc
        if not isinstance(exc, (TypeError, ValueError)):
            raise
        fix = _params_fix(factory, params, section, params_hint)
        raise ConfigError(f"{kind} '{ref}' rejected its params {params}: {exc}", hint=fix) from exc
    if not isinstance(obj, expected):
        raise ConfigError(
            f"{kind} factory '{ref}' returned {type(obj).__name__}, not {expected.__module__}.{expected.__name__}",
            hint=hint,
        )
    return obj


def _params(exc: BaseException, params: dict[str, Any] | None) -> str | None:
    """For a TypeError/ValueError raised by the user's factory: the params it was given may be the cause."""
    return f"check its params {params}" if params and isinstance(exc, (TypeError, ValueError)) else None


# Import names whose pip distribution is named otherwise, for the install hint of a missing package
PIP_NAMES: dict[str, str] = {
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "cv2": "opencv-python",
    "PIL": "Pillow",
    "yaml": "PyYAML",
    "bs4": "beautifulsoup4",
}


def _import_inside(exc: ImportError, module_name: str) -> bool:
    """Whether ``exc`` came from an import inside ``module_name`` (or its packages) rather than from finding it: the
    module was found and ran, and something it imports is missing (``pandas``, a ``models.layers`` never written)."""
    if not isinstance(exc, ModuleNotFoundError):
        return True  # "cannot import name X from Y": a module that was found and ran
    missing = exc.name
    return bool(missing) and missing != module_name and not module_name.startswith(f"{missing}.")


def _inner_import_error(exc: ImportError, module_name: str, kind: str, ref: str) -> ConfigError:
    """The error for an import failing inside the user's module: the import's file:line, and as the fix installing
    a missing package or the module a local import names."""
    frame = user_frame(exc)
    at = f"{relative_path(frame.filename)}:{frame.lineno}" if frame is not None else f"module '{module_name}'"
    head = f"importing module '{module_name}' for {kind} '{ref}' failed"
    missing = exc.name or ""
    if not isinstance(exc, ModuleNotFoundError):
        return ConfigError(f"{head} at {at}: {first_line(exc)}", hint=f"fix the import at {at}")
    top = missing.split(".")[0]
    if _findable(top):  # a package that exists, without the submodule asked for
        folder = _users_folder(top)
        rest = missing.split(".")[1:]
        create = f"create {relative_path(str(Path(folder, *rest).with_suffix('.py')))} or " if folder and rest else ""
        return ConfigError(
            f"{head}: '{missing}', imported at {at}, does not exist",
            hint=f"{create}correct the import at {at}",
        )
    package = PIP_NAMES.get(top, top)
    return ConfigError(
        f"{head}: '{missing}', imported at {at}, is not installed",
        hint=f"install it where kiln runs ({sys.executable} -m pip install {package}), or remove the import at {at}",
    )


def _users_folder(top: str) -> Path | None:
    """The folder of the top-level package ``top`` when it is the user's own (not installed, not Kiln's), else None."""
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.origin or not spec.submodule_search_locations or not is_user_file(spec.origin):
        return None
    return Path(spec.origin).parent


def _import_site(exc: BaseException) -> str:
    """Where the import failed in the user's code: a SyntaxError's own position, else the innermost user frame."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frame = user_frame(exc)
    return f" (in {where(frame)})" if frame is not None else ""


def build_model(ref: str, params: dict[str, Any] | None = None) -> nn.Module:
    from torch import nn

    return _call_factory(ref, MODELS, "model", params, nn.Module, "return a torch.nn.Module from the factory")


def load_dataset(
    ref: str, params: dict[str, Any] | None = None, dynamic: dict[str, dict[int, str]] | None = None
) -> DatasetSplits:
    """The data function's splits, checked against the dataset contract (:func:`kiln.core.data.check_splits`);
    ``dynamic``: signature.dynamic_axes, whose axes may differ in size between the splits."""
    from kiln.core.data import DatasetSplits, check_splits

    data = _call_factory(
        ref,
        DATASETS,
        "dataset",
        params,
        DatasetSplits,
        "return kiln.DatasetSplits(train_x, train_y, val_x, val_y, num_classes)",
    )
    check_splits(data, ref, dynamic)
    if data.name == "dataset":  # unnamed: messages name the function that made it
        data.name = ref
    return data
