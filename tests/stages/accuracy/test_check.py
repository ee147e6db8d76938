"""The shared check's reference: labels that do not fit the class-logit output are one error naming both shapes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from kiln.core.errors import ModelError
from kiln.stages.accuracy.check import Reference, placed_failure


def reference(logits_shape: tuple[int, ...], labels: np.ndarray, named: bool = False) -> Reference:
    """The reference of a model whose output ``logits`` is the class logits: by default as the data's classes make
    it (their count its class axis's width), ``named`` as signature.logits_output names it."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.accuracy.check import class_axis

    x = np.zeros((logits_shape[0], 3), np.float32)
    out = np.random.default_rng(0).standard_normal(logits_shape).astype(np.float32)
    run = lambda feed: {"logits": out[: len(feed["x"])]}  # noqa: E731
    y = torch.from_numpy(labels)
    data = DatasetSplits(torch.from_numpy(x), y, torch.from_numpy(x), y, logits_shape[class_axis(len(logits_shape))])
    return Reference(run, [({}, {"x": x})], [labels], "logits", 4, data=data, named=named)


@pytest.mark.parametrize(
    "logits_shape, labels_shape",
    [((4, 10), (4, 2)), ((4, 5, 10), (4,)), ((4, 3, 8, 8), (4, 8, 9)), ((4, 10), (3,))],
)
def test_labels_that_do_not_fit_the_logits_are_named(logits_shape: tuple, labels_shape: tuple) -> None:
    with pytest.raises(ModelError, match=rf"labels int64\[{', '.join(map(str, labels_shape))}\] do not fit"):
        reference(logits_shape, np.zeros(labels_shape, np.int64))


def test_labels_that_do_not_fit_a_named_output_score_no_accuracy_and_keep_its_top1(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A question-answering head named in signature.logits_output (``start_logits [N, seq]``) beside span labels
    ``[N, 2]`` its user's loss and metric read: the run failed at the precision stage, its fix to name the output
    in the setting that named it; the named output is held to top-1 agreement whatever the data holds."""
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    ref = reference((4, 10), np.zeros((4, 2), np.int64), named=True)
    assert ref.accuracy is None and ref.logits == "logits"
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("do not fit the class-logit output 'logits'" in m and "no task accuracy" in m for m in said), said


def test_labels_per_row_and_per_position_fit() -> None:
    assert reference((4, 10), np.zeros(4, np.int64)).accuracy is not None
    assert reference((4, 5, 10), np.zeros((4, 5), np.int64)).accuracy is not None
    assert reference((4, 3, 8, 8), np.zeros((4, 8, 8), np.int64)).accuracy is not None


def test_an_integer_output_is_held_to_its_share_of_equal_values_not_a_cosine() -> None:
    from kiln.core.records import EngineValidation
    from kiln.stages.accuracy.check import accuracy_failures, compare_all, summarize
    from kiln.stages.accuracy.config import GatesConfig

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 4)).astype(np.float32)
    ref = {"logits": logits, "label": logits.argmax(-1)}
    flipped = ref["label"].copy()
    flipped[:2] = (flipped[:2] + 1) % 4  # two of 64 predictions differ: 0.96875 equal
    stats = compare_all(ref, {"logits": logits, "label": flipped}, "logits")
    assert stats["label"].cosine is None and stats["label"].top1_agreement == pytest.approx(62 / 64)
    entry = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    summarize(entry, stats, "logits")
    assert entry.cosine == pytest.approx(1.0)  # the logits' cosine: the labels have none
    assert entry.max_abs_err == 0.0  # the logits' too: a class index one off is no error of 1.0 in the answers
    assert stats["label"].max_abs_err == 1.0  # the label's own row keeps it
    gates = {**GatesConfig().model_dump(), "min_top1_agreement": 0.97, "max_abs_err": None}
    assert accuracy_failures(entry, gates, None) == [
        "output 'label' 0.9688 of its values equal < min_top1_agreement 0.97"
    ]
    gates["min_top1_agreement"] = 0.95
    assert accuracy_failures(entry, gates, None) == []


def test_an_output_whose_length_the_values_decide_is_compared_on_whole_batches() -> None:
    from kiln.stages.accuracy.check import compare_all

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = feed["x"] @ np.ones((3, 4), np.float32)
        return {"logits": scores, "positives": np.argwhere(scores > 0.5)}  # torch.nonzero's [u0, 2]

    x = np.random.default_rng(0).standard_normal((20, 3)).astype(np.float32)
    ref = Reference(run, [({}, {"x": x})], [None], "logits", 8)
    assert ref.coupled == ["positives"]  # its rows are not the samples: whole batches, the reference run at each
    assert len(ref.feed["x"]) == 16  # two whole batches of 8
    np.testing.assert_array_equal(ref.at_batch(0, 8)["positives"], run({"x": x[:8]})["positives"])
    got = run({"x": x[:8]})
    with pytest.raises(
        ModelError, match="output 'positives' has 3 rows where the reference's has .*follows the values"
    ):
        compare_all(run({"x": x[:8]}), {**got, "positives": got["positives"][:3]}, "logits")


@pytest.mark.parametrize("sizes", [[1, 8], [8]])
def test_a_scalar_output_is_compared_per_whole_batch(sizes: list[int]) -> None:
    """An output with no batch axis at all (a batch's mean) is one value per batch: compared on whole batches, the
    reference run at each batch size, also with one validated size and rows in whole batches (no shorter batch to
    probe against), where it was a ValueError from concatenating 0-d arrays."""
    from kiln.stages.accuracy.check import compare_on

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = feed["x"] @ np.ones((3, 4), np.float32)
        return {"logits": logits, "mean": np.float32(logits.mean())}

    x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    ref = Reference(run, [({}, {"x": x})], [None], "logits", max(sizes), min(sizes))
    assert ref.coupled == ["mean"] and ref.outputs[0]["mean"].shape == (2,)  # one value per batch of 8
    assert ref.at_batch(0, 1)["mean"].shape == ()
    got = compare_on(ref, run, sizes)
    assert got.stats["mean"].max_abs_err == 0.0 and got.stats["logits"].max_abs_err == 0.0


def test_multi_label_integer_targets_are_told_to_come_as_floats() -> None:
    from kiln.stages.accuracy.check import check_labels_fit

    logits = np.zeros((4, 6), np.float32)
    check_labels_fit(logits, np.zeros(4, np.int64), "logits")  # one class index per row: fits
    with pytest.raises(ModelError) as err:
        check_labels_fit(logits, np.zeros((4, 6), np.int64), "logits")
    assert "return them as floats" in err.value.hint and "multilabel_f1" in err.value.hint
    with pytest.raises(ModelError) as err:
        check_labels_fit(logits, np.zeros((4, 2), np.int64), "logits")
    assert "signature.logits_output" in err.value.hint


def test_top1_agreement_is_a_rate_over_the_held_out_rows_not_one_spot_checked_row() -> None:
    """Two choices, row 0 a near-tie an engine flips at batch 1 only: 63 of 64 rows agree at the largest batch
    and all 64 in the whole run, so agreement is 1.0; the spot check at batch 1 made it 0.0 (failing the gate)."""
    from kiln.stages.accuracy.check import compare_on

    x = np.random.default_rng(0).standard_normal((64, 2)).astype(np.float32)
    x[0] = [0.5, 0.5004]

    def reference_run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": feed["x"].copy()}

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = feed["x"].copy()
        if len(out) == 1:  # another kernel at batch 1: the near-tie goes the other way
            out[:, 0] += 0.001
        return {"logits": out}

    ref = Reference(reference_run, [({}, {"x": x})], [None], "logits", 8, 1)
    got = compare_on(ref, engine, [1, 8])
    assert got.stats["logits"].top1_agreement == 1.0
    assert got.stats["logits"].max_abs_err == pytest.approx(0.001, rel=1e-3)  # the batch-1 kernel's error counts


class _CausalLM(torch.nn.Module):
    """A tiny causal language model: each position's logits from the mean of the embeddings up to it."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).cumsum(1) / torch.arange(1, idx.shape[1] + 1).view(1, -1, 1)
        return self.head(h)


def test_next_token_labels_follow_the_input_to_validated_lengths_past_the_data() -> None:
    """Data of length 16 validated at ``signature.shapes: {seq: [4, 24]}``: the labels are cut to 4 and repeated to
    24 as the input is, and accuracy is measured at the data's own length, 16, validated beside them (within their
    range). Before: the padded last point was taken for the data's own shape, and labels [N, 16] did not fit the
    logits [N, 24, vocab]."""
    from kiln.core.data import DatasetSplits, as_feed
    from kiln.core.labels import accuracy
    from kiln.stages.accuracy.check import held_out, held_out_reference
    from kiln.stages.accuracy.config import CheckConfig

    vocab = 10
    seqs = (torch.randint(0, vocab, (24, 1), generator=torch.Generator().manual_seed(0)) + torch.arange(17)) % vocab
    x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    data = DatasetSplits(x[:16], y[:16], x[16:], y[16:], num_classes=vocab)
    model, axes = _CausalLM(vocab).eval(), {"input": {1: "seq"}}

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {"logits": model(torch.from_numpy(feed["input"])).numpy()}

    feeds = held_out(data, lambda v: as_feed(v, ["input"]), axes, {"seq": [4, 24]}, None)
    assert [p for p, _ in feeds] == [{"seq": 4}, {"seq": 24}]
    ref = held_out_reference(run, feeds, data, "logits", CheckConfig(), [1, 8], axes)
    assert [p for p, _ in ref.feeds] == [{"seq": 4}, {"seq": 16}, {"seq": 24}]
    short, same, long = ref.point_labels
    assert np.array_equal(short, y[16:, :4].numpy()) and np.array_equal(same, y[16:].numpy())
    tiled = np.arange(24) % 16  # the input repeats its tokens past the data's length, and its labels with it
    assert np.array_equal(long, y[16:].numpy()[:, tiled])
    own = run({"input": x[16:].numpy()})["logits"]
    assert ref.score == 1 and ref.accuracy == pytest.approx(accuracy(own, same))


def _judged(data: Any, run: Any, engine: Any, precision: str = "int8") -> tuple[Any, list[str]]:
    """An engine judged as validation and the precision stage judge it: the held-out reference of ``data``, the
    comparison at batch sizes 1 and 32, the entry's headline values and the gates of ``precision`` it misses."""
    from kiln.core.data import as_feed
    from kiln.stages.accuracy.check import held_out, held_out_reference
    from kiln.stages.accuracy.config import CheckConfig
    from tests.stages.accuracy.judging import judged

    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = held_out_reference(run, feeds, data, "logits", CheckConfig(), [1, 32], {})
    return judged(ref, engine, [1, 32], precision)


def _embedder() -> tuple[Any, Any]:
    """A backbone without its head (a ViT or timm model with num_classes=0): its only output, a bare [N, 768]
    tensor, is named ``logits`` by default; and an engine of it off by 5 % noise (cosine 0.9994), which flips the
    argmax of 7 % of the rows: among 768 features the two largest lie close."""
    w = np.random.default_rng(0).standard_normal((16, 768)).astype(np.float32)

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": feed["input"] @ w}

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run(feed)["logits"]
        noise = np.sin(out * 7.0 + feed["input"][:, :1] * 13.0)  # a fixed function of the row: the same at any batch
        return {"logits": out + 0.05 * out.std() * noise.astype(np.float32)}

    return run, engine


def test_an_embedding_without_declared_classes_is_not_held_to_top1_agreement() -> None:
    """No labels and no num_classes: the only output's argmax is no class decision, so no top-1 agreement is
    computed or gated; the embedding is held to its cosine (whole and per sample) and its relative error, as an
    output without class logits: its argmax flips on 7 % of the rows, a 'top-1 agreement' of 0.93 that would
    fail an engine at cosine 0.9994 for no class it gets wrong."""
    from kiln.core.data import DatasetSplits

    x = torch.randn(160, 16, generator=torch.Generator().manual_seed(1))
    run, engine = _embedder()
    entry, failures = _judged(DatasetSplits(x[:32], None, x[32:], None), run, engine)
    assert entry.top1_agreement is None and entry.outputs["logits"]["top1_agreement"] is None
    assert entry.cosine > 0.998 and failures == []
    broken = _judged(DatasetSplits(x[:32], None, x[32:], None), run, lambda f: {"logits": 1.5 * run(f)["logits"]})
    assert broken[1] and "relative error" in broken[1][0]  # a scale error: the cosine passes, max_rel_err does not


@pytest.mark.parametrize("labelled", [True, False])
def test_a_classifier_stays_held_to_top1_agreement(labelled: bool) -> None:
    """Integer labels, or num_classes given without labels (a pretrained classifier on unlabelled inputs): the
    only output is class logits, and the same flips fail its top-1 agreement gate."""
    from kiln.core.data import DatasetSplits

    x = torch.randn(160, 16, generator=torch.Generator().manual_seed(1))
    run, engine = _embedder()
    y = torch.as_tensor(run({"input": x.numpy()})["logits"].argmax(1))  # the model's own answers: accuracy 1.0
    data = (
        DatasetSplits(x[:32], y[:32], x[32:], y[32:], 768)
        if labelled
        else DatasetSplits(x[:32], None, x[32:], None, 768)
    )
    entry, failures = _judged(data, run, engine)
    assert entry.top1_agreement is not None and entry.top1_agreement < 0.97
    assert any(f.startswith("top1_agreement") for f in failures)


def test_an_embedding_trained_on_labels_is_not_held_to_top1_agreement() -> None:
    """Labels of 4 classes and a 768-wide output (an embedding trained with a loss of the user's, metric learning):
    its argmax over 768 entries is no class decision, neither for top-1 agreement nor for task accuracy."""
    from kiln.core.data import DatasetSplits

    x = torch.randn(160, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (160,), generator=torch.Generator().manual_seed(2))
    run, engine = _embedder()
    entry, failures = _judged(DatasetSplits(x[:32], y[:32], x[32:], y[32:], 4), run, engine)
    assert entry.top1_agreement is None and entry.accuracy is None
    assert entry.cosine > 0.998 and failures == []


def _seg_data(tiny: int | None = None) -> Any:
    """128 held-out images [3, 8, 8] without labels, of a 4-class task; ``tiny``: that one near blank (1e-4)."""
    from kiln.core.data import DatasetSplits

    x = torch.randn(160, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    if tiny is not None:
        x[32 + tiny] *= 1e-4
    return DatasetSplits(x[:32], None, x[32:], None, num_classes=4)


def _segmenter(held_out: np.ndarray, wrong: int | None = None) -> tuple[Any, Any]:
    """A segmentation head ([N, 4, 8, 8] class maps) and an INT8-like engine of it (values rounded to 1/127 of the
    batch's largest); with ``wrong``, that held-out sample's map is the next sample's (rows mixed up)."""
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": np.einsum("kc,nchw->nkhw", w, feed["input"])}

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run(feed)["logits"]
        step = np.abs(out).max() / 127
        got = np.round(out / step) * step
        if wrong is not None:
            mixed = np.all(feed["input"] == held_out[wrong], axis=(1, 2, 3))
            got[mixed] = run({"input": held_out[wrong + 1 : wrong + 2]})["logits"]
        return {"logits": got.astype(np.float32)}

    return run, engine


def test_one_wrong_sample_of_128_fails_the_cosine_gate() -> None:
    """One held-out map of 128 wrong (past the spot-checked batches' rows): the whole output's cosine (0.9945) and
    the pixels' top-1 agreement (0.983) pass INT8's gates; that sample's cosine (0.31) does not, and the failure
    names it."""
    data = _seg_data()
    entry, failures = _judged(data, *_segmenter(data.val_x.numpy(), wrong=100))
    assert entry.cosine > 0.99 and entry.top1_agreement > 0.97
    assert len(failures) == 1 and "worst sample's cosine" in failures[0] and "(sample 100)" in failures[0]
    stats = entry.outputs["logits"]
    assert stats["sample_cosine"] < 0.5 and stats["worst_sample"] == 100
    ok, none = _judged(data, *_segmenter(data.val_x.numpy()))
    assert none == [] and ok.outputs["logits"]["sample_cosine"] > 0.999


def test_a_near_zero_sample_is_measured_by_its_error_not_its_own_cosine() -> None:
    """A blank input's map, 1e-4 of the others', rounds to zeros in the engine: its own cosine is 0, though its
    error is 1e-4 of a typical sample's. Measured against the median sample norm it passes, and so does the
    engine."""
    data = _seg_data(tiny=50)
    run, engine = _segmenter(data.val_x.numpy())
    assert not engine({"input": data.val_x.numpy()})["logits"][50].any()  # zeroed, where the reference is not
    entry, failures = _judged(data, run, engine)
    assert failures == [] and entry.outputs["logits"]["sample_cosine"] > 0.999


def test_the_worst_sample_over_shapes_keeps_its_row_and_a_nan_is_worst() -> None:
    from kiln.core.compare import OutputStats
    from kiln.stages.accuracy.check import merge_worst

    def stats(sample: float | None, row: int | None) -> dict[str, OutputStats]:
        return {"y": OutputStats(0.1, 0.01, 0.999, None, None, sample, row)}

    assert merge_worst(stats(0.95, 3), stats(0.9, 4))["y"].worst_sample == 4
    assert merge_worst(stats(0.9, 4), stats(0.95, 3))["y"].worst_sample == 4
    nan = merge_worst(stats(0.9, 1), stats(float("nan"), 2))["y"]
    assert np.isnan(nan.sample_cosine) and nan.worst_sample == 2
    assert merge_worst(stats(None, None), stats(0.9, 5))["y"].worst_sample == 5


def test_a_drop_of_exactly_the_gate_passes_it() -> None:
    """113/150 - 110/150 is 0.020000000000000018 in floats: three samples lost of 150 were refused by a gate of
    0.02, which the report shows as a threshold the engine meets."""
    from kiln.core.records import EngineValidation
    from kiln.stages.accuracy.check import accuracy_failures, gates_for
    from kiln.stages.accuracy.config import CheckConfig

    entry = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    entry.cosine, entry.max_abs_err, entry.accuracy = 1.0, 0.0, 110 / 150
    gates = gates_for(CheckConfig(), "int8") | {"max_accuracy_drop": 0.02}
    assert accuracy_failures(entry, gates, 113 / 150) == []
    entry.accuracy = 109 / 150
    assert accuracy_failures(entry, gates, 113 / 150) == ["accuracy drop 0.0267 > max_accuracy_drop 0.02"]


def test_target_sequences_of_another_length_score_no_accuracy(caplog: pytest.LogCaptureFixture) -> None:
    """A CTC model's token ids [N, 24] beside per-frame log-probabilities [N, 63, 30]: its user loss reads them;
    validation measures no accuracy there and counts top-1 agreement over every frame, and says so."""
    with caplog.at_level("WARNING", logger="kiln.validate"):
        ref = reference((4, 63, 30), np.zeros((4, 24), np.int64))
    assert ref.accuracy is None and ref.labelled(0) is None
    assert "labels int64[4, 24] do not follow the positions of class logits 'logits' [4, 63, 30]" in caplog.text


def test_a_metric_over_outputs_coupled_to_their_batch_is_told_how_they_are_stacked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CLIP score matrix [images, texts] per batch reaches the metric as blocks stacked on axis 0: said, with the
    rows of each batch, so that a retrieval metric scores each block and not the stack as one matrix."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"scores": feed["x"] @ feed["x"].T}  # [batch, batch]

    def metric(outputs: dict[str, np.ndarray], labels: np.ndarray) -> float:
        return float(outputs["scores"].shape[0])

    x = np.random.default_rng(0).standard_normal((20, 3)).astype(np.float32)
    with caplog.at_level("WARNING", logger="kiln"):
        ref = Reference(run, [({}, {"x": x})], [None], None, 8, targets=np.zeros(20, np.float32), metric=metric)
    assert ref.metric_value == 16.0  # two batches of 8 stacked
    said = [r.getMessage() for r in caplog.records if "stacked batch by batch" in r.getMessage()]
    assert len(said) == 1 and "2 batches of 8 rows" in said[0] and "rows i*8 to i*8+7" in said[0], said


@pytest.mark.parametrize("width, loud", [(5, True), (768, False)])
def test_a_head_of_another_width_than_the_classes_is_warned_of_when_near_them(
    width: int, loud: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A 5-channel head on 4-class labels (a head sized for other data) is a warning: training took it for class
    logits, validation cannot; a 768-wide embedding trained on those labels stays an INFO line."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.accuracy.check import top1_output

    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,))
    with caplog.at_level("INFO", logger="kiln"):
        assert top1_output("logits", DatasetSplits(x, y, x, y, 4), False, np.zeros((8, width), np.float32)) is None
    levels = [r.levelname for r in caplog.records if "classes" in r.getMessage()]
    assert levels == ["WARNING" if loud else "INFO"], levels


def test_class_logits_with_a_no_object_class_are_warned_of_with_the_name_to_give(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A detector's ``logits`` [N, 10, 6] (5 classes and no-object) beside float box labels and num_classes=5: not
    compared as class logits by default, and said as a warning that names signature.logits_output as the fix (an
    INFO line before, since float labels are no classifier's). An embedding of another width stays an INFO line."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.accuracy.check import top1_output

    x, boxes = torch.randn(8, 3), torch.rand(8, 10, 4)
    data = DatasetSplits(x, boxes, x, boxes, num_classes=5)
    with caplog.at_level("INFO", logger="kiln"):
        assert top1_output("logits", data, False, np.zeros((8, 10, 6), np.float32)) is None
        assert top1_output("logits", data, False, np.zeros((8, 10, 64), np.float32)) is None
    said = [r for r in caplog.records if "logits" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "INFO"], said
    assert "6 classes and the data 5 (one more: a no-object class?)" in said[0].getMessage()
    assert "signature.logits_output" in said[0].getMessage()


def test_the_headline_relative_error_is_the_outputs_beside_the_class_logits() -> None:
    """The class logits' relative error is not gated by default: the headline the report shows is the hidden
    state's, not a larger value of the logits that reads like a failure."""
    from kiln.core.records import EngineValidation
    from kiln.stages.accuracy.check import compare_all, summarize

    rng = np.random.default_rng(0)
    ref = {"logits": rng.standard_normal((32, 4)), "hidden": rng.standard_normal((32, 8))}
    got = {"logits": ref["logits"] * 1.5, "hidden": ref["hidden"] + 1e-3}
    stats = compare_all(ref, got, "logits")
    entry = EngineValidation(name="e", backend="onnxruntime", precision="int8", device="cpu", status="validated")
    summarize(entry, stats, "logits")
    assert entry.rel_err == stats["hidden"].rel_err < stats["logits"].rel_err


def test_a_model_of_one_sample_a_call_is_told_to_validate_batch_one() -> None:
    """A graph network given its graph as a batch of one answers [1, nodes, C] at any batch: validated at 32 with
    one held-out graph, the error says batch sizes [1], not 'more held-out rows'."""
    x = np.zeros((1, 5, 3), np.float32)
    with pytest.raises(ModelError, match="first axis of 1 at a batch of 32") as err:
        Reference(lambda feed: {"logits": feed["x"][:1, :, :2]}, [({}, {"x": x})], [None], None, 32, smallest=1)
    assert "signature.batch_sizes: [1]" in err.value.hint


def test_outputs_whose_length_the_values_decide_compare_in_an_order_of_their_values() -> None:
    """Detections after NMS: ONNX Runtime's TopK orders equal scores apart from torch.topk, so an exact engine gives
    the same rows in another order; compared row by row it failed, in an order of their values it agrees."""
    from kiln.stages.accuracy.check import compare_on

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        scores = feed["x"] @ np.ones((3, 4), np.float32)
        where = np.argwhere(scores > 0.5)
        return {"logits": scores, "positives": where, "values": scores[scores > 0.5]}

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run(feed)
        return {**out, "positives": out["positives"][::-1], "values": out["values"][::-1]}

    x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    ref = Reference(run, [({}, {"x": x})], [None], None, 8)
    assert set(ref.by_value) == {"positives", "values"}
    stats = compare_on(ref, engine, [8]).stats
    assert stats["positives"].top1_agreement == 1.0 and stats["values"].cosine == pytest.approx(1.0)
    assert stats["values"].max_abs_err == 0.0


def _forecaster() -> tuple[Any, Any, Any]:
    """A forecast of a series around 300 with a spread of about 1 (a temperature in kelvin, a grid load), 6 steps
    ahead: held-out data, the model (its error against the targets 0.28 RMS), and an engine that rounds its
    forecasts to whole units (error 0.29 RMS: the targets' MSE about doubles, while its error stays small
    against the outputs' level)."""
    from kiln.core.data import DatasetSplits

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6)).astype(np.float32) / 2
    x = rng.standard_normal((96, 4)).astype(np.float32)
    y = (x @ w + 300.0 + 0.28 * rng.standard_normal((96, 6))).astype(np.float32)
    data = DatasetSplits(
        torch.from_numpy(x[:64]), torch.from_numpy(y[:64]), torch.from_numpy(x[64:]), torch.from_numpy(y[64:])
    )

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"forecast": feed["input"] @ w + np.float32(300.0)}

    def engine(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"forecast": np.round(run(feed)["forecast"])}

    return data, run, engine


def test_float_targets_are_judged_by_mse_where_no_metric_is_set() -> None:
    """No validate.metric on a regression: mse by default, its relative rise gated, so an engine whose forecasts
    are twice as far from the targets fails (the errors per output may not see it), and the exact one passes."""
    from kiln.core.data import as_feed
    from kiln.stages.accuracy.check import held_out, held_out_reference
    from kiln.stages.accuracy.config import CheckConfig
    from tests.stages.accuracy.judging import judged

    data, run, engine = _forecaster()
    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = held_out_reference(run, feeds, data, "logits", CheckConfig(), [1, 8], {})
    assert ref.metric is not None and ref.metric.name == "mse" and ref.metric.default
    assert ref.metric_value == pytest.approx(ref_mse(run, data), rel=1e-5)
    _, fails = judged(ref, engine, [1, 8], "int8")
    assert any(f.startswith("mse ") and "max_metric_drop 0.01" in f for f in fails), fails
    assert judged(ref, run, [1, 8], "fp32")[1] == []


def test_no_default_metric_where_the_prediction_is_not_one_output() -> None:
    """A forecaster's mean beside its log-variance, neither named: which one mse should read is the user's setting
    (validate.metric: mse asks for it); where they set no metric, none, and no error."""
    from kiln.core.data import as_feed
    from kiln.stages.accuracy.check import held_out, held_out_reference
    from kiln.stages.accuracy.config import CheckConfig

    data, run, _ = _forecaster()

    def gaussian(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        mean = run(feed)["forecast"]
        return {"mean": mean, "log_var": np.zeros_like(mean)}

    feeds = held_out(data, lambda v: as_feed(v, ["input"]), {}, {}, None)
    ref = held_out_reference(gaussian, feeds, data, "logits", CheckConfig(), [1, 8], {})
    assert ref.metric is None and ref.metric_value is None
    named = held_out_reference(gaussian, feeds, data, "mean", CheckConfig(), [1, 8], {})
    assert named.metric is not None and named.metric_value == pytest.approx(ref_mse(run, data), rel=1e-5)


def ref_mse(run: Any, data: Any) -> float:
    """The model's MSE against the held-out targets."""
    return float(np.mean((run({"input": data.val_x.numpy()})["forecast"] - data.val_y.numpy()) ** 2))


def test_a_forecast_on_a_level_is_measured_by_how_it_varies_not_by_its_level() -> None:
    """A forecaster of a series around 30 that varies by about 1, and an INT8 engine whose forecasts take a few
    values: its error is 40 % of the spread, which a floor of 10 % of the RMS (3) made 14 % and packaged. (Around
    300 the floor of 1 % is the spread again: the default metric, mse, judges such a forecast.)"""
    from kiln.stages.accuracy.check import compare_all, gates_for
    from kiln.stages.accuracy.config import GatesConfig

    rng = np.random.default_rng(0)
    ref = {"forecast": (30 + 0.9 * rng.standard_normal((80, 6))).astype(np.float32)}
    got = {"forecast": (30 + 1.5 * np.round((ref["forecast"] - 30) / 1.5)).astype(np.float32)}
    assert len(np.unique(got["forecast"])) <= 5
    limit = gates_for(GatesConfig(), "int8", no_class_logits=True)["max_rel_err"]
    assert compare_all(ref, got, None)["forecast"].rel_err > 2 * limit


def test_fp16_rounding_of_an_output_that_barely_varies_passes_fp16s_limit() -> None:
    """A level near 300 moving by about 1, and anchors the same for every image: exact values rounded to FP16 (2.4e-4
    of their level) stay within FP16's derived limit, 0.0447, whose floor keeps them from being over noise."""
    from kiln.stages.accuracy.check import compare_all, gates_for
    from kiln.stages.accuracy.config import GatesConfig

    rng = np.random.default_rng(0)
    level = (300 + rng.standard_normal((80, 6))).astype(np.float32)
    anchors = np.tile(rng.uniform(0, 640, (1, 1000, 4)), (16, 1, 1)).astype(np.float32)
    limit = gates_for(GatesConfig(), "fp16", no_class_logits=True)["max_rel_err"]
    for ref in (level, anchors):
        got = ref.astype(np.float16).astype(np.float32)
        assert compare_all({"y": ref}, {"y": got}, None)["y"].rel_err < limit


def test_an_output_constant_over_samples_is_measured_against_a_hundredth_of_its_norm_at_least() -> None:
    """An output that does not vary between samples has no spread to divide by, only noise: an engine's float
    rounding of it stays far within the FP32 limit."""
    from kiln.stages.accuracy.check import spreads

    rng = np.random.default_rng(0)
    constant = np.tile(rng.standard_normal(64), (32, 1)).astype(np.float32)
    spread = spreads({"hidden": constant})["hidden"]
    rms = float(np.sqrt(np.mean(constant.astype(np.float64) ** 2)))
    assert spread == pytest.approx(1e-2 * rms)
    assert 1e-7 * rms / spread < np.sqrt(2 * (1 - 0.9999))  # FP32's derived max_rel_err, 0.0141


@pytest.mark.parametrize("fill", [-1e9, -np.inf])
def test_an_output_with_a_mask_is_measured_by_the_spread_of_its_values(fill: float) -> None:
    """A policy's value head beside logits with invalid actions filled, the mask varying by sample: the fills' spread
    (5e8) made a halved engine's relative error 1e-9."""
    from kiln.stages.accuracy.check import compare_all, spreads

    rng = np.random.default_rng(1)
    mask = rng.random((80, 6)) < 0.3
    mask[:, 0] = False
    logits = rng.standard_normal((80, 6)).astype(np.float32)
    ref = {"logits": np.where(mask, np.float32(fill), logits)}
    got = {"logits": np.where(mask, np.float32(fill), logits / 2)}
    assert spreads(ref)["logits"] == pytest.approx(1.0, abs=0.1)
    assert compare_all(ref, got, None)["logits"].rel_err == pytest.approx(0.5, abs=0.06)


def _masked_policy(centred: bool, fill: float) -> Any:
    """Logits of [B, 6] inputs, filled with ``fill`` where the input is above 1 (each row's own mask); ``centred``:
    centred over the batch before the mask, so each row reads its batch mates."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feed["x"]
        raw = x - x.mean(0, keepdims=True) if centred else 2 * x
        return {"logits": np.where(x > 1.0, np.float32(fill), raw).astype(np.float32)}

    return run


@pytest.mark.filterwarnings("error")  # no bare numpy warning from an infinity minus itself
@pytest.mark.parametrize("fill", [-1e9, -np.inf])
def test_rows_that_read_their_batch_mates_are_found_beside_a_mask(fill: float) -> None:
    """With a -1e9 fill the tolerance was 1e5 and a batch-mixing policy was served batched; with -inf the difference
    was NaN, which no bound exceeds."""
    from kiln.stages.accuracy.check import mixed_rows

    feed = {"x": np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)}
    assert (feed["x"][-1] > 1.0).any()  # the row run alone holds a fill
    for centred, expected in ((True, ["logits"]), (False, [])):
        run = _masked_policy(centred, fill)
        assert mixed_rows(run, feed, run(feed)) == expected


def test_a_reference_that_scores_no_label_right_is_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An untrained model's accuracy of 0: max_accuracy_drop then passes every engine, whatever it computes."""
    logits = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1, 2, 3]]
    x = np.zeros((8, 3), np.float32)

    def reference_at(labels: np.ndarray) -> Reference:
        return Reference(lambda feed: {"logits": logits[: len(feed["x"])]}, [({}, {"x": x})], [labels], "logits", 4)

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    assert reference_at((logits.argmax(1) + 1) % 4).accuracy == 0.0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("task accuracy is 0 for the reference itself" in m and "'logits'" in m for m in said), said
    caplog.clear()
    assert reference_at(logits.argmax(1)).accuracy == 1.0
    assert not [r for r in caplog.records if "reference itself" in r.getMessage()]


@pytest.mark.parametrize("per_position", [False, True])
def test_a_reference_with_one_class_on_top_everywhere_is_warned_of(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, per_position: bool
) -> None:
    """A CTC head whose blank dominates every frame: top-1 agreement 1.0 for any engine that keeps the blank on top."""
    rng = np.random.default_rng(0)
    shape = (4, 8, 5) if per_position else (32, 5)
    logits = rng.standard_normal(shape).astype(np.float32)
    x = np.arange(shape[0], dtype=np.float32)[:, None]  # each row its own index: rows run alone answer alike

    def reference_of(values: np.ndarray) -> Reference:
        return Reference(
            lambda feed: {"logits": values[feed["x"][:, 0].astype(int)]}, [({}, {"x": x})], [None], "logits", 4
        )

    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    blank = logits.copy()
    blank[..., 0] += 20.0
    reference_of(blank)
    said = [r.getMessage() for r in caplog.records if "on top at all" in r.getMessage()]
    where = "positions" if per_position else "rows"
    assert len(said) == 1 and said[0].startswith(
        f"the reference puts class 0 of output 'logits' on top at all 32 of its {where}"
    )
    caplog.clear()
    reference_of(logits)
    assert not [r for r in caplog.records if "on top at all" in r.getMessage()]


def test_held_out_rows_all_of_the_class_the_reference_predicts_are_said_as_that(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trained binary classifier whose held-out rows are all class 1: not an untrained model."""
    logits = np.tile(np.array([[-3.0, 3.0]], np.float32), (32, 1))
    x = np.arange(32, dtype=np.float32)[:, None]
    monkeypatch.setattr(logging.getLogger("kiln"), "propagate", True)  # the CLI tests turn it off
    caplog.set_level(logging.WARNING, logger="kiln")
    labels = np.ones(32, np.int64)
    Reference(lambda feed: {"logits": logits[feed["x"][:, 0].astype(int)]}, [({}, {"x": x})], [labels], "logits", 4)
    said = [r.getMessage() for r in caplog.records if "class 1" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the held-out rows are all of class 1"), said
    assert "trained" not in said[0]


def test_one_hot_labels_score_task_accuracy_by_their_argmax() -> None:
    """Float one-hot rows are class labels (``F.one_hot(y, C).float()``): task accuracy is scored against their
    argmax, as against the integer labels they encode; other float targets stay unscored."""
    from kiln.core.data import DatasetSplits
    from kiln.stages.accuracy.check import held_out_reference
    from kiln.stages.accuracy.config import CheckConfig

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    logits = rng.standard_normal((16, 4)).astype(np.float32)
    classes = logits.argmax(1)
    classes[:4] = (classes[:4] + 1) % 4  # the reference is right on 12 of 16 rows
    run = lambda feed: {"logits": logits[: len(feed["x"])]}  # noqa: E731

    def accuracy(y: np.ndarray) -> float | None:
        data = DatasetSplits(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(x), torch.from_numpy(y), 4)
        return held_out_reference(run, [({}, {"x": x})], data, "logits", CheckConfig(), [16], {}).accuracy

    one_hot = np.eye(4, dtype=np.float32)[classes]
    assert accuracy(classes) == accuracy(one_hot) == pytest.approx(12 / 16)
    assert accuracy(one_hot * 0.5) is None  # not one-hot: a regression's targets


def test_a_failure_is_placed_at_its_worst_shape_and_the_others_missing_its_gate() -> None:
    """The shape a failure's value comes from first, then the other shapes missing the same gate at other values,
    each in the order its axes were found; a failure no shape misses alone, or of one unsized shape, stays as it is."""
    failure = "top1_agreement 0.9000 < 0.97"
    missed = [({"src": 8, "tgt": 2}, ["top1_agreement 0.9500 < 0.97"]), ({"src": 4, "tgt": 1}, [failure]), ({}, [])]
    placed, points = placed_failure(failure, missed)
    assert placed == f"{failure} at src=4, tgt=1 (and at src=8, tgt=2)"
    assert points == [{"src": 4, "tgt": 1}, {"src": 8, "tgt": 2}]
    assert placed_failure("cosine 0.5 < min_cosine 0.99", missed) == ("cosine 0.5 < min_cosine 0.99", [])
    assert placed_failure(failure, [({}, [failure])]) == (failure, [])
