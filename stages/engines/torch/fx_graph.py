"""Small edits of a ``torch.fx`` graph module shared by the torch engine's rewrites (GEMM and convolution epilogues):
read a tensor attribute by its dotted name, replace a node by a call, drop attributes nothing reads any more."""

from __future__ import annotations

from functools import reduce
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the engines' modules load without it
    from torch import fx


def attr(gm: fx.GraphModule, target: str) -> Any:
    """The attribute a ``get_attr`` node with this target reads (``layer.0.conv.weight``)."""
    return reduce(getattr, target.split("."), gm)


def replace_node(graph: fx.Graph, old: fx.Node, op: object, args: tuple[object, ...]) -> fx.Node:
    """``old`` replaced by a call of ``op`` on ``args`` (its shape metadata kept), then erased; returns the call."""
    with graph.inserting_before(old):
        new = graph.call_function(op, tuple(args))
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new


def drop_unused_attrs(gm: fx.GraphModule, targets: set[str]) -> None:
    """The attributes named in ``targets`` deleted from ``gm`` where no node reads them any more (a weight tied to
    another layer stays), with the ``get_attr`` nodes left without users."""
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "get_attr" and n.target in targets and not n.users]:
        graph.erase_node(node)
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    for target in targets - read:
        owner, _, leaf = target.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)
