"""INT8 calibration: data batches, cached activation ranges, Q/DQ quantization, TensorRT calibration table."""
