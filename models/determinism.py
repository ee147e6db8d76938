"""Whether a PyTorch model answers the same inputs alike from call to call in eval mode: every engine is checked by
comparing its outputs with the model's, which a forward that draws random numbers, keeps state between calls or
changes its inputs in place makes impossible. Here, below the stages, so that training checks it before it trains and
the export before it exports (a run from a checkpoint trains nothing)."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.core.compare import max_abs_err
from kiln.core.data import Inputs, rebuild, tensors
from kiln.core.errors import ModelError
from kiln.core.outputs import host_arrays, named_outputs
from kiln.core.random_ops import RANDOM_HINT
from kiln.core.user_errors import is_user_file, where
from kiln.models.registry import build_model

# Two calls on the same inputs differ by more than this share of the output's largest value (or this much, for
# outputs near zero) only where forward draws random numbers or keeps state: arithmetic on one machine repeats
# itself exactly.
_RANDOM_SHARE, _RANDOM_FLOOR = 1e-3, 1e-5


def refuse_random(model: nn.Module, x: Inputs, generators: bool = False) -> None:
    """A model that answers the same inputs differently from call to call in eval mode is an error naming why,
    before the export: its export parity, the optimizer's safety net and validation would each fail on it, or read
    it as a model whose rows depend on their batch, and blame something else. Why: buffers forward updates (a state
    kept from call to call), inputs it changes in place, or else random draws (``torch.randn_like`` in a VAE's
    forward, ``F.dropout(x, p, training=True)``) or a state kept in a plain attribute (``self.calls += 1``), which
    two calls cannot tell apart. Two forwards of the rows ``x``, each on a copy of them (the data is not changed);
    small random draws may pass here, and the exported graph's random ops are checked on their own
    (:func:`kiln.core.onnx_io.refuse_random_graph`). ``generators``: also refuse a forward that draws from torch's
    default generators though its outputs do not move yet (noise at a scale that starts at zero), for the check
    before training, which would otherwise train fully for the export to refuse the graph (at the export the
    graph's own check decides). The generators' states are restored either way: the check draws nothing a run
    would see."""
    saved = _generator_states()
    try:
        _refuse_random(model, x, saved if generators else None)
    finally:
        _restore_generators(saved)


def _refuse_random(model: nn.Module, x: Inputs, saved: list[torch.Tensor] | None) -> None:
    """:func:`refuse_random`; ``saved``: the generators' states before the first call, to compare after it (None:
    not compared)."""
    copy = lambda: rebuild(x, [t.clone() for t in tensors(x)])  # noqa: E731
    given = copy()
    first = _outputs(model, given)
    drawn = saved is not None and not all(_same(a, b) for a, b in zip(saved, _generator_states()))
    if not all(_same(a, b) for a, b in zip(tensors(given), tensors(x))):
        raise ModelError(
            "the model's forward changes its inputs in place (x.mul_(...), x /= 255): the export, the parity check "
            "and validation would each see other inputs than the data's",
            hint="compute on new tensors (x = x / 255), not in place on the inputs",
        )
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    second = _outputs(model, copy())
    moved = _moved_output(first, second)
    if moved is None:
        _refuse_silent_draws(model, x, drawn)
        return
    said = f"the model answers the same inputs differently from call to call in eval mode ({moved})"
    updated = [k for k, b in model.named_buffers() if k in buffers and not _same(b, buffers[k])]
    if updated:
        raise ModelError(
            f"{said}: its forward updates buffers ({', '.join(updated[:3])}{', ...' if len(updated) > 3 else ''}), a "
            "state kept from call to call",
            hint="update state only in training (`if self.training:`), or pass it in and return it as tensors: an "
            "engine keeps no state between calls",
        )
    raise ModelError(
        f"{said}: its forward draws random numbers (torch.randn_like, torch.rand, F.dropout with training=True), or "
        "keeps a state from call to call in an attribute (self.calls += 1)",
        hint=f"{RANDOM_HINT}; keep no state between calls (pass it in and return it as tensors: an engine keeps none)",
    )


def _refuse_silent_draws(model: nn.Module, x: Inputs, drawn: bool) -> None:
    """A ModelError where a forward whose outputs agree from call to call drew from torch's default generators:
    its noise is scaled by a weight that starts at zero (StyleGAN's ``h + self.weight * torch.randn_like(h)``),
    so the draws show only once training moves the weight, or it is a random mask or branch that did not fire on
    the rows tried (a classifier-free-guidance label drop, ``torch.rand(n) < p``), which training does not change;
    the export refuses the graph either way. The line of the user's code that drew is named where one did."""
    if not drawn:
        return
    site = _draw_site(model, x)
    raise ModelError(
        f"the model's forward draws random numbers in eval mode (torch.randn_like, torch.rand)"
        f"{f', first in {site},' if site else ''} though its outputs did not move yet: noise at a scale that starts "
        "at zero, as in h + self.weight * torch.randn_like(h) (once training moves it they will), one too small to "
        "tell apart, or a random mask or branch that did not fire on the rows tried (a label drop, torch.rand(n) < "
        "p); the export would refuse the graph, after the whole training",
        hint=RANDOM_HINT,
    )


class _FirstDraw(TorchDispatchMode):
    """Records the innermost frame of the user's code on the stack at the first op that draws from a generator
    (the ops torch tags ``nondeterministic_seeded``: rand, randn, bernoulli, dropout...)."""

    def __init__(self) -> None:
        super().__init__()
        self.site: traceback.FrameSummary | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.site is None and torch.Tag.nondeterministic_seeded in func.tags:
            self.site = next((f for f in reversed(traceback.extract_stack()) if is_user_file(f.filename)), None)
        return func(*args, **(kwargs or {}))


def _draw_site(model: nn.Module, x: Inputs) -> str:
    """``name() at file:line`` of the user's code that drew first in a forward of ``x`` (a copy), or "" where no
    frame of the user's drew (a library's layer) or the forward fails under the recording mode."""
    finder = _FirstDraw()
    try:
        with finder:
            _outputs(model, rebuild(x, [t.clone() for t in tensors(x)]))
    except Exception:  # only the message's detail is at stake
        return ""
    return where(finder.site) if finder.site else ""


def _generator_states() -> list[torch.Tensor]:
    """The states of torch's default generators: the CPU one, and each GPU's where CUDA is initialised."""
    states = [torch.get_rng_state()]
    return states + (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])


