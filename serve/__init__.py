"""Serving built engines: a Triton server over a workdir's validated engines, and a load test against it."""
