"""What the train stage checks of the data against the model before the first epoch: labels of the wrong shape
named as such, a decoder input the data lacks, token ids past an embedding's rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.core.data import DataContractError, DatasetSplits, check_splits
from kiln.core.errors import ModelError
from kiln.stages.train.loop import evaluate_loss_acc
from kiln.stages.train.stage import check_model_fits_data
from kiln.stages.train.task import Task


class Tagger(nn.Module):
    """A tag per token: [N, S] ids -> [N, S, C] logits."""

    def __init__(self, vocab: int = 16, classes: int = 9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(input_ids)))


def _ids(size: int = 8, length: int = 6, vocab: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(0))


def test_labels_one_per_row_with_the_ignore_label_get_the_shape_error_for_logits_per_position() -> None:
    """Labels one per row that hold -100 (no label), beside logits per position, get the error naming the shape
    the labels need, as the same labels without -100 do: -100 is no label here too, not a class out of range."""
    x = _ids()
    y = torch.tensor([0, 7, -100, 3, 1, -100, 2, 8])
    data = DatasetSplits(x[:6], y[:6], x[6:], y[6:], num_classes=9)
    check_splits(data, "tags:load")
    with pytest.raises(
        ModelError, match=r"one row of class scores per position, but the labels have shape \(2,\)"
    ) as e:
        check_model_fits_data(Tagger(), data, "tags:build", Task("classification"))
    assert e.value.hint.startswith("give labels per position [N, 6]")


def test_labels_one_per_row_with_the_ignore_label_score_the_labelled_rows_only() -> None:
    """-100 leaves a row out of the loss and the accuracy, as it leaves a position out: a batch of rows without a
    label weighs nothing in the validation loss (no NaN from an empty mean), and the others weigh by their labelled
    rows."""
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, -100, 1, -100, -100, -100, -100, 1, 0, 0, -100])
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    loss, accuracy = evaluate_loss_acc(model, x, y, torch.device("cpu"), batch=4, task=Task("classification"))
    keep = y != -100
    logits = model(x).detach()
    assert loss == pytest.approx(nn.functional.cross_entropy(logits[keep], y[keep]).item())
    assert accuracy == pytest.approx((logits[keep].argmax(1) == y[keep]).float().mean().item())


class Seq2Seq(nn.Module):
    """An encoder-decoder that, like Hugging Face's, decodes the shifted source where given no decoder inputs."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        source = self.emb(input_ids).mean(1, keepdim=True)
        decoder = input_ids.roll(1, 1) if decoder_input_ids is None else decoder_input_ids
        return self.head(torch.tanh(self.emb(decoder) + source))


def _translation(decoder: bool) -> DatasetSplits:
    """Sources of 10 tokens, targets of 4; the decoder inputs only where ``decoder``."""
    src, tgt = _ids(8, 10, 20), _ids(8, 4, 20).roll(1, 0)
    x = {"input_ids": src, "attention_mask": torch.ones_like(src)}
    if decoder:
        start = torch.full((8, 1), 2)
        x |= {"decoder_input_ids": torch.cat([start, tgt[:, :-1]], 1), "decoder_attention_mask": torch.ones_like(tgt)}
    return DatasetSplits({k: v[:6] for k, v in x.items()}, tgt[:6], {k: v[6:] for k, v in x.items()}, tgt[6:], 20)


def test_an_encoder_decoder_without_its_decoder_inputs_is_told_to_give_them() -> None:
    """Logits of the source's length, from a model whose forward takes decoder_input_ids the data does not give,
    are told to give the decoder inputs (the labels shifted right) first."""
    with pytest.raises(ModelError, match=r"logits of shape \(2, 10, 20\) for labels of shape \(2, 4\)") as e:
        check_model_fits_data(Seq2Seq(), _translation(decoder=False), "s2s:build", Task("classification"))
    assert e.value.hint.startswith("give the model's decoder_input_ids, which the data lacks")
    assert "the labels shifted right, starting with the decoder start token" in e.value.hint
    assert "decoder_attention_mask" in e.value.hint
    check_model_fits_data(Seq2Seq(), _translation(decoder=True), "s2s:build", Task("classification"))


def test_a_tiny_bart_without_decoder_inputs_is_told_to_give_them() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=20,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
        use_cache=False,
    )
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(config)
    with pytest.raises(ModelError, match=r"for labels of shape \(2, 4\)") as e:
        check_model_fits_data(bart, _translation(decoder=False), "bart:build", Task("classification"))
    assert e.value.hint.startswith("give the model's decoder_input_ids, which the data lacks")
    past = _translation(decoder=True)
    past.val_x["decoder_input_ids"][1, 2] = 20  # the lookup of a library's own nn.Embedding subclass
    with pytest.raises(DataContractError, match=r"val_x\['decoder_input_ids'\] holds token id 20 at row 1, past"):
        check_model_fits_data(bart, past, "bart:build", Task("classification"))


