"""Entropy (KL divergence) thresholds from ONNX Runtime's calibration histograms.

ONNX Runtime's ``HistogramCollector.get_entropy_threshold`` tries every candidate threshold with Python-level sums
over the histogram: at the 2048 bins Kiln uses (:data:`kiln.calibration.ranges.ENTROPY_BINS`) that is about 0.4 s a
tensor, most of a small model's precision stage. :func:`entropy_threshold` runs the same search with numpy
reductions, in the same float32 arithmetic, so it picks the same threshold (the tests compare it with ORT's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

EPS = 0.0001  # ORT's smooth_distribution default
F32 = np.float32
# A tensor whose magnitude passes this has no histogram: ORT spans [-amax, amax], whose width overflows float32.
# Such values are fills (Hugging Face's attention mask adds finfo(float32).min), not a distribution to clip.
HISTOGRAM_LIMIT = float(np.finfo(np.float32).max) / 2


def _smooth(counts: np.ndarray) -> np.ndarray | None:
    """ORT's ``smooth_distribution``: zero bins get ``EPS``, taken off the others; None when every bin is 0."""
    zeros = counts == 0
    n_zeros = int(np.count_nonzero(zeros))
    n_nonzeros = counts.size - n_zeros
    if not n_nonzeros:
        return None
    eps1 = EPS * float(n_zeros) / float(n_nonzeros)
    return counts.astype(F32) + np.where(zeros, F32(EPS), F32(-eps1))


def _divergence(p: np.ndarray | None, q: np.ndarray | None) -> float:
    """KL(p || q) of two smoothed (positive) distributions, normalised as ORT's ``entropy`` does."""
    if p is None or q is None:
        return float("inf")
    p = p / np.sum(p)
    q = q / np.sum(q)
    return float(F32(np.sum(p * np.log(p / q))))


def _candidate(hist: np.ndarray, csum: np.ndarray, start: int, end: int, num_quantized_bins: int) -> float:
    """Divergence between the histogram clipped to ``[start, end)`` (outliers added to its end bins) and that
    slice merged into ``num_quantized_bins`` bins and spread back over its non-empty bins (ORT's construction)."""
    sliced = hist[start:end]
    p = sliced.copy()
    p[0] += csum[start]
    p[-1] += csum[-1] - csum[end]
    width = sliced.size // num_quantized_bins
    body = num_quantized_bins * width
    merged = sliced[:body].reshape(num_quantized_bins, width).sum(axis=1)
    merged[-1] += csum[end] - csum[start + body]
    filled = np.count_nonzero(p[:body].reshape(num_quantized_bins, width), axis=1)
    per_bin = np.where(filled > 0, merged / np.maximum(filled, 1), 0).astype(np.int64)  # ORT truncates so too
    q = np.zeros(sliced.size, dtype=np.int64)
    q[:body] = np.repeat(per_bin, width)
    return _divergence(_smooth(p), _smooth(q))


def entropy_threshold(histogram: tuple[Any, ...], num_quantized_bins: int) -> tuple[Any, Any]:
    """The ``(low, high)`` range with the least KL divergence for one tensor's histogram, a tuple as ORT's
    collector keeps it (``hist, edges, min, max, ...``), clamped to the values seen."""
    hist = np.asarray(histogram[0], dtype=np.int64)
    edges, lowest, highest = histogram[1], histogram[2], histogram[3]
    zero, half = hist.size // 2, num_quantized_bins // 2
    csum = np.concatenate(([0], np.cumsum(hist)))
    bounds = [(zero - i, min(zero + i + 1, hist.size)) for i in range(half, zero + 1)]
    divergence = [_candidate(hist, csum, s, e, num_quantized_bins) for s, e in bounds]
    start, end = bounds[int(np.argmin(divergence))]
    low, high = edges[start], edges[end]
    return (lowest if low < lowest else low), (highest if high > highest else high)


def beyond_histograms(histograms: dict[str, tuple[Any, ...]]) -> list[str]:
    """Tensors whose magnitude is past :data:`HISTOGRAM_LIMIT`: no histogram over ``[-amax, amax]`` exists for
    them, so their range is the values seen."""
    return sorted(name for name, h in histograms.items() if max(abs(float(h[2])), abs(float(h[3]))) > HISTOGRAM_LIMIT)


def entropy_ranges(histograms: dict[str, tuple[Any, ...]], num_quantized_bins: int) -> Any:
    """ORT ``TensorsData`` (entropy) of every collected tensor: ``(low, high, hist, edges)`` as ORT's
    ``compute_data`` gives, the range from :func:`entropy_threshold`, or the values seen for a tensor beyond a
    histogram (:func:`beyond_histograms`)."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

    wide = set(beyond_histograms(histograms))
    data = {}
    for name, h in histograms.items():
        low, high = (h[2], h[3]) if name in wide else entropy_threshold(h, num_quantized_bins)
        data[name] = (np.asarray(low, dtype=h[1].dtype), np.asarray(high, dtype=h[1].dtype), h[0], h[1])
    return TensorsData(CalibrationMethod.Entropy, data)
