"""The fix of a size check that failed on the TorchScript exporter's graph after the dynamo exporter failed: change
the line the dynamo exporter failed on; where that failure is torch's transformer stack reading a causal mask's
values, pass the stack's causal flag instead."""

from __future__ import annotations

from kiln.stages.export.sizes import _dynamo_hint

PLACE = " (in forward() at hand.py:26)"


def test_a_causal_mask_read_by_torchs_transformer_asks_for_its_flag() -> None:
    dynamo = (
        "Could not guard on data-dependent expression Eq(u0, 1): torch's nn.TransformerDecoder reads the mask's values"
        "; pass tgt_is_causal=True with the causal mask: nn.TransformerDecoder then trusts the flag" + PLACE
    )
    hint = _dynamo_hint(dynamo)
    assert hint.startswith("pass tgt_is_causal=True with the causal mask (in forward() at hand.py:26)"), hint
    assert "change the code" not in hint


def test_any_other_failure_asks_to_change_the_line() -> None:
    hint = _dynamo_hint("Could not guard on data-dependent expression Eq(u0, 1)" + PLACE)
    assert hint.startswith("change the code the dynamo exporter failed on, in forward() at hand.py:26"), hint
    assert _dynamo_hint("no place named") == ""
