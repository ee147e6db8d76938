"""``kiln``: thin click commands over :mod:`kiln.api`. No logic lives here beyond parsing and printing."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from kiln.config import KilnConfig, load_config, set_value
from kiln.core.errors import ConfigError, KilnError
from kiln.core.progress import RichProgress, SilentProgress

console = Console(stderr=True)
STATUS_STYLE = {"ran": "green", "cached": "cyan", "skipped": "yellow", "failed": "bold red", "not-run": "dim"}


class KilnCommand(click.Command):
    """Turns :class:`KilnError` into a clean message and exit code instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KilnError as exc:
            # escape: messages quote shapes like [batch, 3, 8, 8], which rich would take for markup and drop
            console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
            if exc.hint:
                console.print(f"[bold]fix:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
            ctx.exit(exc.exit_code)


class KilnGroup(click.Group):
    command_class = KilnCommand


def _setup_logging(quiet: bool, verbose: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    handler = RichHandler(console=console, show_path=False, show_time=False, markup=False)
    logger = logging.getLogger("kiln")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def _parse_sets(sets: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"'{item}' is not KEY=VALUE", param_hint="--set")
        try:
            out[key] = set_value(key, value)  # typed by the config schema, not by YAML's guesses
        except ConfigError as exc:
            raise click.BadParameter(f"'{item}': {exc.message.partition(': ')[2]}", param_hint="--set") from None
    return out


def _importable(*folders: Path) -> None:
    """User code named by import path (``model.name: mymodels:build``) resolves from the current folder and the
    config's folder, as ``python -m`` would, before PYTHONPATH. Kiln installs one package, ``kiln``, so a
    project's own ``models/`` or ``pipeline/`` folder resolves as the user's."""
    for folder in folders:
        entry = str(folder.resolve())
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _load(path: str | None, overrides: dict[str, Any]) -> KilnConfig:
    _importable(*([Path(path).parent] if path else []), Path.cwd())
    return load_config(path, overrides)


def _config(path: str | None, sets: tuple[str, ...]) -> KilnConfig:
    return _load(path, _parse_sets(sets))


config_arg = click.argument("config", required=False, type=click.Path(dir_okay=False))
workdir_opt = click.option("--workdir", "-w", default="kiln-out", show_default=True, type=click.Path(file_okay=False),
                           help="folder holding every stage's artifacts, the cache and the report")
set_opt = click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.epochs=2 (repeatable)")
quiet_opt = click.option("--quiet", "-q", is_flag=True, help="only warnings and errors")
verbose_opt = click.option("--verbose", "-v", is_flag=True, help="debug logging")


@click.group(cls=KilnGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kiln")
def main() -> None:
    """Kiln: turn a PyTorch model into a validated, serving-ready inference engine.

    Stages: train -> export -> optimize -> precision -> build -> validate -> package.
    `kiln run` runs them all (cached, resumable); each stage also has its own command.
    """


def _print_summary(result: Any, report: dict[str, Any], workdir: Path) -> None:
    table = Table(title="Kiln run", show_edge=False)
    for col in ("stage", "status", "seconds"):
        table.add_column(col)
    for r in result.records:
        style = STATUS_STYLE.get(r.status, "")
        table.add_row(r.name, f"[{style}]{r.status}[/]", f"{r.seconds:.2f}")
    console.print(table)
    v = report.get("validation")
    if v:
        et = Table(title="Engines vs PyTorch", show_edge=False)
        for col in ("engine", "passed", "cosine", "top-1 agree", "accuracy", "p50 ms (largest batch)", "speedup"):
            et.add_column(col)
        b = v["baseline"]
        largest = list(b["latency_ms"])[-1]
        et.add_row("pytorch (baseline)", "", "", "", f"{b['accuracy']:.4f}", f"{b['latency_ms'][largest]['p50']:.3f}", "1.00")
        for e in v["engines"]:
            if e.get("status") != "validated":
                et.add_row(e["name"], "[yellow]not run here[/]", "", "", "", "", "")
                continue
            et.add_row(e["name"], "[green]yes[/]" if e["passed"] else "[bold red]no[/]", f"{e['cosine']:.6f}",
                       f"{e['top1_agreement']:.4f}", f"{e['accuracy']:.4f}", f"{e['latency_ms'][largest]['p50']:.3f}",
                       f"{e['speedup_vs_baseline'][largest]:.2f}x")
        console.print(et)
    for e in (v or {}).get("engines", []):
        if e.get("status") != "validated":
            console.print(f"[yellow]{escape(e['name'])}[/]: built, not validated here: {escape(e.get('reason', ''))}",
                          soft_wrap=True)
    precision = report.get("stages", {}).get("precision", {}).get("summary", {})
    for name, why in precision.get("failed", {}).items():
        console.print(f"[bold red]precision variant {escape(name)} failed[/], the others were built: {escape(why)}",
                      soft_wrap=True)
    dropped = {e["name"] for e in (v or {}).get("engines", []) if e.get("dropped")}
    for r in (v or {}).get("speed_vs_fp32", []):
        if r["slower"]:
            x = r["vs_fp32"][r["largest_batch"]]
            console.print(f"[yellow]{escape(r['engine'])}[/]: slower than FP32 at batch {r['largest_batch']} "
                          f"({x:.2f}x){', not packaged (precision.require_speedup)' if r['engine'] in dropped else ''}")
    console.print(f"report: {workdir / 'report.md'}")


def _run(config: KilnConfig, workdir: str, quiet: bool, **kw: Any) -> None:
    from kiln.api import run_pipeline

    progress = SilentProgress() if quiet else RichProgress(console)
    result, report = run_pipeline(config, workdir, progress=progress, **kw)
    if not quiet:
        _print_summary(result, report, Path(workdir))
    if result.error is not None:
        failed = next((r.name for r in result.records if r.status == "failed"), None)
        done_before = any(r.status in ("ran", "cached", "skipped") for r in result.records)  # else nothing to keep
        if failed and done_before:
            console.print(f"stages before '{failed}' are kept; after fixing, `kiln run` resumes from '{failed}'.")
        raise result.error


@main.command()
@config_arg
@workdir_opt
@set_opt
@click.option("--force", multiple=True, metavar="STAGE", help="rerun this stage even if cached (repeatable)")
@click.option("--from", "start", metavar="STAGE", help="rerun from this stage on")
@click.option("--until", "stop", metavar="STAGE", help="stop after this stage")
@quiet_opt
@verbose_opt
def run(config: str | None, workdir: str, sets: tuple[str, ...], force: tuple[str, ...], start: str | None,
        stop: str | None, quiet: bool, verbose: bool) -> None:
    """Run the whole pipeline. Without CONFIG: the built-in demo (a CNN on scikit-learn's digits)."""
    _setup_logging(quiet, verbose)
    _run(_config(config, sets), workdir, quiet, force=set(force), start=start, stop=stop)


@main.command("config")
@config_arg
@set_opt
def show_config(config: str | None, sets: tuple[str, ...]) -> None:
    """Print the resolved config (defaults filled in) as YAML: a starting point for your own."""
    click.echo(yaml.safe_dump(_config(config, sets).dump(), sort_keys=False), nl=False)


def _refuse_direct_options(what: str, *names: str) -> None:
    """Direct-mode options given without the file they apply to would be silently ignored: refuse instead."""
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-').rstrip('-')}" for n in names
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(f"{', '.join(given)}: direct-mode option{'s' if len(given) > 1 else ''}, give {what} "
                               f"too (without it, `kiln {ctx.info_name}` runs the stage inside --workdir)")


def _stage_in_workdir(stage: str, config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Run one stage inside a run's workdir, from its upstream artifacts, even if cached."""
    _run(_config(config, sets), workdir, quiet, only=[stage], force={stage})


@main.command()
@config_arg
@workdir_opt
@set_opt
@quiet_opt
def train(config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Train the configured model into WORKDIR/train."""
    _setup_logging(quiet, False)
    _stage_in_workdir("train", config, workdir, sets, quiet)


@main.command()
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), help="run config (model, data, export)")
@workdir_opt
@set_opt
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="export this state dict directly (no workdir)")
@click.option("--model", "model_name", help="model name or import path for --checkpoint (default: config's)")
@click.option("--input-shape", help="one sample's shape without batch, e.g. 3,224,224 (default: the dataset's)")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="ONNX file to write in direct mode")
@quiet_opt
def export(config: str | None, workdir: str, sets: tuple[str, ...], checkpoint: str | None, model_name: str | None,
           input_shape: str | None, output: str | None, quiet: bool) -> None:
    """Export to ONNX: from WORKDIR/train, or directly with --checkpoint/--model and -o."""
    _setup_logging(quiet, False)
    if checkpoint is None and output is None:
        _refuse_direct_options("-o/--output or --checkpoint", "model_name", "input_shape")
        return _stage_in_workdir("export", config, workdir, sets, quiet)
    from kiln.direct import export_direct

    overrides = {"model.name": model_name} if model_name else {}
    cfg = _load(config, {**overrides, **_parse_sets(sets)})
    summary = export_direct(cfg, checkpoint, input_shape, Path(output or "model.onnx"))
    console.print(f"wrote {summary['path']} ({summary['nodes']} nodes, parity max abs err {summary['max_abs_err']:.2e})")


@main.command()
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="optimized ONNX file (direct mode)")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False))
@click.option("--passes", help="comma-separated pass list (default: the config's)")
@workdir_opt
@set_opt
@quiet_opt
def optimize(model: str | None, output: str | None, config: str | None, passes: str | None, workdir: str,
             sets: tuple[str, ...], quiet: bool) -> None:
    """Optimize an ONNX graph: `kiln optimize model.onnx -o model.opt.onnx`, or WORKDIR/export without MODEL."""
    _setup_logging(quiet, False)
    extra = (f"optimize.passes={passes.split(',')!r}",) if passes else ()
    if model is None:
        _refuse_direct_options("the MODEL file", "output")
        return _stage_in_workdir("optimize", config, workdir, sets + extra, quiet)
    from kiln.direct import optimize_direct

    cfg = _config(config, sets + extra)
    dst = Path(output or Path(model).with_suffix(".opt.onnx"))
    summary = optimize_direct(Path(model), dst, cfg)
    console.print(f"wrote {dst}: {summary.get('nodes_before')} -> {summary.get('nodes_after')} nodes")


@main.command()
@config_arg
@workdir_opt
@set_opt
@quiet_opt
def precision(config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Make the FP32/FP16/INT8 graph variants of WORKDIR/optimize."""
    _setup_logging(quiet, False)
    _stage_in_workdir("precision", config, workdir, sets, quiet)


@main.command()
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default="onnxruntime", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--precision", "precision_", default="fp32", show_default=True,
              help="label of the graph's precision (precision lives in the graph: see `kiln precision`)")
@click.option("-o", "--output", type=click.Path(file_okay=False), help="engine folder (direct mode)")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False))
@workdir_opt
@set_opt
@quiet_opt
def build(model: str | None, backend: str, device: str, precision_: str, output: str | None, config: str | None,
          workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Build engines: `kiln build model.onnx --backend onnxruntime -o out/`, or from WORKDIR/precision."""
    _setup_logging(quiet, False)
    if model is None:
        _refuse_direct_options("the MODEL file", "backend", "device", "precision_", "output")
        return _stage_in_workdir("build", config, workdir, sets, quiet)
    from kiln.direct import build_direct

    cfg = _config(config, sets)
    meta = build_direct(Path(model), Path(output or "engine"), backend, device, precision_, cfg)
    console.print(f"built {meta['name']} into {output or 'engine'} in {meta.get('build_seconds', 0):.1f}s")


@main.command()
@click.argument("engine", required=False, type=click.Path(file_okay=False))
@click.option("--reference", type=click.Path(dir_okay=False),
              help="what the engine must match (direct mode): an ONNX model, or a PyTorch checkpoint of --model")
@click.option("--model", "model_name", help="model name or import path for a checkpoint --reference")
@click.option("--inputs", type=click.Path(dir_okay=False), help=".npz of inputs (default: random from the engine's spec)")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), help="gates and timing settings")
@workdir_opt
@set_opt
@quiet_opt
def validate(engine: str | None, reference: str | None, model_name: str | None, inputs: str | None,
             config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Check engines against PyTorch (WORKDIR) or one engine folder against an ONNX --reference."""
    _setup_logging(quiet, False)
    if engine is None:
        _refuse_direct_options("the ENGINE folder", "reference", "model_name", "inputs")
        return _stage_in_workdir("validate", config, workdir, sets, quiet)
    if reference is None:
        raise click.UsageError("direct mode needs --reference MODEL.onnx")
    from kiln.direct import validate_direct

    cfg = _load(config, {**({"model.name": model_name} if model_name else {}), **_parse_sets(sets)})
    result = validate_direct(Path(engine), Path(reference), Path(inputs) if inputs else None, cfg)
    console.print_json(data=result)
    if not result["passed"]:
        from kiln.core.errors import GateFailure

        raise GateFailure(f"engine {result['name']} failed its gates: {'; '.join(result['failures'])}",
                          hint="inspect the engine's precision, or relax validate.gates if acceptable")


@main.command()
@config_arg
@workdir_opt
@set_opt
@quiet_opt
def package(config: str | None, workdir: str, sets: tuple[str, ...], quiet: bool) -> None:
    """Write serving artifacts (engines + metadata, Triton model repository) into WORKDIR/package."""
    _setup_logging(quiet, False)
    _stage_in_workdir("package", config, workdir, sets, quiet)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