def _restore_generators(saved: list[torch.Tensor]) -> None:
    """Put the default generators back as :func:`_generator_states` read them."""
    torch.set_rng_state(saved[0])
    if len(saved) > 1:
        torch.cuda.set_rng_state_all(saved[1:])


def _outputs(model: nn.Module, x: Inputs) -> dict[str, np.ndarray]:
    """The model's outputs on ``x`` by name, as the export's reference computes them."""
    with torch.no_grad():
        return host_arrays(named_outputs(model, x))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))


def _moved_output(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> str | None:
    """The first output that differs between two calls beyond arithmetic's repetition, in words; None if none."""
    for name, a in first.items():
        b = second[name]
        if a.shape != b.shape:
            return f"output '{name}': shape {a.shape}, then {b.shape}"
        if a.dtype.kind != "f":
            if not np.array_equal(a, b):
                return f"output '{name}': {int(np.sum(a != b))} of {a.size} values"
            continue
        err = max_abs_err(a, b)
        finite = np.abs(a[np.isfinite(a)])
        if err > max(_RANDOM_FLOOR, _RANDOM_SHARE * (float(finite.max()) if finite.size else 0.0)):
            return f"output '{name}': by up to {err:.3g}"
    return None


def module_layout(model: nn.Module) -> dict[str, str]:
    """Each submodule's qualified name -> its class name, and each state_dict key -> ``"state"``: what
    :func:`refuse_changed_layout` compares after the export's forwards. Read before the model's first forward."""
    layout = {name or "(the model)": type(m).__name__ for name, m in model.named_modules()}
    return layout | {f"state_dict[{k}]": "state" for k in model.state_dict()}


def built_layout(name: str, params: dict[str, Any] | None) -> dict[str, str]:
    """:func:`module_layout` of the model as its factory builds it, never run: the export's model may come from an
    earlier stage that already called it (a skipped training's probe). Built on the meta device where the factory
    allows (no weights allocated or initialised), else as usual; torch's generators are left as they were."""
    saved = _generator_states()
    try:
        with torch.device("meta"):
            return module_layout(build_model(name, params))
    except Exception:  # a factory that needs real tensors (loads weights, calls .item()): built as usual
        return module_layout(build_model(name, params))
    finally:
        _restore_generators(saved)


def refuse_changed_layout(before: dict[str, str], model: nn.Module) -> None:
    """A ModelError where the model's forwards replaced, added or removed submodules or weights since ``before``
    (:func:`module_layout` or :func:`built_layout`): the model every check compared the graph with is then not the
    one the user built (transformers' BigBird ``block_sparse`` swaps its attention for full attention on its first
    call at a short length, for good), so an engine that passes is held to another model's function."""
    after = module_layout(model)
    changed = [
        f"{k}: {before.get(k, '(none)')} -> {after.get(k, '(none)')}"
        for k in sorted(before.keys() | after.keys())
        if before.get(k) != after.get(k)
    ]
    if not changed:
        return
    shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise ModelError(
        f"the model's forward changes the model itself ({shown}): the graph and every check would follow the changed "
        "model, not the one its factory builds",
        hint="use a configuration that does not switch at run time (BigBird: attention_type: original_full), or keep "
        "the data and signature.shapes all on one side of the switch (BigBird: lengths it runs block-sparse)",
    )
