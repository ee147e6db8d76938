"""``kiln``: thin click commands over :mod:`kiln.pipeline.api`. No logic lives here beyond parsing and printing.

A command imports what it runs when it runs (the pipeline, a stage's direct mode, the server): ``kiln --help``,
``kiln config`` and a config's error load neither torch nor ONNX, and help loads neither YAML nor rich, which only
the commands that print through them import (``tests/kiln/test_cli_imports.py``)."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.core import interrupt
from kiln.core.errors import (
    ConfigError,
    GateFailure,
    Interrupted,
    KilnError,
    ModelError,
    StorageError,
    disk_full,
    storage_error,
)
from kiln.core.logs import SaidOnce
from kiln.core.ownership import claim_folder, output_file, record_owned, refuse_link, scratch_root
from kiln.pipeline.stage_list import STAGE_NAMES, stage_named
from kiln.stages.engines import BACKEND_NAMES

if TYPE_CHECKING:  # the config schema (pydantic, every stage's settings) loads when a command reads a config
    from rich.console import Console
    from rich.table import Table

    from kiln.pipeline.config import KilnConfig


def _width(stream: Any) -> int | None:
    """Rich draws for 80 columns where a stream is no terminal (a pipe, a file, a CI log) and cuts a wider table
    there; 200 then, so a piped answer is whole. A terminal, or COLUMNS, keeps its own width."""
    return None if os.environ.get("COLUMNS") or getattr(stream, "isatty", lambda: False)() else 200


def _discard(stream: Any) -> None:
    """What is still written to ``stream``, whose reader went away (`kiln run | head -2`), goes to the null
    device: no BrokenPipeError later, nor at exit when Python flushes it (Python's note on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file (a test's capture): nothing to redirect
        pass


@functools.cache
def _console_class() -> type[Console]:
    """Rich's console, subclassed on first use: rich is imported by the commands that print through it, not by
    ``kiln --help`` (``tests/kiln/test_cli_imports.py``)."""
    from rich.console import Console

    class _Console(Console):
        """A console whose reader may go away: `kiln run | head -2` keeps the lines it wanted and the command runs
        to its own end (its exit code, its error on stderr), where rich's own would exit 1 at once, saying nothing."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            _discard(self.file)

        def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
            """Rich's print; on a stderr that is no terminal (a pipe, a CI log), one message is one line, as the log
            lines are (:class:`_PlainHandler`), where rich would wrap it at 80 columns and break grep."""
            if soft_wrap is None and self.stderr and not self.is_terminal:
                soft_wrap = True
            super().print(*objects, soft_wrap=soft_wrap, **kwargs)

    return _Console


def _kept(name: str, make: Callable[[], Console]) -> Console:
    """The module attribute ``name``, made on first use and kept there, where a test may put a console of its own."""
    if name not in globals():
        globals()[name] = make()
    return globals()[name]


def _console() -> Console:
    """Logs, progress, errors (one line a message where piped: ``_Console.print``): ``kiln.cli.console``."""
    return _kept("console", lambda: _console_class()(stderr=True))


def _results() -> Console:
    """What a command answers: tables, JSON, the paths it wrote (stdout: `kiln run | tee` keeps it):
    ``kiln.cli.results``."""
    return _kept("results", lambda: _console_class()(width=_width(sys.stdout)))


def __getattr__(name: str) -> Any:
    """``console`` and ``results``, the two consoles, made when first read (PEP 562)."""
    made = {"console": _console, "results": _results}.get(name)
    if made is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return made()


def escape(text: str) -> str:
    """``text`` with rich's markup escaped: messages quote shapes like [batch, 3, 8, 8], which rich would take for
    markup and drop."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _answer(text: str, nl: bool = True) -> None:
    """``text`` on stdout, which may have been closed by its reader (`kiln config | head -3`): then dropped."""
    try:
        click.echo(text, nl=nl)
    except BrokenPipeError:
        _discard(sys.stdout)


STATUS_STYLE = {"ran": "green", "cached": "cyan", "skipped": "yellow", "failed": "bold red", "not-run": "dim"}


EXIT_CODES = (
    "Exit codes: 0 success; 2 a problem you can fix (bad config, input or disk: one `error:` and one "
    "`fix:` line); 3 a validation gate failed (the engine is not as accurate or fast as configured); 130 "
    "interrupted (Ctrl-C); 143 stopped by SIGTERM (`timeout`, `kill`, CI, `docker stop`)."
)


class UsageMistake(click.ClickException):
    """A mistake in the command line itself (an option's value out of range, an unknown option or command), said
    as every other mistake is: one ``error:`` line, one ``fix:`` line, exit 2."""

    exit_code = 2

    def __init__(self, message: str, command: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.command = command
        self.hint = hint

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)
        click.echo(f"fix: {self.hint or f'see `{self.command} --help` for its arguments and options'}", err=True)


# An output option users bring from the commands that write one file or folder (`kiln build -o`), given to a
# command that writes into a workdir instead
OUTPUT_OPTIONS = ("'-o'", "'--output'", "'--out'")


def _usage(exc: click.UsageError, fallback: str) -> UsageMistake:
    command = exc.ctx.command_path if exc.ctx is not None else fallback
    message = exc.format_message()
    takes = {o for p in (exc.ctx.command.params if exc.ctx is not None else []) for o in p.opts}
    if "--workdir" in takes and "-o" not in takes and any(f"No such option {o}" in message for o in OUTPUT_OPTIONS):
        return UsageMistake(message, command, f"`{command}` writes into a workdir: -w DIR (--workdir DIR)")
    return UsageMistake(message, command)


INTERRUPTED = Interrupted(
    "interrupted (Ctrl-C)",
    hint="run the same command again: what it finished is kept (`kiln run` resumes after its finished stages)",
)


class Terminated(Interrupted):
    """SIGTERM: exit 143 (128 + 15), as a shell reports a command SIGTERM stopped."""

    exit_code = 143


TERMINATED = Terminated(
    "stopped by SIGTERM (what `timeout`, `kill`, CI runners and `docker stop` send)",
    hint="run the same command again, with more time if a time limit sent it: what it finished is kept (`kiln run` "
    "resumes after its finished stages)",
)


# What a stopped command kept, where it is not what `kiln run` keeps: its own fix line
STOPPED_HINTS = {
    "loadtest": "run `kiln loadtest` again: it writes loadtest.json only once its last concurrency level finishes, "
    "so this run kept nothing (fewer --concurrency levels or a shorter --duration finish sooner)",
}


def stopped(command: str | None, by_sigterm: bool) -> Interrupted:
    """The error for ``kiln COMMAND`` stopped by Ctrl-C or SIGTERM: the command's own fix where what it kept differs
    from the resume that the shared fix line describes (:data:`STOPPED_HINTS`)."""
    shared = TERMINATED if by_sigterm else INTERRUPTED
    hint = STOPPED_HINTS.get(command or "")
    return shared if hint is None else type(shared)(shared.message, hint=hint)


