"""The check's gates on an integer output of levels (a generator's uint8 pixels): held to their error as a float
output is, where one level off is no wrong answer; class ids beside their logits stay held to equal values."""

from __future__ import annotations

import numpy as np

from kiln.stages.accuracy.check import Reference
from tests.stages.accuracy.judging import judged

W = np.random.default_rng(1).standard_normal((8, 3 * 16 * 16))


def image(x: np.ndarray) -> np.ndarray:
    """A generator's tanh image [N, 3, 16, 16] of latents ``x`` [N, 8]."""
    return np.tanh(x @ W).reshape(len(x), 3, 16, 16)


def pixels(img: np.ndarray) -> dict[str, np.ndarray]:
    return {"pixels": np.clip(np.round((img + 1.0) * 127.5), 0, 255).astype(np.uint8)}


def reference() -> Reference:
    x = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    return Reference(lambda feed: pixels(image(feed["x"])), [({}, {"x": x})], [None], None, 16)


def test_pixels_one_level_off_pass_fp16_and_pixels_far_off_fail_naming_what_held_them() -> None:
    """FP16's 4e-4 on the tanh image moves a few percent of the pixels one level: "0.97 of its values equal <
    min_top1_agreement 0.99" left the FP16 variant unmade, as if they were class ids."""
    ref = reference()
    fp16 = lambda feed: pixels(image(feed["x"]) + 4e-4 * np.sin(1e3 * image(feed["x"])))  # noqa: E731
    entry, failures = judged(ref, fp16, [1, 16], "fp16")
    assert failures == [], failures
    assert ref.levels == {"pixels"} and entry.outputs["pixels"]["levels"] >= 100

    def broken(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        img = image(feed["x"])
        img[:, 0] = -img[:, 0]  # one channel inverted
        return pixels(img)

    _, failures = judged(ref, broken, [1, 16], "fp16")
    assert failures and all("output 'pixels' (integer values of" in f for f in failures), failures
    assert any("held to their error as a float output is" in f and "cosine" in f for f in failures), failures


def test_class_ids_beside_their_logits_are_no_levels() -> None:
    """An argmax of 128 classes fills its range densely, as pixel values do: its values within the logits' class
    axis make it their class ids, compared value for value."""
    from kiln.stages.accuracy.check import level_outputs

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((512, 128)).astype(np.float32)
    outputs = {"logits": logits, "label": logits.argmax(-1), **pixels(image(rng.standard_normal((512, 8))))}
    assert level_outputs(outputs, "logits") == {"pixels"}
    assert level_outputs(outputs, None) == {"pixels", "label"}  # with no logits to say so, they read as levels
