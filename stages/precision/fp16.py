"""FP16 mixed precision: onnxconverter-common's ``convert_float_to_float16`` with Kiln's node selection, plus
the fixes it lacks (shared initializers, kept output types, Cast chains), checked by the ONNX checker."""
from __future__ import annotations

import logging

import onnx
from kiln.core.errors import ModelError
from kiln.core.onnx_io import check_onnx, infer_shapes
from kiln.stages.precision.casts import FLOAT_ONNX, cast_chains, remove_cast_chains
from kiln.stages.precision.config import FP16Config
from onnx import helper

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
            raise ModelError(f"FP16 conversion changed the type of output '{out.name}'",
                             hint="set precision.fp16.keep_io_types: false, or report the model to Kiln")


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
        model.graph.node.insert(pos, helper.make_node("Cast", [cast.input[0]], [out], name=f"{cast.name}_output", to=to))
        return
    del cast.attribute[:]
    cast.attribute.append(helper.make_attribute("to", to))


def casts_from_non_float(model: onnx.ModelProto) -> set[str]:
    """Cast nodes that make FP32 from a non-float tensor (``mask = (x > 0).float()``). The converter types their
    output FP16 but leaves ``to=FLOAT``, an invalid graph; blocked, they stay FP32 and it casts after them."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    types |= {i.name: i.data_type for i in model.graph.initializer}
    return {n.name for n in model.graph.node
            if _cast_to(n) == onnx.TensorProto.FLOAT and types.get(n.input[0], 0) not in FLOAT_ONNX}


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


def convert_fp16(model: onnx.ModelProto, fp32_nodes: set[str], cfg: FP16Config) -> tuple[onnx.ModelProto, dict]:
    """The FP16 graph with ``fp32_nodes`` (plus the converter's own block list) left in FP32."""
    from onnxconverter_common import float16

    src = onnx.ModelProto()
    src.CopyFrom(model)
    shared = split_shared_initializers(src, fp32_nodes)
    io = {v.name for v in [*src.graph.input, *src.graph.output]}
    kept_info = [v for v in src.graph.value_info if v.name not in io]  # a graph I/O also listed there would be
    del src.graph.value_info[:]                                          # retyped FP16 behind keep_io_types' back
    src.graph.value_info.extend(kept_info)
    converted = float16.convert_float_to_float16(
        src, keep_io_types=cfg.keep_io_types,
        # Clamp only at FP16's real limits: the range check already kept nodes whose weights do not fit.
        min_positive_val=2.0**-24, max_finite_val=65504.0,
        op_block_list=list(float16.DEFAULT_OP_BLOCK_LIST),
        node_block_list=sorted(fp32_nodes | casts_from_non_float(src)))
    if cfg.keep_io_types:
        rewire_output_readers(converted, fp32_nodes)
        restore_output_types(converted, model)
    converted, removed = remove_cast_chains(converted)
    converted = infer_shapes(converted)
    check_onnx(converted, "FP16 model")
    left = cast_chains(converted)
    if left:  # the pass above guarantees none; a survivor means a new converter pattern
        raise ModelError(f"FP16 graph still has Cast chains: {left[:3]}", hint="report the model to Kiln")
    casts = sum(n.op_type == "Cast" for n in converted.graph.node)
    log.info("fp16: %d nodes kept FP32, %d casts (%d chain/no-op casts removed)", len(fp32_nodes), casts, removed)
    return converted, {"casts": casts, "casts_removed": removed, "shared_initializers_split": shared}
