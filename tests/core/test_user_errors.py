"""kiln.core.user_errors: an error raised in a model library the user's model comes from is the user's model's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kiln.core import user_errors
from kiln.core.user_errors import UserCodeError, running_user_code


def test_an_error_inside_a_library_model_is_named_with_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `transformers` BERT given a token id past its vocabulary fails in torch.embedding, with no frame in a file of
    the user's (Kiln's loop called the library's forward): one error naming the library and the step, not a
    traceback."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    model = transformers.BertModel(config).eval()
    monkeypatch.setattr(user_errors, "is_user_file", lambda filename: False)  # as when Kiln's loop calls it
    with pytest.raises(UserCodeError) as err, running_user_code("training step 3 (epoch 1)", model=True):
        model(torch.tensor([[1, 2, 20]]))
    message = err.value.message
    assert message.startswith("your model raised IndexError") and "of transformers" in message, message
    assert message.endswith("while training step 3 (epoch 1)") and "vocabulary" in err.value.hint


def test_an_error_of_torch_alone_is_not_placed_in_a_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(user_errors, "is_user_file", lambda filename: False)
    with pytest.raises(RuntimeError), running_user_code("training step 1", model=True):
        torch.zeros(2, 3) @ torch.zeros(2, 3)


def test_a_library_called_as_a_factory_keeps_its_callers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a model's code is placed in its library: a data function from a library that rejects its params is left
    to the caller, which says which params."""
    sklearn = pytest.importorskip("sklearn.datasets")
    monkeypatch.setattr(user_errors, "is_user_file", lambda filename: False)
    with pytest.raises(Exception) as err, running_user_code("loading data"):
        sklearn.load_digits(n_class=20)
    assert not isinstance(err.value, UserCodeError)


def test_user_code_calling_sys_exit_is_an_error_not_the_end_of_the_command(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss, reader or forward that calls sys.exit() (or argparse's parse_args on Kiln's own command line) ended
    Kiln's command with that status and no word; it is the user's error, with the function and line."""
    (tmp_path / "kiln_t_exiting.py").write_text("import sys\n\ndef reader():\n    sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kiln_t_exiting

    try:
        with pytest.raises(UserCodeError) as err, running_user_code("reading calibration batches", "reader 'r'"):
            kiln_t_exiting.reader()
    finally:
        monkeypatch.delitem(__import__("sys").modules, "kiln_t_exiting")
    assert err.value.message.startswith("reader 'r' called sys.exit(0) (in reader() at ")
    assert err.value.message.endswith("while reading calibration batches")
    assert err.value.hint.startswith("return instead of exiting in reader() at ") and "__main__" in err.value.hint


def test_a_models_index_past_its_own_table_points_at_the_data_too(tmp_path: Path) -> None:
    """A diffusion model's ``schedule[t]`` at t = 1000 raises in the model's line, but the timestep came from the
    data: the fix names both, with the range the table takes."""
    module = tmp_path / "ddpm_probe.py"
    module.write_text("import torch\n\ndef forward(t):\n    return torch.zeros(1000)[t]\n")
    spec = importlib.util.spec_from_file_location("ddpm_probe", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(UserCodeError) as err, running_user_code("training step 4", model=True):
        mod.forward(torch.tensor(1000))
    assert "forward() in" in (err.value.hint or "") and "holds 1000, past the 1000 rows" in (err.value.hint or "")
    assert "within 0..999" in (err.value.hint or "")
    with pytest.raises(UserCodeError) as err, running_user_code("loading data"):  # not the model: its line alone
        mod.forward(torch.tensor(1000))
    assert "past the" not in (err.value.hint or "")
