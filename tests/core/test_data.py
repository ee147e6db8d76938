"""The dataset contract: every violation is one error/fix pair naming the cause, through the CLI too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn

from kiln.cli import main
from kiln.core.data import (
    DataContractError,
    DatasetSplits,
    by_keyword,
    check_splits,
    fixed_columns,
    input_names,
    integer_ranges,
)
from kiln.core.errors import ConfigError, ModelError
from kiln.core.outputs import flatten_outputs, logits_name
from kiln.core.records import TensorSpec
from tests.conftest import tiny_config_dict


def ids(n: int, s: int = 6) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 9, (n, s)), "attention_mask": torch.ones(n, s, dtype=torch.long)}


@pytest.mark.parametrize(
    "splits, message",
    [
        (
            DatasetSplits(ids(8), None, tuple(ids(4).values()), None),
            "train_x is a dict with keys .* but val_x is a tuple",
        ),
        (
            DatasetSplits(ids(8), torch.zeros(7, dtype=torch.long), ids(4), torch.zeros(4, dtype=torch.long)),
            "train_x has 8 rows but train_y has shape \\[7\\]",
        ),
        (
            DatasetSplits(
                {"a": torch.zeros(8, 2), "b": torch.zeros(6, 2)},
                None,
                {"a": torch.zeros(2, 2), "b": torch.zeros(2, 2)},
                None,
            ),
            "different row counts",
        ),
        (  # a list of samples of different lengths (utterances), read as that many inputs: told to pad and stack
            DatasetSplits([torch.zeros(n, 4) for n in range(10, 22)], None, [torch.zeros(2, 4)] * 12, None),
            "train_x is a list of 12 tensors of 10 to 21 rows: a list or tuple is read as the model's inputs",
        ),
        (  # point clouds of one size listed, one per label: the samples, not 240 inputs (it said "256 rows")
            DatasetSplits(
                [torch.zeros(256, 3)] * 24, torch.zeros(24, dtype=torch.long), [torch.zeros(256, 3)] * 4, None
            ),
            "train_x is a list of 24 tensors of 256 rows each: a list or tuple is read as the model's inputs",
        ),
        (  # a tuple's inputs by position, not '0', '1'
            DatasetSplits(
                (torch.zeros(8, 2), torch.zeros(2, 8, 3)), None, (torch.zeros(2, 2), torch.zeros(2, 2, 3)), None
            ),
            "different row counts \\{'train_x\\[0\\]': 8, 'train_x\\[1\\]': 2\\}",
        ),
        (
            DatasetSplits(ids(8, 6), None, ids(4, 5), None),
            "input 'input_ids': validation samples are \\[5\\] but training samples are \\[6\\]",
        ),
        (
            DatasetSplits(torch.zeros(8, 2), torch.arange(8), torch.zeros(2, 2), torch.arange(2), num_classes=4),
            "train_y has labels from 0 to 7, outside 0..3",
        ),
        (DatasetSplits(torch.zeros(8, 2), None, [1, 2], None), "gives val_x.*as int, not a torch.Tensor"),
        (
            DatasetSplits(ids(8), torch.full((8, 6), 5), ids(4), torch.zeros(4, 6, dtype=torch.long), num_classes=4),
            "train_y has labels from 5 to 5, outside 0..3 \\(num_classes 4\\); -100 marks a position without a label",
        ),
        (
            DatasetSplits(
                torch.zeros(8, 2),
                torch.full((8,), -100),
                torch.zeros(2, 2),
                torch.zeros(2, dtype=torch.long),
                num_classes=4,
            ),
            "every label of train_y is -100 \\(no row or position has a label\\)",
        ),
        (
            DatasetSplits(torch.zeros(8, 2), torch.zeros(8, dtype=torch.bool), torch.zeros(2, 2), None),
            "neither integer class labels nor float targets",
        ),
        (DatasetSplits(torch.zeros(8, 2), torch.zeros(8), torch.zeros(2, 2), None), "labels for one split only"),
    ],
)
def test_contract_violations_name_the_cause(splits: DatasetSplits, message: str) -> None:
    with pytest.raises(DataContractError, match=message) as info:
        check_splits(splits, "mine:data")
    assert info.value.hint


@pytest.mark.parametrize("train_x", [None, torch.zeros(0, 2)])
def test_train_x_left_out_is_told_the_calibration_reads_it(train_x: torch.Tensor | None) -> None:
    """A user who trains elsewhere gives no training split; the fix was "wrap arrays with torch.from_numpy(...)"
    (None) or "give both splits samples"."""
    with pytest.raises(DataContractError, match="train_x") as info:
        check_splits(DatasetSplits(train_x, None, torch.zeros(2, 2), None), "mine:data")
    assert "train.enabled: false" in info.value.hint and "train_x = val_x" in info.value.hint


def _masks(ignore: int, n: int = 8) -> torch.Tensor:
    """Pixel labels [n, 6, 6] of classes 0..3 with a two-pixel unlabelled border of ``ignore`` (VOC's 255)."""
    y = torch.arange(n * 36).reshape(n, 6, 6) % 4
    y[:, :2, :] = ignore
    return y


@pytest.mark.parametrize("ignore", [255, 4, -1])
def test_one_ignore_value_of_the_datasets_own_is_told_to_become_minus_100(ignore: int) -> None:
    """Segmentation labels with 255 on unlabelled pixels (VOC, Cityscapes) were told to 'fix the labels or
    num_classes', which points at num_classes=256: the fix names the remap to -100 and the error the count."""
    y = _masks(ignore)
    data = DatasetSplits(torch.zeros(8, 3, 6, 6), y, torch.zeros(2, 3, 6, 6), y[:2], num_classes=4)
    with pytest.raises(DataContractError) as info:
        check_splits(data, "mine:seg")
    assert info.value.message.startswith(
        f"dataset 'mine:seg': train_y has labels from {min(0, ignore)} to {max(3, ignore)}, outside 0..3 "
        f"(num_classes 4): {8 * 12} positions hold {ignore}, the only label outside 0..3; -100 marks a position "
        "without a label"
    )
    assert info.value.hint.startswith(
        f"if {ignore} marks positions without a label, map it to -100: y[y == {ignore}] = -100"
    )
    assert ("set num_classes to 5" in info.value.hint) == (ignore == 4)  # 4 may be a fifth class as well
    fixed = y.masked_fill(y == ignore, -100)
    check_splits(DatasetSplits(data.train_x, fixed, data.val_x, fixed[:2], num_classes=4), "mine:seg")


@pytest.mark.parametrize(
    ("y", "why"),
    [
        (_masks(255).masked_fill(_masks(255) == 3, 7), "two values out of range: no one ignore value"),
        (torch.arange(8) % 4 + 252, "one label per row: no position to leave unlabelled"),
    ],
)
def test_labels_out_of_range_without_one_ignore_value_keep_the_general_fix(y: torch.Tensor, why: str) -> None:
    n = len(y)
    x = torch.zeros(n, 3, 6, 6) if y.ndim > 1 else torch.zeros(n, 3)
    data = DatasetSplits(x, y, x[:2], y[:2], num_classes=4)
    with pytest.raises(DataContractError) as info:
        check_splits(data, "mine:seg")
    assert info.value.hint == "fix the labels or num_classes", why


def test_num_classes_none_means_a_task_without_classes() -> None:
    from kiln.stages.accuracy.check import declares_classes

    splits = DatasetSplits(ids(8), torch.randn(8), ids(4), torch.randn(4), num_classes=None)
    assert splits.num_classes == 0 and not declares_classes(splits)


def test_labels_per_token_are_classes_or_the_ignore_label() -> None:
    """[N, seq] tags, -100 where a token has none (padding; Hugging Face's token-classification collator)."""
    tags = torch.randint(0, 4, (8, 6))
    tags[:, 4:] = -100
    check_splits(DatasetSplits(ids(8), tags, ids(4), tags[:4], num_classes=4), "d")


def test_the_ignore_label_in_labels_one_per_row_is_no_label_out_of_range() -> None:
    """Labels [N] holding -100 were said to run 'from -100 to 7, outside 0..8': -100 is the ignore value wherever it
    is (torch's cross-entropy and Kiln's accuracy leave it out), and a model of logits per position then gets the
    error that names the shape the labels need."""
    y = torch.tensor([0, 3, -100, 1, 2, -100, 3, 0])
    check_splits(DatasetSplits(torch.zeros(8, 2), y, torch.zeros(2, 2), y[:2], num_classes=4), "d")
    out = torch.tensor([0, 7, -100, 1, 2, -100, 3, 0])
    with pytest.raises(DataContractError, match=r"train_y has labels from 0 to 7, outside 0\.\.3"):
        check_splits(DatasetSplits(torch.zeros(8, 2), out, torch.zeros(2, 2), y[:2], num_classes=4), "d")


def test_a_declared_dynamic_axis_may_differ_between_splits() -> None:
    check_splits(
        DatasetSplits(ids(8, 6), None, ids(4, 5), None), "d", {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    )


def test_axes_declared_under_a_name_the_data_lacks_are_named_in_the_shape_error() -> None:
    """A bare tensor is the input 'input': axes keyed by the model's own name ('input_values') free no axis of it,
    and the error says so instead of only advising to declare an axis (as the config already does)."""
    audio = DatasetSplits(torch.zeros(8, 40), None, torch.zeros(2, 24), None)
    with pytest.raises(DataContractError) as info:
        check_splits(audio, "mine:data", {"input_values": {1: "time"}})
    assert "signature.dynamic_axes names 'input_values', not an input of the data (its inputs: ['input'])" in (
        info.value.message
    )
    assert info.value.hint == (
        "key signature.dynamic_axes by 'input' (data given as one tensor is the input 'input': {input: {1: time}}), "
        "or give the data as a dict {'input_values': tensor}"
    )


def test_splits_of_different_dtypes_get_a_dtype_fix_not_an_axis_to_declare() -> None:
    """The axis that varies is declared; what differs is the dtype, and the fix says so."""
    val = ids(4)
    val["attention_mask"] = val["attention_mask"].int()
    axes = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    with pytest.raises(
        DataContractError, match="input 'attention_mask': train_x is torch.int64 but val_x is torch.int32"
    ) as info:
        check_splits(DatasetSplits(ids(8), None, val, None), "mine:data", axes)
    assert info.value.hint == "give both splits the same dtype (e.g. val_x['attention_mask'].to(torch.int64))"


def test_input_names_come_from_keys_or_the_forward() -> None:
    class Two(nn.Module):
        def forward(self, dense, sparse):
            return dense

    assert input_names(Two(), (torch.zeros(1), torch.zeros(1))) == ["dense", "sparse"]
    assert input_names(Two(), {"sparse": torch.zeros(1)}) == ["sparse"]
    assert input_names(Two(), torch.zeros(1)) == ["input"]


def test_inputs_go_by_keyword_where_the_export_named_them() -> None:
    """How a backend that calls the model itself (torch) passes the ONNX inputs: as the export's names say."""

    class Two(nn.Module):
        def forward(self, dense, sparse):
            return dense

    class Kwargs(nn.Module):
        def forward(self, **batch):
            return batch["a"]

    class Varargs(nn.Module):
        def forward(self, *xs):
            return xs[0]

    assert by_keyword(Two(), ["sparse", "dense"])  # a dict in another order than the forward's
    assert by_keyword(Kwargs(), ["a", "b"])
    assert not by_keyword(Two(), ["input"])  # a bare tensor
    assert not by_keyword(Varargs(), ["input_0", "input_1"])
    assert not by_keyword(Two(), ["dense", "sparse", "input_2"])


def test_outputs_flatten_and_the_logits_default() -> None:
    t = torch.zeros(2, 3)
    assert list(flatten_outputs((t, t))) == ["output_0", "output_1"]
    assert list(flatten_outputs({"hidden": t, "logits": t, "attentions": None})) == ["hidden", "logits"]
    nested = flatten_outputs((t, [t, {"a": t, "skip": None}], {"text": {"pooled": t}}))  # CLIP-like nesting
    assert list(nested) == ["output_0", "output_1.0", "output_1.1.a", "output_2.text.pooled"]
    with pytest.raises(ModelError, match="output 'output_1.0' as str, not a tensor"):
        flatten_outputs((t, ["x"]))

    class DynamicCache:  # what a transformers causal LM returns beside its logits with use_cache on
        pass

    with pytest.raises(ModelError, match="as DynamicCache") as caught:
        flatten_outputs({"logits": t, "past_key_values": DynamicCache()})
    assert "use_cache=False" in caught.value.hint and "past_key_values" in caught.value.hint
    assert logits_name(["x"], None) == "x" and logits_name(["hidden", "logits"], None) == "logits"
    # one output whose name says it holds features (a T5 encoder, a sentence embedder): no class logits by default
    for features in ("last_hidden_state", "pooler_output", "image_embeds", "embedding", "features"):
        assert logits_name([features], None) is None and logits_name([features], 0) == features
    assert (
        logits_name(["output_0", "output_1"], None) is None and logits_name(["output_0", "output_1"], -1) == "output_1"
    )
    with pytest.raises(ConfigError, match="not an output of the model"):
        logits_name(["a"], "logits")


USER = """
import torch
from torch import nn
from kiln import DatasetSplits


class Two(nn.Module):
    def __init__(self, returns="tensor"):
        super().__init__()
        self.lin, self.returns = nn.Linear(4, 3), returns

    def forward(self, dense, mask):
        out = self.lin(dense * mask)
        return {"logits": out, "extra": "text"} if self.returns == "dict-with-text" else out


def build(returns="tensor"):
    return Two(returns)


def data(key="mask", labels=True):
    g = torch.Generator().manual_seed(0)
    x = {"dense": torch.randn(64, 4, generator=g), key: torch.ones(64, 4)}
    y = torch.randint(0, 3, (64,), generator=g) if labels else None
    return DatasetSplits({k: v[:48] for k, v in x.items()}, None if y is None else y[:48],
                         {k: v[48:] for k, v in x.items()}, None if y is None else y[48:], num_classes=3)
"""


@pytest.mark.parametrize(
    "model_params, data_params, extra, message",
    [
        ({}, {"key": "attention_mask"}, {}, "forward\\(dense, mask\\) takes no argument 'attention_mask'"),
        ({"returns": "dict-with-text"}, {}, {}, "output 'extra' as str, not a tensor"),
        ({}, {"labels": False}, {}, "has no labels \\(train_y is None\\): training needs them"),
    ],
)
def test_cli_errors_are_one_error_and_one_fix(tmp_path: Path, model_params, data_params, extra, message) -> None:
    (tmp_path / "contract_user.py").write_text(textwrap.dedent(USER))
    cfg = tiny_config_dict(
        **{
            "model.name": "contract_user:build",
            "model.params": model_params,
            "data.name": "contract_user:data",
            "data.params": data_params,
            **extra,
        }
    )
    path = tmp_path / "kiln.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "wd"), "--quiet"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith(("error:", "fix:"))]
    assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("fix:"), result.output
    assert __import__("re").search(message, lines[0]), lines[0]


def test_no_labels_with_training_off_validates_by_agreement(tmp_path: Path) -> None:
    (tmp_path / "contract_user.py").write_text(textwrap.dedent(USER))
    cfg = tiny_config_dict(
        **{
            "model.name": "contract_user:build",
            "model.params": {},
            "train.enabled": False,
            "data.name": "contract_user:data",
            "data.params": {"labels": False},
        }
    )
    path = tmp_path / "kiln.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(main, ["run", str(path), "-w", str(tmp_path / "wd"), "--quiet"])
    assert result.exit_code == 0, result.output
    v = yaml.safe_load((tmp_path / "wd" / "validate" / "validation.json").read_text())
    assert v["passed"] and v["baseline"]["accuracy"] is None
    assert all(e["accuracy"] is None and e["top1_agreement"] == 1.0 for e in v["engines"])


def test_a_list_of_input_tensors_is_the_tuple_a_user_meant() -> None:
    u, i = torch.randn(10, 6), torch.randn(10, 4)
    y = torch.zeros(10, dtype=torch.long)
    data = DatasetSplits([u[:8], i[:8]], y[:8], [u[8:], i[8:]], y[8:], 2)
    assert isinstance(data.train_x, tuple) and isinstance(data.val_x, tuple)
    check_splits(data, "mine:load")
    assert data.sample_shapes == {"0": [6], "1": [4]}


def test_tuple_data_whose_axis_varies_is_told_to_name_its_inputs() -> None:
    """A tuple's inputs are named by forward(), which the data check cannot see: its hint was {0: {1: seq}}, an
    invalid config; dicts keyed by those names are the way that works."""
    part = lambda n, seq: (torch.rand(n, seq, 3), torch.ones(n, seq))  # noqa: E731
    data = DatasetSplits(part(8, 10), None, part(4, 7), None)
    with pytest.raises(DataContractError) as err:
        check_splits(data, "d", {"feats": {1: "seq"}, "mask": {1: "seq"}})
    assert "as dicts keyed by forward()'s parameter names" in (err.value.hint or "")
    assert "{0:" not in (err.value.hint or "")


@pytest.mark.parametrize(
    "targets",
    [
        lambda n: {"hm": torch.zeros(n, 2, 4, 4), "wh": torch.zeros(n, 2, 4, 4)},
        lambda n: (torch.zeros(n, 2, 4, 4), torch.zeros(n, 2, 4, 4)),
    ],
)
def test_targets_as_a_dict_or_tuple_of_tensors_are_told_to_pack_them(targets) -> None:
    """A detector's targets {hm, wh, ...} are tensors already: the fix said to wrap arrays with torch.from_numpy."""
    data = DatasetSplits(torch.zeros(8, 3), targets(8), torch.zeros(2, 3), targets(2))
    with pytest.raises(DataContractError, match="gives train_y as (dict|tuple), not a torch.Tensor or None") as err:
        check_splits(data, "mine:data")
    assert "pack the targets into one tensor" in err.value.hint and "train.loss" in err.value.hint
    assert "from_numpy" not in err.value.hint
    with pytest.raises(DataContractError, match="wrap arrays with torch.from_numpy"):  # arrays still get that fix
        check_splits(DatasetSplits(torch.zeros(8, 3), [0] * 8, torch.zeros(2, 3), [0] * 2), "mine:data")


class _KeywordsOnly(nn.Module):
    """A research model's forward(**batch): it takes its inputs by name only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self.fc(batch["image"])


def test_a_forward_of_keywords_only_fed_a_bare_tensor_is_told_to_give_a_dict() -> None:
    """It failed with "forward() takes 1 positional argument but 2 were given" and a fix to change the data or
    model.params."""
    from kiln.core.data import check_forward_takes

    for x in (torch.zeros(2, 3), (torch.zeros(2, 3),)):
        with pytest.raises(DataContractError, match="takes keyword arguments only") as err:
            check_forward_takes(_KeywordsOnly(), x, "m:build")
        assert "as a dict {name: tensor}" in err.value.hint
    check_forward_takes(_KeywordsOnly(), {"image": torch.zeros(2, 3)}, "m:build")
    check_forward_takes(nn.Linear(3, 2), torch.zeros(2, 3), "m:build")


def test_integer_ranges_are_per_column_where_the_graph_fixes_the_columns() -> None:
    """A recommender's ids packed in ``sparse [B, 2]`` (a 10-level and a 1000-level feature): one range per column
    where the graph fixes the last axis, since the widest column's range ran the optimizer's safety net past the
    small table; token ids along a dynamic sequence axis, and columns of one range, keep one range."""
    g = torch.Generator().manual_seed(0)
    sparse = torch.stack([torch.randint(0, 10, (64,), generator=g), torch.randint(0, 1000, (64,), generator=g)], 1)
    tokens = torch.randint(0, 50, (64, 6), generator=g)
    tokens[:, 0] = 1  # a start token: its column differs, but the axis is a sequence
    same = torch.randint(0, 3, (64, 2), generator=g)
    x = {"sparse": sparse, "tokens": tokens, "same": same}
    data = DatasetSplits({k: v[:48] for k, v in x.items()}, None, {k: v[48:] for k, v in x.items()}, None)
    specs = [
        TensorSpec(name="sparse", shape=["batch", 2], dtype="int64"),
        TensorSpec(name="tokens", shape=["batch", "seq"], dtype="int64"),
        TensorSpec(name="same", shape=["batch", 2], dtype="int64"),
    ]
    columns = fixed_columns(specs)
    assert columns == {"sparse": 2, "same": 2}
    ranges = integer_ranges(data, list(x), columns)
    low, high = sparse.min(0).values.tolist(), sparse.max(0).values.tolist()
    assert ranges["sparse"] == [[low[0], high[0]], [low[1], high[1]]] and high[0] <= 9 < high[1]
    assert ranges["tokens"] == [0, int(tokens.max())] and ranges["same"] == [0, 2]
    assert integer_ranges(data, list(x))["sparse"] == [int(sparse.min()), int(sparse.max())]  # no graph: one range
    # with the graph's index ranges, only an input whose columns index tables of their own is ranged per column:
    # token ids of a fixed length ([batch, 6], a start token in column 0) keep one range
    fixed = [*specs[:1], TensorSpec(name="tokens", shape=["batch", 6], dtype="int64")]
    tables = {"sparse": [[0, 9], [0, 999]], "tokens": [0, 49]}
    assert fixed_columns(fixed, tables) == {"sparse": 2}
    assert integer_ranges(data, list(x), fixed_columns(fixed, tables))["tokens"] == [0, int(tokens.max())]


def test_as_many_inputs_as_rows_are_inputs_not_samples() -> None:
    """Ten inputs of ten rows each beside ten labels: a wide model's inputs (every one has a row per label), not a
    list of ten samples."""
    x = tuple(torch.zeros(10, 4) for _ in range(10))
    data = DatasetSplits(x, torch.zeros(10), x, torch.zeros(10))
    check_splits(data, "d")


def test_columns_shifted_into_one_table_are_ranged_one_by_one_and_an_unranged_input_is_not() -> None:
    """A tabular FT-Transformer's ``x_cat [B, 3]`` (4, 10 and 3 levels) indexes its shared table after an offset per
    column, which the graph's index ranges follow (a range per column): its columns are ranged one by one (one
    range, 0 to 9, had the safety net draw past the 3-level column's rows). Token ids of a fixed length, which the
    graph ranges by their table, keep one range; so do an input the graph gives no range (uint8 pixels cast to
    float would take one range per pixel, ids behind a clamp one per position)."""
    g = torch.Generator().manual_seed(0)
    x_cat = torch.stack([torch.randint(0, k, (64,), generator=g) for k in (4, 10, 3)], 1)
    tokens = torch.randint(0, 50, (64, 6), generator=g)
    tokens[:, 0] = 1  # a start token: its column differs, but the axis is a sequence
    pixels = torch.randint(0, 256, (64, 3, 4, 4), generator=g)
    x = {"x_cat": x_cat, "tokens": tokens, "pixels": pixels}
    data = DatasetSplits({k: v[:48] for k, v in x.items()}, None, {k: v[48:] for k, v in x.items()}, None)
    specs = [
        TensorSpec(name="x_cat", shape=["batch", 3], dtype="int64"),
        TensorSpec(name="tokens", shape=["batch", 6], dtype="int64"),
        TensorSpec(name="pixels", shape=["batch", 3, 4, 4], dtype="int64"),
    ]
    columns = fixed_columns(specs, {"tokens": [0, 49], "x_cat": [[0, 16], [-4, 12], [-14, 2]]})
    assert columns == {"x_cat": 3}
    ranges = integer_ranges(data, list(x), columns)
    assert ranges["x_cat"] == [[0, 3], [0, 9], [0, 2]] and ranges["tokens"] == [0, int(tokens.max())]
    assert ranges["pixels"] == [int(pixels.min()), int(pixels.max())]


def test_ids_of_tables_on_an_axis_before_the_last_are_ranged_per_cell() -> None:
    """DLRM's multi-hot ids ``sparse [B, 4, 3]``: 4 tables (1000, 50, 20 and 5 rows) of 3 ids each. Where the graph
    ranges its cells one by one, so does the data: cell ``t * 3 + j`` holds table ``t``'s ids (one range over the
    last axis, the ids within a table, had the safety net draw up to 999 for the 5-row table); so does a caller
    without the graph's ranges."""
    g = torch.Generator().manual_seed(0)
    rows = (1000, 50, 20, 5)
    sparse = torch.stack([torch.randint(0, n, (64, 3), generator=g) for n in rows], 1)
    data = DatasetSplits({"sparse": sparse[:48]}, None, {"sparse": sparse[48:]}, None)
    specs = [TensorSpec(name="sparse", shape=["batch", 4, 3], dtype="int64")]
    tables = {"sparse": [[0, n - 1] for n in rows for _ in range(3)]}
    assert fixed_columns(specs, tables) == fixed_columns(specs) == {"sparse": 12}
    ranges = integer_ranges(data, ["sparse"], fixed_columns(specs, tables))["sparse"]
    flat = sparse.reshape(64, 12)
    assert ranges == [[int(lo), int(hi)] for lo, hi in zip(flat.min(0).values, flat.max(0).values)]
    assert max(high for _, high in ranges[9:]) <= 4 < ranges[0][1]


def test_integer_labels_without_num_classes_name_group_ids_in_the_fix() -> None:
    """Labels that are a contrastive loss's groups (positives share an id) need num_classes too: the fix says so."""
    from kiln.core.data import DataContractError, _check_labels

    with pytest.raises(DataContractError) as caught:
        _check_labels(torch.tensor([0, 1, 1, 2]), "train", 0, "emb:load")
    assert "group ids for a train.loss of yours" in (caught.value.hint or "")


def _bags(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags of ids laid end to end, nn.EmbeddingBag's flat form: the ids and where each bag starts."""
    offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return torch.arange(1, sum(lengths) + 1), offsets


def test_an_embedding_bags_flat_ids_and_offsets_are_told_the_padded_form() -> None:
    """Flat ids [total] beside offsets [N] have no batch axis: the fix names them and the padded [N, L] form with
    padding_idx, not an RNN state's batch axis."""
    ids, offsets = _bags([2, 3, 1, 4])
    item = torch.tensor([3, 1, 2, 0])
    data = DatasetSplits((ids, offsets, item), torch.zeros(4), (ids, offsets, item), torch.zeros(4))
    with pytest.raises(DataContractError, match="different row counts") as e:
        check_splits(data, "d")
    assert e.value.hint.startswith("train_x[0] and train_x[1] read as an nn.EmbeddingBag's flat ids and offsets")
    assert "padding_idx" in e.value.hint and "RNN" not in e.value.hint


def test_inputs_of_other_row_counts_that_are_no_bags_keep_the_general_fix() -> None:
    """1-D integers of another length are no bags where none of them starts at 0 and never decreases."""
    x = (torch.tensor([5, 2, 7, 1, 9]), torch.tensor([4, 1, 3]))
    with pytest.raises(DataContractError) as e:
        check_splits(DatasetSplits(x, None, x, None), "d")
    assert e.value.hint.startswith("give every input one row per sample on axis 0")


def test_dynamic_axes_on_an_input_of_the_batch_axis_alone_say_to_remove_it() -> None:
    """Before: "(0 is the batch; 1..0 may vary)" and "fix: name an axis from 1 to 0 of 'timestep'"."""
    x = {"image": torch.zeros(4, 3), "timestep": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises(DataContractError) as err:
        check_splits(DatasetSplits(x, None, x, None), "cnet:load", {"timestep": {1: "t"}})
    assert err.value.message == (
        "signature.dynamic_axes gives input 'timestep' axis 1, but dataset 'cnet:load' gives 'timestep' only the "
        "batch axis (axis 0)"
    )
    assert (
        err.value.hint == "remove 'timestep' from signature.dynamic_axes (signature.batch_sizes sizes the batch axis)"
    )


def test_a_nan_in_a_tuple_input_names_it_by_its_index_and_in_a_dict_by_its_key() -> None:
    from kiln.core.data import _check_values

    bad = torch.tensor([[float("nan"), 1.0]])
    with pytest.raises(DataContractError, match=r"train_x\[1\] holds 1 NaN values"):
        _check_values((torch.zeros(1, 2), bad), None, "train", "m:load")
    with pytest.raises(DataContractError, match=r"train_x\['mask'\] holds 1 NaN values"):
        _check_values({"mask": bad}, None, "train", "m:load")


def test_a_graph_without_a_batch_axis_is_told_the_batch_of_one() -> None:
    """Nodes [N, F] beside edge_index [2, E] indexing them are one sample: the fix was an RNN state's transpose."""
    x, edges = torch.zeros(20, 16), torch.randint(0, 20, (2, 50))
    data = DatasetSplits((x, edges), torch.zeros(20, dtype=torch.long), (x, edges), torch.zeros(20, dtype=torch.long))
    with pytest.raises(DataContractError, match="different row counts") as e:
        check_splits(data, "d")
    assert (
        "batch of one" in e.value.hint
        and "[1, 2, 50]" in e.value.hint
        and "signature.batch_sizes: [1]" in (e.value.hint)
    )
    assert "transpose" not in e.value.hint


def test_an_rnn_state_of_batch_on_axis_1_keeps_the_transpose_fix() -> None:
    x = (torch.zeros(8, 5, 3), torch.zeros(2, 8, 4))
    with pytest.raises(DataContractError) as e:
        check_splits(DatasetSplits(x, None, x, None), "d")
    assert "h0.transpose(0, 1)" in e.value.hint


def test_labels_per_node_beside_a_graph_as_a_batch_of_one_are_told_y_none() -> None:
    """Labels [N] beside x [1, N, F] were told to give one label per sample: they lack the sample's axis."""
    x, edges = torch.zeros(1, 20, 16), torch.zeros(1, 2, 50, dtype=torch.long)
    y = torch.zeros(20, dtype=torch.long)
    with pytest.raises(DataContractError, match="train_x has 1 rows but train_y has shape \\[20\\]") as e:
        check_splits(DatasetSplits((x, edges), y, (x, edges), y[None], num_classes=2), "d")
    assert "train_y[None] (labels [1, 20])" in e.value.hint


class _PositionalOnly(nn.Module):
    def forward(self, *a: torch.Tensor) -> torch.Tensor:
        return a[0]


class _Mixed(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return x


def test_a_forward_of_args_alone_given_a_dict_is_told_to_give_a_tuple() -> None:
    """forward(self, *a) given a dict was told it takes no argument 'query_ids' and to name the keys after []."""
    from kiln.core.data import check_forward_takes

    with pytest.raises(DataContractError, match=r"forward\(\*a\) takes positional arguments only") as err:
        check_forward_takes(_PositionalOnly(), {"query_ids": torch.zeros(2, 3)}, "m:build")
    assert "as a tuple" in err.value.hint and "[]" not in err.value.hint
    with pytest.raises(DataContractError, match=r"forward\(x, \*rest\) takes no argument 'y'"):
        check_forward_takes(_Mixed(), {"y": torch.zeros(2, 3)}, "m:build")


def test_per_image_dicts_of_boxes_are_told_to_pad_them_into_detection_rows() -> None:
    """Hugging Face detection labels, one dict {class_labels, boxes} per image, were told to wrap arrays."""

    def labels(n: int) -> list[dict[str, torch.Tensor]]:
        return [{"class_labels": torch.tensor([1] * (i % 3)), "boxes": torch.rand(i % 3, 4)} for i in range(n)]

    data = DatasetSplits(torch.zeros(4, 3), labels(4), torch.zeros(2, 3), labels(2))
    with pytest.raises(DataContractError, match="gives train_y as list") as err:
        check_splits(data, "det:load_hf")
    assert "[N, M, 5]" in err.value.hint and "(class, x1, y1, x2, y2)" in err.value.hint
    assert "-1" in err.value.hint and "detection_recall" in err.value.hint and "from_numpy" not in err.value.hint
    plain = [{"a": torch.zeros(2), "b": torch.zeros(1)} for _ in range(4)]
    with pytest.raises(DataContractError) as err:
        check_splits(DatasetSplits(torch.zeros(4, 3), plain, torch.zeros(2, 3), plain[:2]), "mine:data")
    assert "stack" in err.value.hint and "[N, M, 5]" not in err.value.hint and "from_numpy" not in err.value.hint
