"""Labels per row or per position (kiln.core.labels): the loss, hits and accuracy over labelled positions only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.core.compare import compare_arrays
from kiln.core.labels import (
    IGNORE_LABEL,
    accuracy,
    are_indices,
    copied_input,
    dense_cross_entropy,
    hits,
    labelled,
    labelled_padding,
    per_position,
)


def test_per_position_means_integer_labels_with_more_than_one_axis() -> None:
    assert per_position(torch.zeros(4, 6, dtype=torch.long)) and per_position(np.zeros((4, 6, 6), dtype=np.int64))
    assert not per_position(torch.zeros(4, dtype=torch.long)) and not per_position(torch.zeros(4, 6))
    assert not per_position(np.zeros((4, 2), dtype=np.float32))


def test_dense_cross_entropy_is_torchs_mean_over_labelled_tokens_and_zero_without_any() -> None:
    logits = torch.randn(3, 5, 4)
    y = torch.randint(0, 4, (3, 5))
    y[0, 3:] = y[2, :] = IGNORE_LABEL
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y)  # torch's [N, C, S] form, ignore_index -100
    assert dense_cross_entropy(logits, y) == pytest.approx(want.item(), rel=1e-6)
    assert dense_cross_entropy(logits, torch.full((3, 5), IGNORE_LABEL)).item() == 0.0
    segmentation = torch.randn(2, 4, 3, 3)  # [N, C, H, W]: classes on axis 1
    pixels = torch.randint(0, 4, (2, 3, 3))
    assert dense_cross_entropy(segmentation, pixels) == pytest.approx(
        torch.nn.functional.cross_entropy(segmentation, pixels).item(), rel=1e-6
    )


def test_accuracy_counts_labelled_rows_and_positions() -> None:
    logits = np.zeros((2, 3, 4))
    logits[..., 1] = 1.0  # predicts class 1 everywhere
    y = np.array([[1, 2, IGNORE_LABEL], [1, IGNORE_LABEL, IGNORE_LABEL]])
    assert int(labelled(y)) == 3 and int(hits(logits, y)) == 2 and accuracy(logits, y) == pytest.approx(2 / 3)
    assert accuracy(logits, np.full((2, 3), IGNORE_LABEL)) is None
    assert accuracy(np.eye(3), np.array([0, 1, 1])) == pytest.approx(2 / 3)  # one label per row, as before


def test_top1_agreement_over_the_labelled_positions_only() -> None:
    ref = np.zeros((1, 4, 3))
    ref[..., 0] = 1.0
    got = ref.copy()
    got[0, 3] = [0.0, 2.0, 0.0]  # the last (padding) token flips
    assert compare_arrays(ref, got).top1_agreement == 0.75
    assert compare_arrays(ref, got, where=np.array([[True, True, True, False]])).top1_agreement == 1.0


def test_labels_that_are_no_class_indices_of_the_logits_give_no_accuracy() -> None:
    """Multi-hot [N, K] labels beside [N, K] logits, or a [N, 1] column beside one logit, broadcast against the
    argmax: an accuracy of 68 once. They are no class indices, so no accuracy is counted."""
    logits = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    assert are_indices(logits, np.zeros(8, np.int64)) and accuracy(logits, np.zeros(8, np.int64)) is not None
    assert not are_indices(logits, np.zeros((8, 6), np.int64)) and accuracy(logits, np.zeros((8, 6), np.int64)) is None
    assert accuracy(logits[:, :1], np.zeros((8, 1), np.int64)) is None
    assert not are_indices(logits, np.zeros(8, np.float32))  # float targets
    assert are_indices(np.zeros((2, 3, 4, 4)), np.zeros((2, 4, 4), np.int64))  # per pixel, classes on axis 1


def _padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [3, 5] and their attention mask: rows of 5, 3 and 2 real tokens, then padding (id 0, mask 0)."""
    mask = (torch.arange(5)[None, :] < torch.tensor([[5], [3], [2]])).long()
    return (torch.arange(15).reshape(3, 5) + 1) * mask, mask