class KilnCommand(click.Command):
    """Turns :class:`KilnError` into a clean message and exit code instead of a traceback."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["epilog"] = kwargs.get("epilog") or EXIT_CODES
        super().__init__(*args, **kwargs)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _usage(exc, f"kiln {info_name}") from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with interrupt.handled():
                _check_cwd(self, ctx)
                return super().invoke(ctx)
        except click.UsageError as exc:
            raise _usage(exc, ctx.command_path) from None
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (core/interrupt.py)
            _fail(ctx, stopped(ctx.info_name, interrupt.by_sigterm()))
        except SystemExit as exc:  # sys.exit() in code Kiln called (a metric, a loss): never a silent end
            from kiln.core.user_errors import user_exit_error

            _fail(ctx, user_exit_error(exc, f"running `kiln {ctx.info_name}`"))
        except KilnError as exc:
            _fail(ctx, disk_full(exc, _written(ctx)) or exc)
        except OSError as exc:  # a disk or folder problem anywhere (read-only -o, disk full): the same two lines
            logging.getLogger("kiln").debug("OS error", exc_info=True)
            _fail(ctx, _cwd_gone() or storage_error(exc))
        except MemoryError:
            logging.getLogger("kiln").debug("out of memory", exc_info=True)
            _fail(
                ctx,
                KilnError(
                    "out of memory",
                    hint="use smaller batch sizes (signature.batch_sizes, train.batch_size) or a smaller model",
                ),
            )
        except Exception as exc:  # a library's own error for a full disk (torch.save's RuntimeError); else a bug
            full = disk_full(exc, _written(ctx))
            if full is None:
                raise
            _fail(ctx, full)


def _written(ctx: click.Context) -> str:
    """Where the command writes (its -o, else its workdir), to name in a disk-full error."""
    return str(ctx.params.get("output") or ctx.params.get("workdir") or "its output")


def _cwd() -> Path | None:
    """The current folder, or None when it was deleted under this process (``os.getcwd`` then raises)."""
    try:
        return Path.cwd()
    except FileNotFoundError:
        return None


def _check_cwd(command: click.Command, ctx: click.Context) -> None:
    """With the current folder deleted under this process, a command whose paths are all absolute still runs (from
    ``/``: libraries such as torch fail to load without a current folder); one given a relative path (the default
    ``kiln-out`` included) stops with the reason."""
    if _cwd() is not None:
        CWD_GONE.clear()
        return
    relative = [
        f"{p.opts[0] if p.opts else p.name} {value}"
        for p in command.params
        if isinstance(p.type, click.Path) and p.name != "workdir"  # --workdir: checked where a run uses it
        for value in [ctx.params.get(p.name or "")]
        if isinstance(value, str) and not Path(value).is_absolute()
    ]
    if relative:
        _refuse_relative(relative)
    CWD_GONE.append(True)
    os.chdir("/")


CWD_GONE: list[bool] = []  # set when this process's current folder was deleted (then it runs from /)


def _refuse_relative(paths: list[str]) -> None:
    gone = _cwd_gone() or StorageError("the current folder no longer exists", hint="cd into an existing folder")
    raise StorageError(f"{gone.message}: {', '.join(paths)}", hint=gone.hint)


def _cwd_gone() -> KilnError | None:
    """Why a relative path failed when the current folder no longer exists: the true cause, not "no such file"."""
    if _cwd() is not None and not CWD_GONE:
        return None
    shown = f" {os.environ['PWD']}" if os.environ.get("PWD") else ""
    return StorageError(
        f"the current folder{shown} no longer exists (deleted while this shell was in it), so relative paths "
        "cannot be resolved",
        hint="cd into an existing folder, or give absolute paths (config, --workdir, -o)",
    )


def _fail(ctx: click.Context, exc: KilnError) -> None:
    detail = getattr(exc, "detail", "")  # the user's code's traceback (UserCodeError): with --verbose only
    if detail and ctx.params.get("verbose"):
        _console().print(detail.rstrip(), highlight=False, soft_wrap=True, markup=False)
    # escape: messages quote shapes like [batch, 3, 8, 8], which rich would take for markup and drop
    _console().print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
    if exc.hint:
        _console().print(f"[bold]fix:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
    ctx.exit(exc.exit_code)


class KilnGroup(click.Group):
    command_class = KilnCommand

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _usage(exc, "kiln") from None

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise _usage(exc, "kiln") from None


# Libraries' messages that say nothing a Kiln user can act on; shown with --verbose only. onnxconverter-common
# warns once per constant it clips to the FP16 range (the precision stage reports what it keeps in FP32); ORT's
# transformer optimizer expects its own exporters' producer name, not torch's.
# Known noise, shown with --verbose only: the FP16 converter's clamping note, ORT's transformer optimizer on graphs
# not exported by its own tools (its symbolic shape inference gives up; the fusions that need it are skipped), and
# quantize_static's advice to run ORT's pre-processing (Kiln infers shapes itself before quantizing), and two of
# torch's own: its program loader on any channels_last weight (a torch engine of a CNN; the loaded engine's
# outputs are checked in validation and in the torch engine tests, on CPU and GPU) and a deprecation inside its
# AOTInductor code; and torch.export's note on nn.RNN/GRU/LSTM's own weight list (torch's module, not the user's).
THIRD_PARTY_NOISE = (
    "will be truncated to",
    "Model producer not matched",
    "symbolic shape inference disabled or failed",
    "consider to run pre-processing",
    "No complete tensor found in the group",
    "isinstance(treespec, LeafSpec)` is deprecated",
    "._flat_weights[",
    "The PyTorch API of nested tensors is in prototype stage",  # nn.TransformerEncoder's own eval fast path
    "Expected bias '",  # quantize_static on a bias computed in the graph: that bias stays float, the rest is quantized
)
THIRD_PARTY_LOGGERS = ("py.warnings", "onnxruntime", "onnxconverter_common", "onnx_graphsurgeon")


class _ThirdParty(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":  # "file:line: Category: text\n  source line": keep "Category: text"
            found = re.match(r"^.*?:\d+: (\w+): (.*?)\n", record.getMessage(), re.S)
            if found:
                record.msg, record.args = f"{found.group(1)}: {found.group(2)}", ()
        if not record.name.startswith("kiln") and any(n in record.getMessage() for n in THIRD_PARTY_NOISE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record.levelno >= self.level

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level


class _PlainHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines where stderr is a file or a pipe (a server's log, CI): one line per message, ``LEVEL message``,
    where rich's handler pads every line to the width and wraps a message over several (80 columns when piped),
    which breaks grep and one-record-per-line log collectors. Writes to the ``sys.stderr`` of the moment."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; the current sys.stderr is used instead
        pass


def _setup_logging(quiet: bool, verbose: int) -> None:
    """Kiln's log lines, and the libraries' (warnings.warn and their loggers), through one handler: nothing
    raw on stderr, and known noise demoted to debug. Warnings and errors by default (the progress bars and the
    answer say the rest); ``-v`` each stage's log lines, ``-vv`` debug logging, the libraries' included."""
    from rich.logging import RichHandler

    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    handler: logging.Handler = (
        RichHandler(console=_console(), show_path=False, show_time=False, markup=False)
        if _console().is_terminal
        else _PlainHandler()
    )
    handler.addFilter(_ThirdParty(level))
    handler.addFilter(SaidOnce())  # also for the commands on one file, which run stage code outside a run
    logger = logging.getLogger("kiln")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    logging.captureWarnings(True)
    for name in THIRD_PARTY_LOGGERS:
        other = logging.getLogger(name)
        other.handlers[:] = [handler]
        other.setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)
        other.propagate = False
    # Every other library's warnings reach the root logger. It gets the same handler (replacing one an earlier
    # call added; a test runner's own handlers stay): without one, the first module-level logging.warning() (ONNX
    # Runtime's quantize_static has one) runs logging.basicConfig, and from then on every library's warnings print
    # raw as "WARNING:fusion_skiplayernorm:..." on stderr.
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "kiln", False)]
    handler.kiln = True  # type: ignore[attr-defined]
    root.addHandler(handler)


def _parse_sets(sets: tuple[str, ...]) -> dict[str, Any]:
    """Each ``--set key=value``, typed by the config schema, not by YAML's guesses (a value that is not YAML is
    set_value's error, naming the --set, with its own fix)."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"'{item}' is not KEY=VALUE", param_hint="--set")
        from kiln.pipeline.config import set_value

        out[key] = set_value(key, value)
    return out


def _given(sets: tuple[str, ...]) -> dict[str, str]:
    """Each --set's key -> the --set as typed: a config error in its value names it, not the config file."""
    return {item.partition("=")[0]: f"--set {item}" for item in sets}


