"""A PyTorch checkpoint as the reference of ``kiln validate ENGINE --reference model.pt``: the one reference that
needs torch, so :mod:`kiln.stages.validate.direct` loads this module only for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.core.errors import InputError, KilnError
from kiln.core.feeds import in_batches, run_batched
from kiln.core.outputs import host_arrays, named_outputs
from kiln.core.user_errors import UserCodeError, out_of_memory, running_user_code
from kiln.models.determinism import refuse_random
from kiln.models.model_io import load_weights, read_state_dict
from kiln.models.registry import build_model
from kiln.stages.validate.declaration import ValidateSettings
from kiln.stages.validate.reference_text import OTHER_MODEL, RANDOM_REJECTED, feed_shapes

# A reference that raised on Kiln's random feed: the values, each drawn on its own, not the data, may be what failed
RANDOM_DOING = (
    "running the reference model on Kiln's RANDOM inputs of the engine's shapes (each value drawn on its own, ids "
    "within the rows of the table they index)"
)


def checkpoint_outputs(
    reference: Path,
    feed: dict[str, np.ndarray],
    cfg: ValidateSettings,
    batch: int | None,
    loaded: dict[str, Any],
    random: bool,
) -> dict[str, np.ndarray]:
    """:func:`~kiln.stages.validate.direct.reference_outputs` of a PyTorch checkpoint of ``cfg.model``."""
    if "model" not in loaded:
        built = build_model(cfg.model.name, cfg.model.params)
        loaded["model"] = load_weights(built, read_state_dict(reference, "--reference"), str(reference)).float().eval()
    model = loaded["model"]

    def run(part: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = {k: torch.from_numpy(v) for k, v in part.items()}
        return host_arrays(named_outputs(model, next(iter(x.values())) if len(x) == 1 else x))

    doing = RANDOM_DOING if random else "running the reference model on the engine's inputs"
    # The determinism check on the first batch the reference gets (a model of one row a call takes no other),
    # two rows where it takes any: two more calls over the whole feed would triple the reference's time
    rows = in_batches(feed, batch)[0] if batch is not None else {k: v[:2] for k, v in feed.items()}
    first = {k: torch.from_numpy(v) for k, v in rows.items()}
    try:
        with torch.inference_mode(), running_user_code(doing, f"reference {reference.name}", OTHER_MODEL, True):
            refuse_random(model, next(iter(first.values())) if len(first) == 1 else first)
            return run_batched(run, feed, batch)
    except UserCodeError as err:  # the user's model raised: on random values, said as such
        if random and not isinstance(err.__cause__, SystemExit):
            raise _on_random(err) from err.__cause__
        raise
    except KilnError:
        raise
    except Exception as exc:  # in torch, not the user's file: out of memory, or the inputs are another model's
        raise _reference_error(reference, cfg, feed, exc, random) from None


def _reference_error(
    reference: Path, cfg: ValidateSettings, feed: dict[str, np.ndarray], exc: Exception, random: bool = False
) -> InputError:
    """An exception in torch (not the user's file) running the reference: out of memory, or the engine's inputs
    are another model's, or (``random``: Kiln's random feed) values the model rejects."""
    said = f"reference {reference.name} ({cfg.model.name})"
    if out_of_memory(exc):
        return InputError(
            f"{said} ran out of memory on the engine's inputs {feed_shapes(feed)}",
            hint="validate with fewer rows: --inputs with a smaller batch, or a smaller signature.batch_sizes",
        )
    first = str(exc).splitlines()[0] if str(exc) else ""
    inputs = "Kiln's RANDOM inputs of the engine's shapes" if random else "the engine's inputs"
    return InputError(
        f"{said} fails on {inputs} {feed_shapes(feed)}: {type(exc).__name__}: {first}",
        hint=RANDOM_REJECTED if random else OTHER_MODEL,
    )


def _on_random(err: UserCodeError) -> UserCodeError:
    """The error of the user's model (or its library's) raised on Kiln's random feed, with real samples as its fix:
    the values, not data of the user's, are what it met (its message names where it raised)."""
    return UserCodeError(err.message, hint=f"{RANDOM_REJECTED} (--verbose shows the traceback)", detail=err.detail)
