"""FP16 mixed precision: onnxconverter-common's ``convert_float_to_float16`` with Kiln's node selection, plus
the fixes it lacks (shared initializers, kept output types, Cast chains), checked by the ONNX checker."""

from __future__ import annotations

import logging
import re

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.core.errors import ModelError
from kiln.core.onnx_io import check_onnx, infer_shapes
from kiln.stages.precision.casts import FLOAT_ONNX, cast_chains, remove_cast_chains
from kiln.stages.precision.config import FP16Config

log = logging.getLogger("kiln.precision")


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Node names are how FP32 islands are chosen and reported: give unnamed nodes stable, unique names."""
    seen: set[str] = set()
    for i, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            n.name = f"{n.op_type}_{i}"
        seen.add(n.name)
    return model


def split_shared_initializers(model: onnx.ModelProto, fp32_nodes: set[str]) -> int:
    """Give FP32 nodes their own copy of initializers they share with FP16 nodes.

    The converter converts an initializer only if none of its readers is blocked, so a shared one stays FP32
    and the FP16 reader then mixes types (an invalid graph).
    """
    inits = {i.name: i for i in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for name in n.input:
            if name in inits:
                readers.setdefault(name, []).append(n)
    copies = 0
    for name, nodes in readers.items():
        kept = [n for n in nodes if n.name in fp32_nodes]
        if not kept or len(kept) == len(nodes) or inits[name].data_type != onnx.TensorProto.FLOAT:
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[name])
        copy.name = f"{name}__fp32"
        model.graph.initializer.append(copy)
        for n in kept:
            for i, inp in enumerate(n.input):
                if inp == name:
                    n.input[i] = copy.name
        copies += 1
    return copies


def restore_output_types(converted: onnx.ModelProto, original: onnx.ModelProto) -> None:
    """With ``keep_io_types`` the converter still retypes an output made by a blocked node as FP16; put the
    original type back on the output and on the Cast that writes it (the cast clean-up then drops it).
    Nodes inside the graph that read that output were converted to read FP16: they keep an FP16 Cast."""
    producers = {o: n for n in converted.graph.node for o in n.output}
    want = {o.name: o.type.tensor_type.elem_type for o in original.graph.output}
    for out in converted.graph.output:
        t = want.get(out.name)
        if t is None or out.type.tensor_type.elem_type == t:
            continue
        out.type.tensor_type.elem_type = t
        node = producers.get(out.name)
        if node is not None and node.op_type == "Cast":
            _retype_output_cast(converted, node, t)
        else:
            raise ModelError(
                f"FP16 conversion changed the type of output '{out.name}'",
                hint="set precision.fp16.keep_io_types: false, or report the model to Kiln",
            )


def _retype_output_cast(model: onnx.ModelProto, cast: onnx.NodeProto, to: int) -> None:
    """Make the graph output written by ``cast`` type ``to``. Internal readers of that output expect the type
    the converter gave it, so when there are any, ``cast`` keeps its type under a new name for them and a
    second Cast writes the output."""
    out = cast.output[0]
    readers = [n for n in model.graph.node if out in n.input]
    if readers:
        taken = {t for n in model.graph.node for t in n.output} | {i.name for i in model.graph.initializer}
        inner, i = f"{out}__internal", 0
        while inner in taken:
            i += 1
            inner = f"{out}__internal_{i}"
        cast.output[0] = inner
        for n in readers:
            for k, name in enumerate(n.input):
                if name == out:
                    n.input[k] = inner
        pos = list(model.graph.node).index(cast) + 1
        model.graph.node.insert(
            pos, helper.make_node("Cast", [cast.input[0]], [out], name=f"{cast.name}_output", to=to)
        )
        return
    del cast.attribute[:]
    cast.attribute.append(helper.make_attribute("to", to))


def casts_from_non_float(model: onnx.ModelProto) -> set[str]:
    """Cast nodes that make FP32 from a non-float tensor (``mask = (x > 0).float()``). The converter types their
    output FP16 but leaves ``to=FLOAT``, an invalid graph; blocked, they stay FP32 and it casts after them."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    types |= {i.name: i.data_type for i in model.graph.initializer}
    return {
        n.name
        for n in model.graph.node
        if _cast_to(n) == onnx.TensorProto.FLOAT and types.get(n.input[0], 0) not in FLOAT_ONNX
    }