# What Kiln and the libraries it loads import by top-level name, besides Python's own modules (every one of which
# may be imported late: statistics for timing, profile, queue, csv...): a user's file of such a name, in a folder
# put first on the import path for the user's code, would be imported in its place (a project's `onnx.py`)
KILN_IMPORTS = frozenset({
    "torch", "torchgen", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "onnx_graphsurgeon", "onnxconverter_common",
    "numpy", "ml_dtypes", "yaml", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "rich", "click",
    "safetensors", "sklearn", "matplotlib", "mpl_toolkits", "PIL", "cycler", "kiwisolver", "fontTools", "pyparsing",
    "dateutil", "psutil", "filelock", "tensorrt", "tensorrt_rtx", "tritonclient", "pytriton", "ray", "triton",
    "sympy", "mpmath", "jinja2", "networkx", "fsspec", "packaging", "tqdm", "typing_extensions", "google",
})  # fmt: skip
# Python modules no part of Kiln or its libraries imports, and common names of a project's own files
NEVER_IMPORTED = frozenset({"test", "this", "antigravity", "turtle", "turtledemo", "idlelib", "tkinter", "__main__"})


def _importable(*folders: Path) -> None:
    """User code named by import path (``model.name: mymodels:build``) resolves from the config's folder, then the
    current folder, as ``python -m`` would, before PYTHONPATH. Kiln installs one package, ``kiln``, so a project's
    own ``models/`` or ``pipeline/`` folder resolves as the user's; a file there named like a module Kiln may
    import is refused (:func:`_hides_a_library`)."""
    entries = list(dict.fromkeys(str(f.resolve()) for f in folders))
    for entry in entries:
        _hides_a_library(Path(entry))
    for entry in reversed(entries):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)


def _hides_a_library(folder: Path) -> None:
    """A module or package in ``folder`` named like one Kiln or its libraries may import (:data:`KILN_IMPORTS`,
    Python's own modules) and not that module itself (an editable install's source folder is): an error naming it,
    before it breaks an import deep in a run. One listing of the folder."""
    try:
        entries = list(folder.iterdir())
    except OSError:  # not listable: Python cannot import from it either
        return
    protected = (KILN_IMPORTS | sys.stdlib_module_names) - NEVER_IMPORTED
    for entry in entries:
        name = entry.stem if entry.suffix == ".py" else entry.name
        if name not in protected:
            continue
        mine = entry if entry.suffix == ".py" else entry / "__init__.py"
        if not mine.is_file() or _is_the_installed(name, mine, folder):
            continue
        shown = mine if mine.name != "__init__.py" else mine.parent
        raise ConfigError(
            f"{shown} would be imported in place of the {name} module Kiln uses: {folder} is on the import path "
            "for your code (the config's folder and the one kiln runs in)",
            hint=f"rename {shown.name} (and the imports of it in your code)",
        )


def _is_the_installed(name: str, mine: Path, folder: Path) -> bool:
    """Whether ``name`` as installed is ``mine`` itself: a package developed in its own checkout, installed from it
    (through the path, or an editable install's own finder)."""
    import importlib.machinery

    path = [p for p in sys.path if p and Path(p).resolve() != folder]
    finders = [f for f in sys.meta_path if f is not importlib.machinery.PathFinder and hasattr(f, "find_spec")]
    for finder in [importlib.machinery.PathFinder, *finders]:
        try:
            spec = finder.find_spec(name, path if finder is importlib.machinery.PathFinder else None)
        except Exception:  # a third-party finder's own trouble: not ours to judge
            continue
        if spec is not None and spec.origin and Path(spec.origin).resolve() == mine.resolve():
            return True
    return False


def _load(path: str | None, overrides: dict[str, Any], given: dict[str, str] | None = None) -> KilnConfig:
    cwd = _cwd()  # None: deleted under us; absolute paths still work
    folders = [*([Path(path).parent] if path else []), *([cwd] if cwd else [])]
    _importable(*folders)
    from kiln.pipeline.config import load_config

    config = load_config(path, overrides, given)
    _said_twice(config, folders)
    return config


def _import_paths(value: Any) -> list[str]:
    """Every ``package.module:function`` string in a dumped config."""
    if isinstance(value, dict):
        return [r for v in value.values() for r in _import_paths(v)]
    if isinstance(value, list):
        return [r for v in value for r in _import_paths(v)]
    return [value] if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value) else []


def _said_twice(config: KilnConfig, folders: list[Path]) -> None:
    """A warning where the top-level module of an import path in the config is in both the config's folder and the
    current one: the config's is used (a `models` package in each of two projects)."""
    places = list(dict.fromkeys(f.resolve() for f in folders))
    if len(places) < 2:
        return
    for top in dict.fromkeys(r.partition(":")[0].split(".")[0] for r in _import_paths(config.dump())):
        found = [p for p in places if (p / f"{top}.py").is_file() or (p / top / "__init__.py").is_file()]
        if len(found) > 1:
            logging.getLogger("kiln").warning(
                "%s is in both %s (the config's folder: used) and %s", top, found[0], found[1]
            )


def _config(path: str | None, sets: tuple[str, ...]) -> KilnConfig:
    return _load(path, _parse_sets(sets), _given(sets))


STAGES_HELP = " -> ".join(STAGE_NAMES)
# The options every stage command takes: (declarations, attributes), made into parameters or decorators below
CONFIG = (
    ("--config", "-c", "config_option"),
    {
        "type": click.Path(dir_okay=False),
        "help": "run config (YAML/TOML/JSON); the same as giving CONFIG (default: the built-in demo)",
    },
)
WORKDIR = (
    ("--workdir", "-w"),
    {
        "default": "kiln-out",
        "show_default": True,
        "type": click.Path(file_okay=False),
        "help": "folder holding every stage's artifacts, the cache and the report",
    },
)
SET = (
    ("--set", "sets"),
    {
        "multiple": True,
        "metavar": "KEY=VALUE",
        "help": "override a config value, e.g. --set train.epochs=2 (repeatable)",
    },
)
QUIET = (
    ("--quiet", "-q"),
    {
        "is_flag": True,
        "help": "only warnings and errors: no progress, no summary (`kiln validate ENGINE` still prints its JSON)",
    },
)
VERBOSE = (
    ("--verbose", "-v"),
    {"count": True, "help": "more output: -v each stage's log lines, -vv debug logging (the libraries' too)"},
)


def _option(spec: tuple[tuple[str, ...], dict[str, Any]]) -> click.Option:
    return click.Option(list(spec[0]), **spec[1])


config_arg = click.argument("config", required=False, type=click.Path(dir_okay=False))
config_opt = click.option(*CONFIG[0], **CONFIG[1])


def _one_config(*given: str | None) -> str | None:
    """CONFIG as a positional argument or as -c/--config, the same in every command."""
    named = {g for g in given if g}
    if len(named) > 1:
        raise click.UsageError(f"two configs given ({', '.join(sorted(named))}): pass one, as CONFIG or -c")
    return next(iter(named), None)


def _model_or_config(path: str | None, config: str | None) -> tuple[str | None, str | None]:
    """``kiln optimize kiln.yaml`` (or build/validate): a config file where the MODEL/ENGINE goes is the config,
    and the command runs in the workdir, as `kiln run kiln.yaml` would."""
    from kiln.pipeline.config import CONFIG_SUFFIXES

    if path and Path(path).suffix.lower() in CONFIG_SUFFIXES:
        return None, _one_config(path, config)
    return path, config


workdir_opt = click.option(*WORKDIR[0], **WORKDIR[1])
set_opt = click.option(*SET[0], **SET[1])
quiet_opt = click.option(*QUIET[0], **QUIET[1])
verbose_opt = click.option(*VERBOSE[0], **VERBOSE[1])