def test_labels_that_repeat_an_input_at_every_labelled_position_name_it() -> None:
    ids, mask = _padded_ids()
    copy = ids.masked_fill(mask == 0, IGNORE_LABEL)  # Hugging Face's causal-LM labels = input_ids
    assert copied_input({"attention_mask": mask, "input_ids": ids}, copy) == "input_ids"
    shifted = torch.full_like(ids, IGNORE_LABEL)
    shifted[:, :-1] = ids[:, 1:]
    shifted[mask == 0] = IGNORE_LABEL
    assert copied_input({"input_ids": ids}, shifted) is None
    assert copied_input({"input_ids": ids.float()}, copy) is None  # float inputs are features, not tokens
    ones = mask.masked_fill(mask == 0, IGNORE_LABEL)  # one value throughout: no evidence of a copy
    assert copied_input({"attention_mask": mask}, ones) is None
    assert copied_input({"input_ids": ids}, ids[:, 0]) is None  # one label per row


def test_labels_set_where_the_attention_mask_is_0_are_counted() -> None:
    ids, mask = _padded_ids()
    tags = ids % 3
    assert labelled_padding({"input_ids": ids, "attention_mask": mask}, tags) == ("attention_mask", 5)
    assert labelled_padding({"attention_mask": mask}, tags.masked_fill(mask == 0, IGNORE_LABEL)) == (
        "attention_mask",
        0,
    )
    assert labelled_padding({"mask": mask}, tags) == ("", 0)  # named otherwise: not taken for a mask
    assert labelled_padding({"attention_mask": mask[:, :4]}, tags) == ("", 0)  # shaped otherwise


def test_positions_an_attention_mask_marks_as_padding_are_no_ones_answer() -> None:
    """Outputs laid out [batch, seq, ...] like the mask are 0 at its padding in both answers compared (a causal LM
    padded on the left computes garbage there, differently per runtime); other outputs are as they were."""
    from kiln.core.labels import without_padding

    mask = np.array([[0, 1, 1], [1, 1, 1]], np.int64)
    logits = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2) + 1
    pooled = np.ones((2, 4), np.float32)
    out = without_padding({"input_ids": mask * 5, "attention_mask": mask}, {"logits": logits, "pooled": pooled})
    assert out["logits"][0, 0].tolist() == [0.0, 0.0] and (out["logits"][mask == 1] == logits[mask == 1]).all()
    assert out["pooled"] is pooled
    same = {"logits": logits}
    assert without_padding({"attention_mask": np.ones((2, 3), np.int64)}, same) is same  # nothing padded
    assert without_padding({"mask": mask}, same) is same  # no attention mask by name


def test_span_logits_over_the_padded_axis_leave_the_padding_out_of_their_argmax() -> None:
    """A question-answering head's ``start_logits [batch, seq]``, every real logit below 0: a 0 at the padding won
    the argmax in the reference and in an engine that answers another span alike, which counted as agreeing (94 %
    for an engine right on 3 % of the rows). -inf there is set aside by every comparison and never wins."""
    from kiln.core.compare import compare_arrays
    from kiln.core.labels import without_padding

    rng = np.random.default_rng(0)
    mask = np.ones((64, 12), np.int64)
    mask[:, 8:] = 0  # every row padded after 8 tokens
    ref = rng.standard_normal((64, 12)).astype(np.float32) - 50
    wrong = ref.copy()
    wrong[:, :8] = ref[:, :8][:, ::-1]  # another span's start on most rows
    feed = {"input_ids": mask * 7, "attention_mask": mask}
    r, g = (without_padding(feed, {"start_logits": a})["start_logits"] for a in (ref, wrong))
    assert np.isneginf(r[:, 8:]).all() and (r[:, :8] == ref[:, :8]).all()
    stats = compare_arrays(r, g)
    truth = float(np.mean(ref[:, :8].argmax(1) == wrong[:, :8].argmax(1)))
    assert stats.top1_agreement == truth < 0.3 and np.isfinite(stats.cosine) and np.isfinite(stats.max_abs_err)
    right = compare_arrays(r, without_padding(feed, {"start_logits": ref + 1e-6})["start_logits"])
    assert right.top1_agreement == 1.0 and right.max_abs_err < 1e-4


def _seq2seq_feed(dec_mask: bool = False) -> dict[str, np.ndarray]:
    """An encoder-decoder's inputs at enc == dec == 4: the source padded after 2 tokens in row 0, the target not."""
    enc = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], np.int64)
    feed = {"input_ids": enc * 7, "attention_mask": enc, "decoder_input_ids": np.full((2, 4), 3, np.int64)}
    if dec_mask:
        feed["decoder_attention_mask"] = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int64)
    return feed