def rewire_output_readers(converted: onnx.ModelProto, fp32_nodes: set[str]) -> int:
    """With ``keep_io_types`` the converter ends an FP16 branch that is a graph output with a Cast to FP32, but
    leaves the graph's own FP16 readers of that output reading the FP32 copy (a type clash). Point them at the
    FP16 tensor before the Cast; FP32 readers keep the output."""
    from onnxconverter_common import float16

    outputs = {o.name for o in converted.graph.output}
    fp32 = fp32_nodes | {n.name for n in converted.graph.node if n.op_type in float16.DEFAULT_OP_BLOCK_LIST}
    rewired = 0
    for cast in [n for n in converted.graph.node if _cast_to(n) == onnx.TensorProto.FLOAT and n.output[0] in outputs]:
        for n in converted.graph.node:
            if n is cast or n.name in fp32 or n.op_type == "Cast":
                continue
            for i, name in enumerate(n.input):
                if name == cast.output[0]:
                    n.input[i] = cast.input[0]
                    rewired += 1
    return rewired


def _cast_to(node: onnx.NodeProto) -> int | None:
    """The target type of a Cast node, else None."""
    if node.op_type != "Cast":
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


# Each round keeps one more node the converter broke in FP32; a graph needing more has a pattern to report.
MAX_UNCONVERTIBLE = 32
CHECKER_FAILS = ("FP16 model fails the ONNX checker", "ONNX shape inference failed")  # messages naming a node
_CHECKER_NODE = re.compile(r"node name: ([^)]+)\)")


def constants_as_tensors(graph: onnx.GraphProto) -> int:
    """Rewrite ``Constant(value_float=...)`` / ``Constant(value_floats=[...])`` as ``Constant(value=tensor)``,
    in subgraphs too. onnxconverter-common converts tensor attributes but not these float lists, yet types
    their output FP16: the checker then refuses the graph (the dynamo exporter writes such constants, e.g.
    in ``nn.EmbeddingBag``). The same values as a tensor attribute convert like any other."""
    changed = 0
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                changed += constants_as_tensors(sub)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for attr in list(node.attribute):
            if attr.name in ("value_float", "value_floats"):
                value = np.float32(attr.f) if attr.name == "value_float" else np.asarray(attr.floats, np.float32)
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.asarray(value))))
                changed += 1
    return changed


def convert_fp16(model: onnx.ModelProto, fp32_nodes: set[str], cfg: FP16Config) -> tuple[onnx.ModelProto, dict]:
    """The FP16 graph with ``fp32_nodes`` (plus the converter's own block list) left in FP32.

    A node whose conversion the ONNX checker refuses (a converter pattern not fixed above) stays FP32 too,
    one per round: ``stats["unconvertible"]`` says which, with the checker's reason."""
    unconvertible: dict[str, str] = {}
    names = {n.name for n in model.graph.node}
    while True:
        try:
            converted, stats = _convert_once(model, fp32_nodes | set(unconvertible), cfg)
            return converted, {**stats, "unconvertible": unconvertible}
        except ModelError as exc:
            found = _CHECKER_NODE.search(exc.message) if exc.message.startswith(CHECKER_FAILS) else None
            node = found.group(1) if found else None
            if node not in names or node in unconvertible or node in fp32_nodes:
                raise  # not a node the checker names, or keeping it FP32 did not help: the user must decide
            if len(unconvertible) >= MAX_UNCONVERTIBLE:
                raise ModelError(
                    f"{exc.message} (after keeping {len(unconvertible)} unconvertible nodes in FP32)", hint=exc.hint
                ) from None
            # handled (the node stays FP32, the variant's record says why): nothing for the user to do
            log.info("fp16: node %s does not convert (%s); keeping it FP32", node, exc.message)
            unconvertible[node] = f"FP16 conversion makes an invalid graph here; kept FP32 ({exc.message})"


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def _captured(graph: onnx.GraphProto) -> set[str]:
    """Outer-scope tensors a subgraph (or its own subgraphs) reads by name, not through its inputs."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    need: set[str] = set()
    for n in graph.node:
        for sub in _subgraphs(n):
            need |= _captured(sub) - known
        need |= {i for i in n.input if i and i not in known}
        known |= set(n.output)
    return need


def _rename_inputs(graph: onnx.GraphProto, old: str, new: str) -> None:
    for n in graph.node:
        for i, name in enumerate(n.input):
            if name == old:
                n.input[i] = new
        for sub in _subgraphs(n):
            if old not in {i.name for i in sub.input} | {o for m in sub.node for o in m.output}:
                _rename_inputs(sub, old, new)


def cast_captured_to_fp32(converted: onnx.ModelProto, original: onnx.ModelProto, fp32_nodes: set[str]) -> int:
    """A Loop/If/Scan kept FP32 reads outer tensors by name inside its body, which the converter does not see:
    it may make them FP16 while the FP32 body expects FP32. Give each such FP32-in-the-original tensor a Cast
    to FP32 of its own and let the body read that (a Cast of an FP32 tensor is dropped by the cast clean-up).
    Done by hand: onnxconverter-common only casts a blocked node's listed inputs."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*original.graph.value_info, *original.graph.input]}
    types |= {i.name: i.data_type for i in original.graph.initializer}
    added = 0
    for pos, node in reversed(list(enumerate(converted.graph.node))):
        if node.name not in fp32_nodes or not _subgraphs(node):
            continue
        for name in sorted(set().union(*(_captured(g) for g in _subgraphs(node)))):
            if types.get(name) != onnx.TensorProto.FLOAT:
                continue
            copy = f"{name}__fp32_for_{node.name}"
            for sub in _subgraphs(node):
                _rename_inputs(sub, name, copy)
            converted.graph.node.insert(
                pos, helper.make_node("Cast", [name], [copy], name=f"{copy}__cast", to=onnx.TensorProto.FLOAT)
            )
            added += 1
    return added


