"""Graph optimization: registered onnx-graphsurgeon passes (see ``registry.PASSES``), run in order with a
safety net that rolls back any pass that changes the model's outputs."""