SEQ2SEQ_AXES = {
    "input_ids": {1: "enc"},
    "attention_mask": {1: "enc"},
    "decoder_input_ids": {1: "dec"},
    "decoder_attention_mask": {1: "dec"},
}


def test_an_output_takes_the_padding_of_the_mask_on_its_own_axis_by_name() -> None:
    """Decoder logits [N, dec, V] beside an encoder state [N, enc, D] at enc == dec: the encoder's attention mask
    leaves out the encoder state's padding only; the logits keep every position unless a mask on ``dec`` is given."""
    from kiln.core.labels import without_padding

    logits, state = np.ones((2, 4, 3), np.float32), np.ones((2, 4, 5), np.float32)
    out_axes = {"logits": {1: "dec"}, "state": {1: "enc"}}
    out = without_padding(_seq2seq_feed(), {"logits": logits, "state": state}, SEQ2SEQ_AXES, out_axes)
    assert (out["logits"] == 1).all()
    assert out["state"][0, 2:].sum() == 0 and out["state"][0, :2].all() and out["state"][1].all()
    out = without_padding(_seq2seq_feed(dec_mask=True), {"logits": logits}, SEQ2SEQ_AXES, out_axes)
    assert out["logits"][0, 3].sum() == 0 and out["logits"][0, :3].all() and out["logits"][1].all()


