import torch

from kiln.models.transformer import TransformerClassifier, explicit_attention
from kiln.stages.export.torch_export import export_onnx


def test_fused_attention_is_the_exported_function_forward_and_backward() -> None:
    # Training runs scaled_dot_product_attention, the ONNX graph the explicit ops: they must be one function.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    explicit = explicit_attention(q, k, v)
    assert torch.allclose(fused, explicit, atol=1e-12)
    g_fused = torch.autograd.grad(fused.square().sum(), (q, k, v))
    g_explicit = torch.autograd.grad(explicit.square().sum(), (q, k, v))
    for a, b in zip(g_fused, g_explicit):
        assert torch.allclose(a, b, atol=1e-10)


def test_export_writes_attention_out_op_by_op(tmp_path) -> None:
    # The optimizer's QKV merge and ORT's attention fusion look for MatMul -> Softmax -> MatMul; a fused SDPA
    # node (or its decomposition) in the graph would hide the pattern.
    torch.manual_seed(0)
    model = TransformerClassifier(layers=1).eval()
    x = torch.randn(2, 1, 8, 8)
    proto = export_onnx(model, x, tmp_path / "m.onnx")
    producer = {o: n for n in proto.graph.node for o in n.output}
    (softmax,) = [n for n in proto.graph.node if n.op_type == "Softmax"]
    scale = producer[softmax.input[0]]
    assert scale.op_type == "Div" and producer[scale.input[0]].op_type == "MatMul"
    # SDPA's export scales q and k separately by sqrt(sqrt(1/d)) computed in the graph.
    assert "Sqrt" not in {n.op_type for n in proto.graph.node}