def test_a_token_id_past_the_embedding_in_the_held_out_split_is_named_before_training() -> None:
    """An id past the embedding's rows in val_x, outside the probed rows, is named with its split, row and the
    table's size before training, not met as an IndexError when its batch comes."""
    x = _ids(12)
    val = x[8:].clone()
    val[3, 2] = 16
    data = DatasetSplits(x[:8], x[:8, 0] % 2, val, val[:, 0] % 2, num_classes=2, name="ssm:load")
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Pooled(), data, "ssm:build", Task("classification"))
    assert e.value.message == (
        "dataset 'ssm:load': val_x holds token id 16 at row 3, past the 16 rows of the model's embedding 'emb' "
        "(a table of 16 x 8: ids 0..15)"
    )
    assert e.value.hint.startswith("keep the ids within 0..15")


def test_a_token_id_past_the_embedding_in_the_probed_rows_is_named_not_the_forward_error() -> None:
    x = {"input_ids": _ids(), "token_type_ids": torch.zeros(8, 6, dtype=torch.long)}
    x["token_type_ids"][1, 4] = 2
    data = DatasetSplits(x, torch.zeros(8, dtype=torch.long), x, torch.zeros(8, dtype=torch.long), num_classes=2)
    with pytest.raises(DataContractError, match=r"train_x\['token_type_ids'\] holds token id 2 at row 1, past the 2"):
        check_model_fits_data(Typed(), data, "typed:build", Task("classification"))


@pytest.mark.parametrize(("bad", "side"), [(16, "past the 16 rows"), (-3, "below the first of the 16 rows")])
def test_an_id_outside_an_embedding_bag_in_the_held_out_split_is_named_before_training(bad: int, side: str) -> None:
    """An nn.EmbeddingBag's ids (padded [N, L] with padding_idx) are checked as an nn.Embedding's are: the data is
    named, not the model's forward after a whole epoch."""
    x = _ids(12)
    val = x[8:].clone()
    val[1, 0] = bad
    data = DatasetSplits(x[:8], x[:8, 0] % 2, val, val[:, 0] % 2, num_classes=2, name="rec:load")
    with pytest.raises(DataContractError) as e:
        check_model_fits_data(Bagged(), data, "rec:build", Task("classification"))
    assert e.value.message == (
        f"dataset 'rec:load': val_x holds token id {bad} at row 1, {side} of the model's embedding 'bag' "
        "(a table of 16 x 8: ids 0..15)"
    )


@pytest.mark.parametrize("model", [lambda: Hashed(), lambda: HashedInside(), lambda: UnknownInPlace()])
def test_ids_the_model_maps_before_its_embedding_are_not_checked(model) -> None:
    """No false alarm where the lookup is not given the data's input as it is: mapped by the model's forward (into
    a new tensor or in place), or by an nn.Embedding subclass of its own."""
    x = _ids(8, 6, vocab=40)
    x[0, 0] = 39  # an id past the table in the probed rows
    data = DatasetSplits(x, x[:, 0] % 2, x, x[:, 0] % 2, num_classes=2)
    check_model_fits_data(model(), data, "hashed:build", Task("classification"))


class Pooled(nn.Module):
    """A sequence classifier: [N, S] ids -> [N, 2]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids).mean(1))


class Bagged(nn.Module):
    """A history tower: [N, L] ids padded with 0 -> mean of their rows -> [N, 2]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag, self.head = nn.EmbeddingBag(16, 8, mode="mean", padding_idx=0), nn.Linear(8, 2)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(history))


class Typed(Pooled):
    """Token and segment embeddings, BERT's way."""

    def __init__(self) -> None:
        super().__init__()
        self.types = nn.Embedding(2, 8)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.head((self.emb(input_ids) + self.types(token_type_ids)).mean(1))


class Hashed(Pooled):
    """Ids hashed into the embedding's rows: any id is fine."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids % 16).mean(1))


class UnknownInPlace(Pooled):
    """Ids the vocabulary lacks mapped to the unknown-token id 0, in place, before the lookup."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids.masked_fill_(input_ids >= 16, 0)).mean(1))


class HashEmbedding(nn.Embedding):
    """An embedding that folds any id into its rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids % self.num_embeddings)


class HashedInside(Pooled):
    def __init__(self) -> None:
        super().__init__()
        self.emb = HashEmbedding(16, 8)