def test_an_output_on_the_length_of_inputs_on_two_axes_is_not_masked_by_a_guess() -> None:
    """Without axis names, decoder logits as long as the source are tied between the encoder's mask and the
    decoder's inputs: no mask is guessed (every position is compared) and the tie is named; a token classifier's
    inputs all lie on one axis, and its mask applies as before."""
    from kiln.core.labels import padding_ties, without_padding

    logits = np.ones((2, 4, 3), np.float32)
    assert (without_padding(_seq2seq_feed(), {"logits": logits})["logits"] == 1).all()
    assert padding_ties(_seq2seq_feed(), {"logits": logits}) == {"logits": ["attention_mask", "decoder_input_ids"]}
    enc_only = {k: SEQ2SEQ_AXES[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    assert padding_ties(_seq2seq_feed(), {"logits": logits}, enc_only) == {
        "logits": ["attention_mask", "decoder_input_ids"]
    }
    feed = {k: v for k, v in _seq2seq_feed().items() if not k.startswith("decoder")}
    assert without_padding(feed, {"logits": logits})["logits"][0, 2:].sum() == 0
    assert padding_ties(feed, {"logits": logits}) == {}


def test_labels_that_repeat_an_input_named_like_labels_are_no_copy() -> None:
    """Hugging Face's ``labels`` among a tagger's inputs equal its labels: that is the labels given twice, not a
    model taught to copy an input (another error says to keep them out of the inputs)."""
    ids, mask = _padded_ids()
    tags = (ids % 3).masked_fill(mask == 0, IGNORE_LABEL)
    tags[0, 0] = 1 + tags[0, 1]  # not one value throughout
    assert copied_input({"input_ids": ids, "attention_mask": mask, "labels": tags}, tags) is None
    assert copied_input({"input_ids": ids, "tags": tags}, tags) == "tags"


def test_a_seq2seq_models_labels_are_checked_against_the_decoders_mask_only() -> None:
    """Labels shaped like both the source and the target (enc == dec) are the decoder's (Hugging Face's
    seq2seq ``labels``): the encoder's padding says nothing of them; a decoder_attention_mask does."""
    feed = {k: torch.from_numpy(v) for k, v in _seq2seq_feed().items()}
    y = torch.full((2, 4), 5)
    assert labelled_padding(feed, y) == ("", 0)
    feed = {k: torch.from_numpy(v) for k, v in _seq2seq_feed(dec_mask=True).items()}
    assert labelled_padding(feed, y) == ("decoder_attention_mask", 1)


def test_an_output_axis_name_no_input_has_decides_nothing() -> None:
    """An exporter's own symbol on the output (``s0``) names no input axis: the shape rule applies, as without
    names."""
    from kiln.core.labels import without_padding

    mask = np.array([[0, 1, 1], [1, 1, 1]], np.int64)
    logits = np.ones((2, 3, 2), np.float32)
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    feed = {"input_ids": mask * 5, "attention_mask": mask}
    out = without_padding(feed, {"logits": logits}, axes, {"logits": {1: "s0"}})
    assert out["logits"][0, 0].sum() == 0 and out["logits"][1].all()


@pytest.mark.parametrize(
    "ids_axis, mask_axis",
    [
        ("input_ids_dynamic_axes_1", "attention_mask_dynamic_axes_1"),  # torch.onnx.export, list-form dynamic_axes
        ("unk__12", "unk__13"),  # tf2onnx
        ("s0", "s1"),  # the dynamo exporter
        ("s0 + 1", "dim_1"),
    ],
)
def test_axis_names_an_exporter_made_up_per_input_leave_the_padding_out(ids_axis: str, mask_axis: str) -> None:
    """A causal LM padded on the left, whose exported inputs each got their own made-up axis name: the names say
    nothing of which axes are one, so the shape rule applies and the mask's padding is left out, tied to none."""
    from kiln.core.labels import padding_ties, without_padding

    ids, mask = np.array([[0, 0, 5, 6], [1, 2, 3, 4]]), np.array([[0, 0, 1, 1], [1, 1, 1, 1]])
    feed = {"input_ids": ids, "attention_mask": mask}
    axes = {"input_ids": {0: "batch", 1: ids_axis}, "attention_mask": {0: "batch", 1: mask_axis}}
    logits = np.ones((2, 4, 10), np.float32)
    for out_axes in (None, {"logits": {1: ids_axis}}):
        out = without_padding(feed, {"logits": logits}, axes, out_axes)
        assert out["logits"][0, :2].sum() == 0 and out["logits"][0, 2:].all() and out["logits"][1].all()
        assert padding_ties(feed, {"logits": logits}, axes, out_axes) == {}


def test_made_up_axis_names_keep_a_seq2seqs_decoder_inputs_apart_by_name() -> None:
    """An encoder-decoder exported with made-up axis names, at enc == dec: the decoder inputs are still told apart
    by their names, so the decoder logits are masked by no guess."""
    from kiln.core.labels import padding_ties, without_padding

    axes = {name: {1: f"{name}_dynamic_axes_1"} for name in _seq2seq_feed()}
    logits = np.ones((2, 4, 3), np.float32)
    assert (without_padding(_seq2seq_feed(), {"logits": logits}, axes)["logits"] == 1).all()
    tied = {"logits": ["attention_mask", "decoder_input_ids"]}
    assert padding_ties(_seq2seq_feed(), {"logits": logits}, axes) == tied


def test_left_padding_is_read_off_the_attention_mask_by_axis() -> None:
    from kiln.core.labels import left_padded

    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    left, right = np.array([[0, 1, 1], [1, 1, 1]]), np.array([[1, 1, 0], [1, 1, 1]])
    assert left_padded({"input_ids": left, "attention_mask": left}, axes) == {"seq"}
    assert left_padded({"input_ids": right, "attention_mask": right}, axes) == set()
    assert left_padded({"input_ids": left, "attention_mask": np.ones((2, 3), np.int64)}, axes) == set()
    assert left_padded({"mask": left}, {"mask": {1: "seq"}}) == set()  # no attention mask by name


def test_the_pad_value_is_what_the_data_holds_where_the_mask_marks_padding() -> None:
    from kiln.core.labels import padding_value

    mask = np.array([[1, 1, 0], [1, 0, 0]], np.int64)
    feed = {"input_ids": np.where(mask == 1, 9, 2), "attention_mask": mask, "x": np.zeros((2, 3), np.float32)}
    assert padding_value(feed, "input_ids") == 2 and padding_value(feed, "attention_mask") == 0
    assert padding_value(feed, "x") is None  # floats: no token to take
    assert padding_value({"input_ids": feed["input_ids"], "attention_mask": np.ones_like(mask)}, "input_ids") is None


@pytest.mark.parametrize(
    "name, label",
    [
        ("future_values", True),  # Hugging Face's time-series forecasters (PatchTST, Informer, Autoformer...)
        ("target_values", True),  # PatchTST's and PatchTSMixer's regression heads
        ("next_sentence_label", True),
        ("mc_labels", True),
        ("start_positions", True),
        ("past_values", False),
        ("future_time_features", False),
    ],
)
def test_the_label_arguments_of_hugging_face_heads_are_named_like_labels(name: str, label: bool) -> None:
    from kiln.core.labels import is_label_name

    assert is_label_name(name) is label


@pytest.mark.parametrize("name, loss", [("loss", True), ("Loss", True), ("output.loss", True), ("losses", False)])
def test_a_loss_is_named_like_hugging_faces_model_output_loss(name: str, loss: bool) -> None:
    from kiln.core.labels import is_loss_name

    assert is_loss_name(name) is loss


class _Tagger(torch.nn.Module):
    """Token ids [N, T] -> per-token class logits [N, T, C], pooled class logits [N, C] and hidden states [N, T, H]:
    the outputs the position test reads, of a tagger or of a multi-task text model."""

    def __init__(self, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(20, width), torch.nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(tokens)
        return {"tags": self.head(h), "pooled": self.head(h.mean(1)), "hidden": h}


def test_labels_whose_axis_1_follows_no_position_axis_are_targets_per_sample() -> None:
    """A multi-task model's integer labels [N, 2] (a topic and a sentiment class per sample) beside pooled logits
    [N, 5] and hidden states [N, 16, 8] of inputs 16 long: no position axis is 2 long, so they are two targets per
    sample; labels [N, 16] follow the tokens' axis, by the hidden states, the input's size or per-token logits."""
    from kiln.core.labels import follows_positions

    with torch.no_grad():
        out = _Tagger()(torch.randint(0, 20, (3, 16)))
    outputs = list(out.values())
    per_sample, per_token = torch.randint(0, 3, (3, 2)), torch.randint(0, 5, (3, 16))
    assert not follows_positions(per_sample, out["pooled"], outputs, [16])
    assert follows_positions(per_token, out["pooled"], outputs)  # the hidden states have the tokens' axis
    assert follows_positions(per_token, out["pooled"], sizes=[16])  # the inputs' dynamic axis is 16 long
    assert follows_positions(per_token, out["tags"]) and follows_positions(per_token, out["tags"].flatten(0, 1))
    assert follows_positions(per_sample, torch.zeros(3, 4, 5))  # class logits per position, of another length
    pixels = torch.zeros(3, 8, 8, dtype=torch.long)
    assert follows_positions(pixels, torch.zeros(3, 5, 8, 8)) and follows_positions(pixels)  # a class per pixel
    assert not follows_positions(torch.zeros(3, 2), out["pooled"], outputs, [2])  # float targets: never


def test_a_padding_mask_is_a_mask_whose_true_marks_padding() -> None:
    """PyTorch's ``src_key_padding_mask`` convention (True marks padding), by name: left padding is read off it as
    off an attention mask of the inverse values, and its True positions are the padding comparisons leave out."""
    from kiln.core.labels import is_mask_name, is_padding_mask_name, left_padded, pad_positions, without_padding

    for name in ("padding_mask", "key_padding_mask", "src_key_padding_mask", "attention_mask"):
        assert is_mask_name(name)
    assert is_padding_mask_name("src_key_padding_mask") and not is_padding_mask_name("attention_mask")
    assert not is_mask_name("mask") and not is_mask_name("flags")
    pad = np.array([[True, True, False, False], [False, False, False, False]])
    axes = {"tokens": {1: "seq"}, "padding_mask": {1: "seq"}}
    assert left_padded({"tokens": pad.astype(np.int64), "padding_mask": pad}, axes) == {"seq"}
    assert left_padded({"padding_mask": pad[:, ::-1]}, axes) == set()  # right padding
    assert left_padded({"key_padding_mask": pad.astype(np.uint8)}, {"key_padding_mask": {1: "seq"}}) == {"seq"}
    assert (pad_positions("padding_mask", pad) == pad).all()
    assert (pad_positions("attention_mask", ~pad) == pad).all()
    out = without_padding({"padding_mask": pad}, {"h": np.ones((2, 4, 3), np.float32)})["h"]
    assert (out[:, :, 0] == ~pad).all()


def test_a_row_of_nan_logits_is_no_hit_whatever_its_argmax() -> None:
    """NaN logits' argmax is class 0: a row of them counts wrong, for numpy and torch alike."""
    logits = np.array([[np.nan, 0.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    labels = np.array([0, 1, 0])
    assert accuracy(logits, labels) == 2 / 3
    assert int(hits(torch.from_numpy(logits), torch.from_numpy(labels))) == 2
