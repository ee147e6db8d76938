"""TensorRT's error text as Kiln says it: one line, whole words (no TensorRT needed)."""

from kiln.stages.engines.tensorrt.errors import one_line


def test_a_message_with_line_breaks_and_a_source_mark_cut_mid_name_reads_as_one_line() -> None:
    desc = (
        "Invalid Node - /model/lstm/LSTM\nITensor::getDimensions: Error Code 4: API Usage Error (ISelectLayer must "
        "have `thenInput` and `elseInput` of same types but has Half and Float.)\n[checkMacros.cpp::catchCud"
    )
    said = one_line(desc)
    assert "\n" not in said and "checkMacros" not in said
    assert said.startswith("Invalid Node - /model/lstm/LSTM ITensor::getDimensions") and said.endswith("Float.)")


def test_a_long_message_is_cut_at_a_word() -> None:
    said = one_line("word " * 100, limit=32)
    assert said == "word word word word word word ..." and len(said) <= 36
    assert one_line("short [optimizer.cpp::build::12] end") == "short end"