def _convert_once(model: onnx.ModelProto, fp32_nodes: set[str], cfg: FP16Config) -> tuple[onnx.ModelProto, dict]:
    from onnxconverter_common import float16

    src = onnx.ModelProto()
    src.CopyFrom(model)
    constants_as_tensors(src.graph)
    shared = split_shared_initializers(src, fp32_nodes)
    io = {v.name for v in [*src.graph.input, *src.graph.output]}
    kept_info = [v for v in src.graph.value_info if v.name not in io]  # a graph I/O also listed there would be
    del src.graph.value_info[:]  # retyped FP16 behind keep_io_types' back
    src.graph.value_info.extend(kept_info)
    try:
        converted = float16.convert_float_to_float16(
            src,
            keep_io_types=cfg.keep_io_types,
            # Clamp only at FP16's real limits: the range check already kept nodes whose weights do not fit.
            min_positive_val=2.0**-24,
            max_finite_val=65504.0,
            op_block_list=list(float16.DEFAULT_OP_BLOCK_LIST),
            node_block_list=sorted(fp32_nodes | casts_from_non_float(src)),
            # a float16 input of an FP32 model (features stored in half precision) is no sign of a graph converted
            # already, which the converter's check takes it for
            check_fp16_ready=not any(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in src.graph.input),
        )
    except Exception as exc:  # the converter raises plain exceptions on graphs it cannot handle: a user's model
        said = " ".join(str(exc).split())[:300]  # its message spans lines: the error is one
        raise ModelError(
            f"onnxconverter-common cannot convert the graph to FP16 ({type(exc).__name__}: {said})",
            hint="drop fp16 from precision.variants (the other variants are "
            "still built); please report the model to Kiln",
        ) from None
    cast_captured_to_fp32(converted, src, fp32_nodes)
    if cfg.keep_io_types:
        rewire_output_readers(converted, fp32_nodes)
        restore_output_types(converted, model)
    converted, removed = remove_cast_chains(converted, {n.name for n in src.graph.node})
    try:
        converted = infer_shapes(converted)
        check_onnx(converted, "FP16 model")
    except ModelError as exc:  # the export is fine (it passed the checker): re-exporting would not help
        raise ModelError(
            exc.message,
            hint="keep the node it names in FP32 (precision.fp16.fp32_nodes) or drop fp16 "
            "from precision.variants (the other variants are still built); please "
            "report the model to Kiln",
        ) from None
    left = cast_chains(converted)
    if left:  # the pass above guarantees none; a survivor means a new converter pattern
        raise ModelError(f"FP16 graph still has Cast chains: {left[:3]}", hint="report the model to Kiln")
    casts = sum(n.op_type == "Cast" for n in converted.graph.node)
    log.info("fp16: %d nodes kept FP32, %d casts (%d chain/no-op casts removed)", len(fp32_nodes), casts, removed)
    return converted, {"casts": casts, "casts_removed": removed, "shared_initializers_split": shared}
