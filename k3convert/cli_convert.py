"""``k3convert convert`` and ``k3convert recipe check | show | list``: thin wrappers over
:func:`k3convert.pipeline.convert.convert` and :mod:`k3convert.recipe`."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Annotated

import typer

from .cli_options import Force, NoProgress, StrictServing, examples
from .errors import ConfigError

SET_HELP = (
    "Override a recipe key before validation, KEY=VALUE with VALUE read as YAML "
    "(--set layout.tp=8 --set verify.enabled=false); repeatable."
)

recipe_app = typer.Typer(help="Validate, print and list conversion recipes.", no_args_is_help=True)


def convert_cmd(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="SRC OUT: the checkpoint and the stream directory to write; OUT alone "
            "when the recipe names source.path.",
            show_default=False,
        ),
    ],
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe", "-r", help="Recipe YAML, or a preset name (k3convert recipe list)."
        ),
    ],
    set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
    keep_intermediate: Annotated[
        bool,
        typer.Option(
            "--keep-intermediate",
            help="Also write the quantized compressed-tensors checkpoint to OUT.quantized/.",
        ),
    ] = False,
    report_html: Annotated[
        Path | None,
        typer.Option(help="Also write a self-contained HTML report (summary table, plots)."),
    ] = None,
    force: Force = False,
    no_progress: NoProgress = False,
    strict_serving: StrictServing = False,  # same as --set output.strict_serving=true
):
    """Quantize (calibrating when the recipe asks) -> shard -> verify in one streaming pass.

    No intermediate checkpoint is written: quantized tensors go straight into the stream's
    units. Rerun the same command after an interruption to resume (finished calibration
    layers and units are not redone). Writes OUT/report.json; exit 1 when verify fails.
    Under torchrun the processes share the units (OUT on a shared file system)."""
    from .parallel import procs
    from .pipeline.convert import convert

    if len(paths) not in (1, 2):
        raise typer.BadParameter("give SRC OUT (or OUT alone when the recipe names source.path).")
    src, out = (None, paths[0]) if len(paths) == 1 else paths
    overrides = list(set_ or ()) + (["output.strict_serving=true"] if strict_serving else [])
    res = convert(src=src, out=out, recipe=recipe, overrides=overrides,
                  keep_intermediate=keep_intermediate, force=force, progress=not no_progress,
                  report_html=report_html)  # fmt: skip
    if not procs.current().leader:
        return
    typer.echo(res.summary())
    if report_html is not None:
        typer.echo(f"  html        {report_html}")
    if res.passed is False:
        typer.echo("error: verify failed (see the report); the stream is written.", err=True)
        raise typer.Exit(1)


@recipe_app.command("check", epilog=examples("recipe check"))
def recipe_check(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML, or a preset name.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="Also check the recipe against this checkpoint (or config.json's directory): "
            "the quantization plan and every unit of the layout, reading no weights."
        ),
    ] = None,
):
    """Validate a recipe and print it resolved (every default filled in) as YAML."""
    from .recipe import dump_recipe, load_recipe

    r = load_recipe(recipe, list(set_ or ()))
    if model is not None:
        from .pipeline.convert import check_against

        typer.echo(f"# {check_against(r, model)}")
    typer.echo(f"# {r.origin}: valid (recipe version {r.version})")
    typer.echo(dump_recipe(r), nl=False)


@recipe_app.command("show", epilog=examples("recipe show"))
def recipe_show(preset: Annotated[str, typer.Argument(help="A preset name.")]):
    """Print a preset recipe as written (with its comment header)."""
    from .recipe import preset_path, read_recipe_text

    typer.echo(read_recipe_text(preset_path(preset)), nl=False)


@recipe_app.command("list", epilog=examples("recipe list"))
def recipe_list():
    """The preset recipes and what each is for."""
    from .recipe import preset_summary, presets

    known = presets()
    if not known:
        raise ConfigError("no preset recipes found (set K3CONVERT_RECIPES_DIR).")
    width = max(len(n) for n in known)
    cols = max(60, shutil.get_terminal_size().columns)  # 80 when not a terminal
    for name, path in known.items():
        typer.echo(textwrap.fill(preset_summary(path), width=cols, break_on_hyphens=False,
                                 initial_indent=f"{name:<{width}}  ",
                                 subsequent_indent=" " * (width + 2)))  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("convert", epilog=examples("convert"))(convert_cmd)
    app.add_typer(recipe_app, name="recipe")