@click.group(cls=KilnGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(package_name="kiln")
def main() -> None:
    """Kiln: turn a PyTorch model into a validated, serving-ready inference engine.

    Stages: train -> export -> optimize -> precision -> build -> validate -> package.
    `kiln run` runs them all (cached, resumable); each stage also has its own command.
    Every command takes its run config as CONFIG or -c/--config.
    """


def _say_what_changed(records: list[Any]) -> None:
    """The first stage run again because its own inputs changed (the config, the user's code or data; the stages
    after it ran because it did), and what changed: a rerun nobody expected says why without -v."""
    for r in records:
        own = [part for part in getattr(r, "changed", []) if not part.startswith("inputs")]
        if r.status == "ran" and own:
            _console().print(f"{escape(r.name)} ran again: changed since the last run: {escape(', '.join(own))}")
            return


def _print_summary(result: Any, report: dict[str, Any], workdir: Path) -> None:
    """The run's answer on stdout, within 80 columns: each stage's status and time, each engine's accuracy against
    the reference, then its latency at the largest batch size."""
    from rich.table import Table

    from kiln.pipeline.report import fmt as _fmt
    from kiln.pipeline.report import result_line, seconds_cell, validation_of

    table = Table(title="Kiln run", show_edge=False)
    for col in ("stage", "status", "seconds"):
        table.add_column(col, no_wrap=True)
    stages = report.get("stages", {})
    for r in result.records:
        style = STATUS_STYLE.get(r.status, "")
        seconds = seconds_cell(stages[r.name]) if r.name in stages else f"{r.seconds:.2f}"
        table.add_row(r.name, f"[{style}]{r.status}[/]", seconds)
    _results().print(table)
    if "wall_seconds" in report:  # the rows leave out the cache checks (the first loads the data)
        _results().print(
            f"{report['wall_seconds']:.2f} s in all, {report.get('check_seconds', 0.0):.2f} s of it checking which "
            "stages are cached"
        )
    _say_what_changed(result.records)
    v = validation_of(report)
    if v:
        _results().print(_accuracy_table(v, _fmt))
        _results().print(_latency_table(v))
        _print_unvalidated(v.engines)
    # the precision stage's outcome where this command ran it (or found it cached): a one-stage command before it
    # (kiln export) does not repeat an earlier run's
    ran = any(r.name == "precision" and r.status != "not-run" for r in result.records)
    precision = report.get("stages", {}).get("precision", {}).get("summary", {}) if ran else {}
    for name, why in precision.get("failed", {}).items():
        # a variant its gates or its share of low-precision compute left unmade is an outcome, not a failure
        said = (
            "[yellow]precision variant {} not made[/]"
            if why.startswith(f"{name} not made")
            else "[bold red]precision variant {} failed[/]"
        )
        _console().print(f"{said.format(escape(name))}, the others were built: {escape(why)}")
    # sentences wrap between words at the console's width (80 columns in a pipe or a log); a path stays one line
    _results().print(f"result: {escape(result_line(report))}", highlight=False)
    _results().print(f"report: {workdir / 'report.md'}", highlight=False, soft_wrap=True)


def _print_unvalidated(engines: list[Any]) -> None:
    """Which engine could not be validated here for which reason, one line per reason, where the engines differ in
    it: the result line names them all with their reasons, so one shared reason is said once, there."""
    groups: dict[tuple[str, str], list[str]] = {}
    for e in engines:
        if e.status != "validated":
            groups.setdefault((e.device.upper(), e.reason or ""), []).append(e.name)
    if len(groups) < 2:
        return
    for (device, reason), names in groups.items():
        _console().print(
            f"[yellow]{escape(', '.join(names))}[/]: built for {escape(device)}, not validated here: {escape(reason)}"
        )


def _accuracy_table(v: Any, fmt: Callable[..., str]) -> Table:
    """Each engine's agreement with the reference and its task accuracy, then validate.metric's value where set. A
    metric named like a column before it (``validate.metric: accuracy``) is headed ``metric:`` above its name, so
    no two columns read alike (on two lines: the table stays within 80 columns)."""
    from rich.table import Table

    table = Table(title="Accuracy against the reference", show_edge=False)
    metric = v.baseline.metric_name  # validate.metric: the user's own number, beside the built-in ones
    # a multi-label head's class logits are held to decision agreement, as report.md heads it
    agree = "decision" if any(getattr(e, "agreement", "top1") == "decision" for e in v.engines) else "top-1"
    columns = ("engine", "passed", "cosine", agree, "accuracy")
    own_column = [f"metric:\n{metric}" if metric in columns else metric] if metric else []
    for col in (*columns, *own_column):
        table.add_column(col, no_wrap=True)

    decimals = _metric_decimals(v)

    def own(value: Any) -> list[str]:
        return [value if isinstance(value, str) else _metric_cell(value, decimals)] if metric else []

    table.add_row("reference", "", "", "", fmt(v.baseline.accuracy), *own(v.baseline.metric))
    for e in v.engines:
        if e.status != "validated":
            table.add_row(e.name, "[yellow]not run[/]", "", "", "", *own(""))
            continue
        passed = "[green]yes[/]" if e.passed else "[bold red]no[/]"
        table.add_row(e.name, passed, fmt(e.cosine, ".6f"), fmt(e.top1_agreement), fmt(e.accuracy), *own(e.metric))
    return table


def _metric_decimals(v: Any) -> int:
    """The decimals validate.metric's column needs to resolve its gate: one more than ``max_metric_drop`` (the
    smallest among the engines) has, or than its share of the reference's value (a relative gate), at most 8; so
    an engine the gate fails never prints the reference's number (362 beside 362 for a rise of 0.02 at a gate of
    0.01)."""
    gates = [e.gates.get("max_metric_drop") for e in v.engines if getattr(e, "gates", None)]
    gates = [g for g in gates if isinstance(g, (int, float)) and g > 0]
    if not gates:
        return 0
    ref = v.baseline.metric
    scale = abs(ref) if isinstance(ref, (int, float)) and ref else 1.0
    resolution = min(gates) * min(1.0, scale)
    return max(0, min(8, math.ceil(-math.log10(resolution)) + 1))


def _metric_cell(value: float | None, decimals: int) -> str:
    """A metric's value with 4 significant digits, or more where ``decimals`` after the point need them."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return format(value, ".4g")
    whole = math.floor(math.log10(abs(value))) + 1 if value else 1
    return format(value, f".{max(4, whole + decimals)}g")


def _latency_table(v: Any) -> Table:
    from rich.table import Table

    largest = str(max(int(s) for x in [v.baseline, *v.baselines, *v.engines] for s in x.latency_ms))
    busy = " (machine too busy to time: see report.md)" if getattr(v, "timing", {}).get("busy") else ""
    table = Table(title=f"Latency at batch {largest}{busy}", show_edge=False)
    for col in ("engine", "p50 ms (95% interval)", "speedup", ""):
        table.add_column(col, no_wrap=True)
    for b in v.baselines or [v.baseline]:
        lat = b.latency_ms.get(largest)
        label = "onnxruntime (input ONNX file)" if b.backend == "onnxruntime" else f"pytorch {b.label}"
        table.add_row(label, _latency_cell(lat), "1.00", "")
    for e in v.engines:
        if e.status == "validated" and largest in e.latency_ms:
            ci = e.speedup_ci.get(f"eager-{e.device}", {}).get(largest)
            speedup = _speedup_cell(e.speedup_vs_baseline.get(largest), ci, e.device)
            chosen = "[bold]chosen[/]" if v.chosen.get(largest) == e.name else ""
            table.add_row(e.name, _latency_cell(e.latency_ms[largest]), speedup, chosen)
    return table


# a speedup's 95 % interval wider than this factor (high / low): the point says nothing, the interval is shown
WIDE_SPEEDUP = 2.0


def _speedup_cell(speed: float | None, ci: Any, device: str) -> str:
    """``2.10x vs cpu``; where its interval spans more than :data:`WIDE_SPEEDUP` (a baseline whose rounds a busy
    machine split between two speeds), the interval in its place: a point within it would be a guess."""
    if not speed:
        return "-"
    if ci and ci[0] > 0 and ci[1] / ci[0] > WIDE_SPEEDUP:
        low, high = (f"{x:.3g}" if x < 1000 else f"{x:.0f}" for x in ci)
        return f"{low}-{high}x vs {device}"
    return f"{speed:.2f}x vs {device}"


def _latency_cell(p: Any) -> str:
    if p is None:
        return "-"
    return f"{p.p50:.3f} ({p.ci95[0]:.3g}-{p.ci95[1]:.3g})" if p.ci95 else f"{p.p50:.3f}"


def _run(config: KilnConfig, workdir: str, quiet: bool, **kw: Any) -> None:
    from kiln.core.progress import RichProgress, SilentProgress
    from kiln.pipeline.api import run_pipeline

    if CWD_GONE and not Path(workdir).is_absolute():
        _refuse_relative([f"--workdir {workdir}"])
    _refuse_torchrun()
    # Bars only on a terminal: piped or logged, a transient bar leaves a blank line behind per task.
    progress = RichProgress(_console()) if _console().is_terminal and not quiet else SilentProgress()
    result, report = run_pipeline(config, workdir, progress=progress, **kw)
    if not quiet:
        _print_summary(result, report, Path(workdir))
    if result.error is not None:  # one error/fix pair; the stages before it are kept (docs/stages.md)
        raise result.error


@main.command()
@config_arg
@config_opt
@workdir_opt
@set_opt
@click.option(
    "--force",
    multiple=True,
    metavar="STAGE",
    help=f"rerun this stage even if cached (repeatable); stages: {STAGES_HELP}",
)
@click.option("--from", "start", metavar="STAGE", help=f"rerun from this stage on; stages: {STAGES_HELP}")
@click.option("--until", "stop", metavar="STAGE", help=f"stop after this stage; stages: {STAGES_HELP}")
@quiet_opt
@verbose_opt
def run(
    config: str | None,
    config_option: str | None,
    workdir: str,
    sets: tuple[str, ...],
    force: tuple[str, ...],
    start: str | None,
    stop: str | None,
    quiet: bool,
    verbose: int,
) -> None:
    """Run the whole pipeline. Without CONFIG: the built-in demo (a CNN on scikit-learn's digits)."""
    _setup_logging(quiet, verbose)
    path = _one_config(config, config_option)
    cfg = _config(path, sets)
    _refuse_demo_over(path, cfg, workdir)
    _run(cfg, workdir, quiet, force=set(force), start=start, stop=stop)


@main.command("config")
@config_arg
@config_opt
@set_opt
def show_config(config: str | None, config_option: str | None, sets: tuple[str, ...]) -> None:
    """Print the resolved config (defaults filled in) as YAML: a starting point for your own."""
    import yaml

    _answer(yaml.safe_dump(_config(_one_config(config, config_option), sets).dump(), sort_keys=False), nl=False)


def _refuse_direct_options(what: str, *names: str) -> None:
    """Direct-mode options given without the file they apply to would be silently ignored: refuse instead."""
    ctx = click.get_current_context()
    given = [
        f"--{n.replace('_', '-').rstrip('-')}"
        for n in names
        if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: direct-mode option{'s' if len(given) > 1 else ''}, give {what} "
            f"too (without it, `kiln {ctx.info_name}` runs the stage inside --workdir)"
        )


def _stage_in_workdir(stage: str, config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Run one stage inside a run's workdir, from its upstream artifacts, even if cached."""
    cfg = _config(config, sets)
    _refuse_demo_over(config, cfg, workdir)
    _run(cfg, workdir, quiet, only=[stage], force={stage})


def _refuse_torchrun() -> None:
    """Kiln under ``torchrun``: each of its processes would run the whole command into one workdir. Kiln starts
    torchrun itself for a multi-process training (``train.distributed.nproc_per_node``)."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    raise ConfigError(
        f"kiln was started by torchrun (WORLD_SIZE={world}): every process would run the whole command in one workdir",
        hint="run kiln alone with --set train.distributed.nproc_per_node=N (Kiln starts torchrun for training), "
        "or start the worker under torchrun yourself: python -m kiln.stages.train.worker (docs/training.md)",
    )


def _refuse_demo_over(path: str | None, config: KilnConfig, workdir: str) -> None:
    """Without a config a command runs the built-in demo: in a workdir holding the run of another config (its
    report names it; a run stopped before its report: its stages' manifests record another model), that would
    replace the run's stages with the demo's, the trained weights too."""
    if path is not None:
        return
    other = _other_run(Path(workdir), config)
    if other is None:
        return
    command = f"kiln {click.get_current_context().info_name}"
    here = next((f.name for f in sorted(Path().glob("kiln.*")) if f.suffix in (".yaml", ".yml", ".toml")), None)
    raise ConfigError(
        f"workdir {workdir} holds the run of {other}; without a config, `{command}` runs the built-in demo, which "
        "would replace it",
        hint=f"give that run's config (`{command} {here or 'CONFIG'}`), or -w another folder for the demo",
    )


def _other_run(workdir: Path, config: KilnConfig) -> str | None:
    """What run of another config ``workdir`` holds ("config 'mine'", "model 'net:build'"), or None. Its report names
    its config by ``name:``; a config that sets none has the default name, which tells no config apart (and the
    workdir records no config file): that run is "another config", with the model its stages' manifests record."""
    import json

    try:
        name = json.loads((workdir / "report.json").read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        name = None
    unnamed = type(config).model_fields["name"].default
    if isinstance(name, str) and name != unnamed:
        return f"config '{name}'" if name != config.name else None
    if isinstance(name, str) and name != config.name:  # another config's run, which sets no name
        model = _recorded_model(workdir, None)
        return "another config" + (f" (model '{model}')" if model else "")
    model = _recorded_model(workdir, config.model.model_dump(mode="json"))
    return f"model '{model}'" if model else None


def _recorded_model(workdir: Path, unlike: dict[str, Any] | None) -> str | None:
    """The model (its import path, or ONNX file) the first of ``workdir``'s stage manifests records, of those whose
    model is not ``unlike`` (a config's ``model`` section as JSON; None: any); None where none records one."""
    import json

    for manifest in sorted(workdir.glob("*/manifest.json")):
        try:
            model = json.loads(manifest.read_text())["key_parts"]["config"]["model"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(model, dict) and model != unlike:
            return str(model.get("name") or model.get("onnx"))
    return None


# ------------------------------------------------------------------------------------------------ stage commands
class _PassesOption(click.Option):
    """``--passes``, whose help names every registered pass: the pass catalog (and the ONNX libraries its passes
    import) loads when that help is shown, not for every command."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from kiln.stages.optimize.catalog import available

        record = super().get_help_record(ctx)
        return None if record is None else (record[0], f"{record[1]}; passes: {', '.join(available())}")


@dataclass(frozen=True)
class Direct:
    """A stage command's direct mode (``kiln build model.onnx -o out/``): its parameters beyond the common ones,
    what selects it (the ``file`` argument, or one of the ``switches`` options), and what it runs with the
    values. Without them the command runs the stage inside the workdir."""

    params: tuple[click.Parameter, ...]
    run: Callable[..., None]  # (file, config path, --set values, **the params' values)
    needs: str  # what the user gives for direct mode (the refusal of its options without it names it)
    file: str | None = None  # a FILE argument: a config file given there is the config instead
    switches: tuple[str, ...] = ()  # with no FILE argument: options that select direct mode
    both: tuple[str, ...] = ()  # options of both modes
    workdir_sets: Callable[[dict[str, Any]], tuple[str, ...]] = lambda values: ()  # what they set in the workdir
    takes_workdir: bool = False  # the direct mode reads the workdir too (export: its trained weights)


def stage_command(name: str, help: str, direct: Direct | None = None) -> click.Command:
    """The command of one stage: CONFIG / -c, --workdir, --set and --quiet, plus its direct mode's parameters."""
    head = list(direct.params) if direct else []
    if direct is None or direct.file is None:
        head.insert(0, click.Argument(["config"], required=False, type=click.Path(dir_okay=False)))
    params = [*head, *map(_option, (CONFIG, WORKDIR, SET, QUIET, VERBOSE))]

    def callback(
        workdir: str, sets: tuple[str, ...], quiet: bool, verbose: int, config_option: str | None, **values: Any
    ) -> None:
        _setup_logging(quiet, verbose)
        if direct is not None and direct.file is not None:
            file, config = _model_or_config(values.pop(direct.file), config_option)
        else:
            file, config = None, _one_config(values.pop("config"), config_option)
        if direct is None or (file is None and all(values.get(s) is None for s in direct.switches)):
            if direct is not None:
                _refuse_direct_options(direct.needs, *(k for k in values if k not in direct.both))
            extra = direct.workdir_sets(values) if direct else ()
            return _stage_in_workdir(name, config, workdir, sets + extra, quiet)
        _results().quiet = quiet and name != "validate"  # validate's JSON is its answer, not a summary
        try:
            direct.run(file, config, sets, **values, **({"workdir": workdir} if direct.takes_workdir else {}))
        finally:
            _results().quiet = False

    return KilnCommand(name, params=params, callback=callback, help=help)


def _export_direct(
    file: None,
    config: str | None,
    sets: tuple[str, ...],
    checkpoint: str | None,
    model_name: str | None,
    input_shape: tuple[str, ...],
    output: str | None,
    workdir: str,
) -> None:
    from kiln.pipeline.runner import settings_for
    from kiln.stages.export.stage import export_direct

    # --model without a config: the demo's data (digits) are not that model's; its own default dataset or
    # --input-shape say what it takes
    model = {"model.name": model_name, **({} if config else {"data.name": None})} if model_name else {}
    cfg = _load(config, {**model, **_parse_sets(sets)}, _given(sets))
    if checkpoint is None and cfg.model.checkpoint is None:
        checkpoint = _trained_in(Path(workdir), cfg.model.name, cfg.model.params)
    dst = Path(output or "model.onnx")
    with scratch_root(dst.parent), output_file(dst) as staged:
        summary = export_direct(settings_for(stage_named("export"), cfg), checkpoint, input_shape, staged)
    _results().print(
        f"wrote {dst} ({summary['nodes']} nodes, parity max abs err {summary['max_abs_err']:.2e})",
        highlight=False,
    )


def _trained_in(workdir: Path, name: str, params: dict[str, Any]) -> str | None:
    """The weights the workdir's train stage wrote for this model (its name and params as the stage recorded
    them), said on stderr: ``kiln export -o`` after ``kiln run`` exports the trained model, not initial weights.
    None where the workdir trained none, or another model."""
    from kiln.core.artifacts import read_manifest

    manifest = read_manifest(workdir / "train") or {}
    recorded = ((manifest.get("key_parts") or {}).get("config") or {}).get("model") or {}
    weights = workdir / "train" / "model.safetensors"
    if recorded.get("name") != name or (recorded.get("params") or {}) != params or not weights.is_file():
        return None
    _console().print(
        f"[yellow]weights[/]: the trained ones in {weights} (the workdir's train stage); --checkpoint FILE exports "
        "others",
        highlight=False,
        soft_wrap=True,
    )
    return str(weights)


def _optimize_direct(
    file: str, config: str | None, sets: tuple[str, ...], output: str | None, passes: str | None
) -> None:
    from kiln.stages.optimize.api import checks_line, optimize_file

    cfg = _config(config, sets + _passes(passes))
    dst = Path(output or Path(file).with_suffix(".opt.onnx"))
    if dst.resolve() == Path(file).resolve():
        raise ModelError(f"refusing to overwrite the input model {file}", hint="choose another -o path")
    with scratch_root(dst.parent), output_file(dst) as staged:
        summary = optimize_file(Path(file), staged, cfg.optimize, dict(cfg.signature.shapes))
    _results().print(
        f"wrote {dst}: {summary.get('nodes_before')} -> {summary.get('nodes_after')} nodes",
        highlight=False,
        soft_wrap=True,
    )
    _results().print(checks_line(summary), highlight=False, markup=False, soft_wrap=True)


def _passes(passes: str | None) -> tuple[str, ...]:
    return (f"optimize.passes={passes.split(',')!r}",) if passes else ()


def _precision_direct(
    file: str,
    config: str | None,
    sets: tuple[str, ...],
    output: str | None,
    variants: str | None,
    calibration: str | None,
) -> None:
    cfg = _config(config, sets)
    wanted = [v.strip() for v in variants.split(",") if v.strip()] if variants else list(cfg.precision.variants)
    from kiln.stages.precision.config import PRECISIONS

    unknown = sorted(set(wanted) - set(PRECISIONS))
    if unknown:
        raise ConfigError(f"--variants names unknown precisions {unknown}", hint=f"use {', '.join(PRECISIONS)}")
    from kiln.core.artifacts import output_folder
    from kiln.pipeline.runner import settings_for
    from kiln.stages.precision.direct import precision_direct

    out = Path(output or Path(file).with_suffix(""))
    settings = settings_for(stage_named("precision"), cfg)
    refuse_link(out.parent / ".kiln-cache", "the calibration cache")
    with scratch_root(out.parent), output_folder(out) as staged:
        summary = precision_direct(Path(file), staged, wanted, Path(calibration) if calibration else None, settings)
    for name, v in summary["variants"].items():
        shown = out / Path(v["path"]).relative_to(staged)
        only = (
            f"; for {v['only']} engines only, its Q/DQ graph is kept for inspection only (variants.json says why)"
            if v["only"]
            else ""
        )
        said = v.get("baseline") or f"{v['kept_fp32']} nodes kept FP32{only}"  # fp32, not asked for: why it is here
        _results().print(f"{name}: {shown} ({said})", highlight=False, soft_wrap=True)
    checked = "calibrated" if set(wanted) & {"int8", "fp8"} else "checked"  # FP16 takes no calibration
    _results().print(
        f"{checked} on {summary['calibration']}; wrote {out / 'variants.json'}", highlight=False, soft_wrap=True
    )
    if summary["missing"] is not None:  # the variants made are written; one asked for and not made fails the command
        raise summary["missing"]


def _build_direct(
    file: str,
    config: str | None,
    sets: tuple[str, ...],
    backend: str,
    device: str | None,
    precision_: str | None,
    output: str | None,
) -> None:
    from kiln.stages.engines.registry import runnable
    from kiln.stages.engines.stage import build_direct

    cfg = _config(config, sets)
    out = Path(output or "engine")
    refuse_link(out, "-o")
    refuse_link(out.parent / ".kiln-cache", "the build cache")
    with scratch_root(out.parent):
        sig = cfg.signature
        meta = build_direct(Path(file), out, backend, device, precision_, cfg.build, dict(sig.shapes), sig.max_batch)
    _results().print(
        f"built {meta.name} into {output or 'engine'} in {meta.build_seconds:.1f}s (targets {meta.device.upper()})",
        highlight=False,
    )
    ok, why = runnable(meta)
    if not ok:
        _console().print(
            f"[yellow]not runnable on this machine[/]: {escape(why)}; run it on a machine with a "
            f"{meta.device.upper()} device",
            highlight=False,
            soft_wrap=True,
        )


def _validate_direct(
    file: str,
    config: str | None,
    sets: tuple[str, ...],
    reference: str | None,
    model_name: str | None,
    inputs: str | None,
) -> None:
    if reference is None:
        raise click.UsageError("direct mode needs --reference MODEL.onnx")
    from kiln.core.artifacts import json_text
    from kiln.pipeline.runner import settings_for
    from kiln.stages.validate.direct import validate_direct
    from kiln.stages.validate.report import RANDOM_INPUTS, direct_report, gate_failure_hint

    cfg = _load(config, {**({"model.name": model_name} if model_name else {}), **_parse_sets(sets)}, _given(sets))
    settings = settings_for(stage_named("validate"), cfg)
    fed = Path(inputs) if inputs else None
    if fed is None:
        _console().print(f"[yellow]inputs[/]: no --inputs, so {RANDOM_INPUTS}", highlight=False, soft_wrap=True)
    result = validate_direct(Path(file), Path(reference), fed, settings)
    _answer(json_text(direct_report(result, fed), sort_keys=False))  # strict JSON on stdout: `> v.json` keeps it
    if not result.passed:
        raise GateFailure(
            f"engine {result.name} failed its gates: {'; '.join(result.failures)}",
            hint=gate_failure_hint(fed, result.failures, result.precision, Path(reference)),
        )


def _file(name: str, folder: bool = False) -> click.Argument:
    kind = click.Path() if folder else click.Path(dir_okay=False)
    return click.Argument([name], required=False, type=kind)


def _model_name() -> click.Option:
    return click.Option(["--model", "model_name"], help="model name or import path (default: the config's)")


STAGE_HELP = {
    "train": "Train the configured model into WORKDIR/train.",
    "package": "Write serving artifacts (engines + metadata, Triton model repository) into WORKDIR/package.",
}
DIRECT = {
    "export": Direct(
        (
            click.Option(
                ["--checkpoint"], type=click.Path(dir_okay=False), help="export this state dict directly (no workdir)"
            ),
            _model_name(),
            click.Option(
                ["--input-shape"],
                multiple=True,
                metavar="[NAME=]DIMS[:DTYPE]",
                help="an input's shape, one sample without the batch axis, e.g. 3,224,224; () for one value per "
                "sample (a timestep: t=():int64, an input of shape [batch]); one per input for a model with several, "
                "named as its forward's parameters: --input-shape x=8 --input-shape meta=3 (dtype float32, or e.g. "
                "ids=128:int64; integer inputs get 0s and 1s). Default: the config's data",
            ),
            click.Option(["-o", "--output"], type=click.Path(dir_okay=False), help="ONNX file to write in direct mode"),
        ),
        _export_direct,
        needs="-o/--output or --checkpoint",
        switches=("checkpoint", "output"),
        takes_workdir=True,
    ),
    "optimize": Direct(
        (
            _file("model"),
            click.Option(["-o", "--output"], type=click.Path(dir_okay=False), help="optimized ONNX file (direct mode)"),
            _PassesOption(
                ["--passes"],
                metavar="P1,P2,...",
                help="comma-separated pass list (default: the config's)",
            ),
        ),
        _optimize_direct,
        needs="the MODEL file",
        file="model",
        both=("passes",),
        workdir_sets=lambda values: _passes(values.get("passes")),
    ),
    "precision": Direct(
        (
            _file("model"),
            click.Option(
                ["-o", "--output"], type=click.Path(file_okay=False), help="folder of the variants (direct mode)"
            ),
            click.Option(
                ["--variants"], help="comma-separated variants to make, e.g. fp16,int8 (default: the config's)"
            ),
            click.Option(
                ["--calibration"],
                type=click.Path(dir_okay=False),
                help=".npz with one array per model input (calibration and the accuracy fallback; default: random, "
                "with a warning)",
            ),
        ),
        _precision_direct,
        needs="the MODEL file",
        file="model",
    ),
    "build": Direct(
        (
            _file("model", folder=True),
            click.Option(
                ["--backend"],
                type=click.Choice(BACKEND_NAMES),
                default="onnxruntime",
                show_default=True,
                help="engine kind to build (direct mode)",
            ),
            click.Option(
                ["--device"],
                type=click.Choice(["cpu", "cuda"]),
                default=None,
                help="device the engine targets [default: the backend's only device (tensorrt: cuda, which "
                "TensorRT-RTX builds for without a GPU here), else cpu]",
            ),
            click.Option(
                ["--precision", "precision_"],
                default=None,
                help="label of the graph's precision (precision lives in the graph: see `kiln precision`) "
                "[default: the variant's, for a folder or graph of `kiln precision`; else the precision most of "
                "the graph's compute is in, by its audit (an FP16 file: fp16)]",
            ),
            click.Option(
                ["-o", "--output"],
                type=click.Path(file_okay=False),
                help="engine folder (direct mode): new, empty, or one an earlier `kiln build` wrote",
            ),
        ),
        _build_direct,
        needs="the MODEL file",
        file="model",
    ),
    "validate": Direct(
        (
            _file("engine", folder=True),
            click.Option(
                ["--reference"],
                type=click.Path(dir_okay=False),
                help="what the engine must match (direct mode): an ONNX model, or a PyTorch checkpoint of --model",
            ),
            click.Option(["--model", "model_name"], help="model name or import path for a checkpoint --reference"),
            click.Option(
                ["--inputs"],
                type=click.Path(dir_okay=False),
                help=".npz of inputs, one array per engine input (default: random arrays of the engine's declared "
                "shapes, said so in the output and its JSON)",
            ),
        ),
        _validate_direct,
        needs="the ENGINE folder",
        file="engine",
    ),
}
DIRECT_HELP = {
    "export": "Export to ONNX: from WORKDIR/train, or directly with --checkpoint/--model and -o.",
    "optimize": "Optimize an ONNX graph: `kiln optimize model.onnx -o model.opt.onnx`, or WORKDIR/export without "
    "MODEL (MODEL may also be the run config: `kiln optimize kiln.yaml`). A file's dynamic axes besides batch take "
    "their sizes for the check on random inputs from `--set 'signature.shapes={seq: [8, 128]}'` (by the names "
    "the graph gives them), else 16 where the graph takes it and optimize.verify_batch where not.",
    "precision": "FP32/FP16/INT8/FP8 graph variants: `kiln precision model.onnx -o out/ --variants fp16,int8 "
    "--calibration d.npz`, or of WORKDIR/optimize without MODEL (MODEL may also be the run config).",
    "build": "Build engines: `kiln build model.onnx --backend onnxruntime -o out/`, or from WORKDIR/precision (MODEL "
    "may also be the run config: `kiln build kiln.yaml`). A file's dynamic axes besides batch take their sizes "
    "(profiles, recorded ranges, the fusion check) from `--set 'signature.shapes={seq: [8, 128]}'`, by the names "
    "the graph gives them.",
    "validate": "Check engines against PyTorch (WORKDIR) or one engine folder against an ONNX --reference (ENGINE may "
    "also be the run config: `kiln validate kiln.yaml`).",
}
for _name in STAGE_NAMES:
    main.add_command(stage_command(_name, {**STAGE_HELP, **DIRECT_HELP}[_name], DIRECT.get(_name)))


SERVE_EXIT_CODES = (
    "Exit codes: 0 the server was stopped (Ctrl-C or SIGTERM once it was ready: a server's normal end); 2 a "
    "problem you can fix (one `error:` and one `fix:` line); 3 a validation gate failed (the engine is "
    "refused); 130 / 143 stopped by Ctrl-C / SIGTERM before it was ready (nothing was served)."
)


@main.command(epilog=SERVE_EXIT_CODES)
@click.argument("path", required=False, default="kiln-out", type=click.Path(exists=True, file_okay=False))
@click.option("--http-port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="Triton's HTTP port")
@click.option("--grpc-port", default=8001, show_default=True, type=click.IntRange(1, 65535), help="Triton's gRPC port")
@click.option(
    "--metrics-port",
    default=8002,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="Triton's Prometheus metrics port",
)
@click.option(
    "--max-batch",
    default=None,
    type=click.IntRange(0),
    help="largest batch Triton's dynamic batcher forms (capped by the engine; 0: no batching) [default: 8 for "
    "engines on GPUs, spread over their stubs; 32 on the CPU and with --pytriton]",
)
@click.option(
    "--max-queue-delay-us",
    default=100,
    show_default=True,
    type=click.IntRange(0),
    help="how long a request may wait for others to join its batch",
)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="interface to listen on (0.0.0.0 exposes the server to the network)",
)
@click.option(
    "--gpus",
    default=None,
    help="serve CUDA engines on these GPUs behind one endpoint: 'all' or ids such as 0,1 (Triton instance "
    "groups; default: GPU 0)",
)
@click.option(
    "--instances-per-gpu",
    default=None,
    type=click.IntRange(1),
    help="model instances (stub processes) on each GPU [default: 8, fewer with under 2 cores each]",
)
@click.option(
    "--http-threads",
    default=None,
    type=click.IntRange(1),
    help="Triton's HTTP threads, which read requests and write responses for all connections [default: Triton's]",
)
@click.option(
    "--pytriton",
    is_flag=True,
    help="run the engines in this process through PyTriton instead of Triton's Python-backend stubs (slower)",
)
@verbose_opt
def serve(
    path: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    max_batch: int | None,
    max_queue_delay_us: int,
    address: str,
    gpus: str | None,
    instances_per_gpu: int | None,
    http_threads: int | None,
    pytriton: bool,
    verbose: int,
) -> None:
    """Serve PATH's validated engines (a workdir, or one engine folder) with Triton, until Ctrl-C or SIGTERM.
    The URLs go to stdout; Triton's own log is shown with --verbose."""
    readied: list[bool] = []
    try:
        from kiln.serve.server import iter_urls, parse_gpus
        from kiln.serve.server import serve as serve_engines

        _setup_logging(False, verbose)

        def ready(served: list[Any]) -> None:
            for line in iter_urls(address, http_port, grpc_port, served):
                _results().print(escape(line), highlight=False, soft_wrap=True)
            _console().print("ready (Ctrl-C or SIGTERM stops the server)")
            readied.append(True)

        from kiln.stages.engines.backend import SIDECAR

        served = Path(path)  # its scratch goes in the served workdir (beside one engine folder), removed when it stops
        with scratch_root(served.parent if (served / SIDECAR).is_file() else served):
            serve_engines(
                Path(path),
                http_port,
                grpc_port,
                metrics_port,
                max_batch,
                max_queue_delay_us,
                address,
                on_ready=ready,
                verbose=verbose > 0,
                gpus=parse_gpus(gpus) if gpus is not None else None,
                instances_per_gpu=instances_per_gpu,
                exit_on_overrun=True,
                pytriton=pytriton,
                http_threads=http_threads,
            )
    except KeyboardInterrupt:  # the command's own handler (core/interrupt.py), before the server's took over
        if readied:
            return
        raise NOT_READY_TERM if interrupt.by_sigterm() else NOT_READY from None
    if not readied:  # the server returns quietly from a stop (its own handler's) at any time: before ready too
        from kiln.serve.server import stopped_by

        raise NOT_READY_TERM if stopped_by() == signal.SIGTERM else NOT_READY


NOT_READY = Interrupted(
    "kiln serve was stopped (Ctrl-C) before the server was ready: nothing was served",
    hint="run `kiln serve` again and stop it after its `ready` line (it comes once every engine answers)",
)
NOT_READY_TERM = Terminated(
    "kiln serve was stopped (SIGTERM) before the server was ready: nothing was served",
    hint="run `kiln serve` again and stop it after its `ready` line (it comes once every engine answers)",
)

LOADTEST_FILES = ("loadtest.json", "loadtest.md", "loadtest.png")


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"'{value}' is not a comma-separated list of integers") from None


@main.command()
@click.argument("url")
@click.option(
    "--model",
    help="served model name (printed by `kiln serve`; default: the only engine served, else the one validation "
    "chose at the largest batch)",
)
@click.option(
    "--engines",
    "-e",
    "engines",
    default="kiln-out",
    show_default=True,
    type=click.Path(),
    help="the workdir or engine folder the server serves: expected answers come from its engine",
)
@click.option(
    "--concurrency",
    default="1,2,4,8,16,32",
    show_default=True,
    callback=_int_list,
    help="comma-separated numbers of requests in flight, one level after another",
)
@click.option(
    "--duration",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="seconds per concurrency level",
)
@click.option(
    "--requests",
    "max_requests",
    default=100_000,
    show_default=True,
    type=click.IntRange(1),
    help="at most this many requests per concurrency level",
)
@click.option(
    "--config",
    "-c",
    "config",
    type=click.Path(dir_okay=False),
    help="the run's config (YAML/TOML/JSON): its first 64 validation samples become the requests (the pool's cap; "
    "default: the config the workdir's run recorded, else none: random requests of the engine's shapes)",
)
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="client processes per level, its requests in flight split between them (one process's threads share "
    "one interpreter lock: at high concurrency they, not the server, can set the pace)",
)
@click.option(
    "--shared-memory",
    is_flag=True,
    help="send tensors through system shared memory registered with Triton, not in the requests (clients on the "
    "server's machine; measures the server without moving tensors through HTTP/gRPC in Python)",
)
@click.option(
    "--client",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "kiln", "tritonclient"]),
    help="what sends the requests: auto = Kiln's lean HTTP client with --shared-memory over http:// (each request "
    "made once, one kept-alive connection per thread), tritonclient otherwise",
)
@click.option(
    "--metrics-port",
    default=8002,
    show_default=True,
    type=click.IntRange(1, 65535),
    help="the server's Triton metrics port (kiln serve's --metrics-port), where Kiln's models say where their "
    "executions' time went",
)
@click.option(
    "-o",
    "--output",
    default="loadtest",
    show_default=True,
    type=click.Path(file_okay=False),
    help="folder for loadtest.json, loadtest.md and loadtest.png",
)
def loadtest(
    url: str,
    model: str | None,
    engines: str,
    concurrency: list[int],
    duration: float,
    max_requests: int,
    config: str | None,
    processes: int,
    shared_memory: bool,
    client: str,
    metrics_port: int,
    output: str,
) -> None:
    """Load-test a Triton server on this machine (URL: http://127.0.0.1:8000 or grpc://127.0.0.1:8001)."""
    from kiln.serve.loadtest import (
        default_model,
        lean_client,
        parse_url,
        recorded_code_roots,
        recorded_config,
        render_markdown,
        run_workdir,
    )
    from kiln.serve.loadtest import loadtest as run_loadtest

    _setup_logging(False, 0)
    lean_client(client, parse_url(url)[0], shared_memory)  # a bad URL or client is said before any folder is made
    if not Path(engines).exists():
        raise ConfigError(
            f"--engines {engines}: no such folder (the workdir or engine folder the server serves)",
            hint="pass -e WORKDIR (or an engine folder): the path given to `kiln serve`",
        )
    model = model or default_model(engines)
    run_config = None if config else recorded_config(engines)
    if run_config is None:
        run_config = _config(config, ()) if config else None  # no data given: random requests, said so
    else:  # the run's own modules (its data function) resolve from where the run imported them, else from here,
        # else beside the workdir (where `kiln run cfg.yaml -w wd` ran, as a project keeps them)
        _importable(*recorded_code_roots(engines), run_workdir(engines).resolve().parent, *filter(None, [_cwd()]))
    out = Path(output)
    claim_folder(out, "-o", LOADTEST_FILES)  # a loadtest.json Kiln did not write is never replaced
    try:
        with scratch_root(out):
            result = run_loadtest(
                url,
                model,
                engines,
                out,
                concurrency,
                duration,
                max_requests,
                run_config,
                processes,
                shared_memory=shared_memory,
                metrics_port=metrics_port,
                client=client,
            )
    finally:  # a load test that failed its check wrote its files too: Kiln's to replace next time
        if out.is_dir():
            record_owned(out, LOADTEST_FILES)
    _answer(render_markdown(result), nl=False)
    _results().print(f"wrote {Path(output) / 'loadtest.json'}, loadtest.md, loadtest.png", highlight=False)


def command() -> None:
    """The `kiln` command. The interpreter's last full collection walks every object torch and the stages made
    (about 1.5 s after a `kiln run` on 2 cores) only to free memory the process hands back anyway: frozen at exit,
    those objects are not walked. Here, not in :func:`main`, so a program that imports the CLI keeps its own exit."""
    atexit.register(gc.freeze)
    main()


if __name__ == "__main__":  # pragma: no cover
    command()
