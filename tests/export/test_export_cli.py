"""`splitserve export`'s arguments: checked before any model loads."""
import pytest

from splitserve.entrypoints.cli import build_parser


def test_export_subcommand_parses():
    args = build_parser().parse_args(["export", "m.gguf", "--output", "out", "--dtype", "float16", "--parts",
                                      "batchful,embed_tokens", "--random-weights"])
    assert (args.model, args.output, args.dtype, args.opset, args.random_weights) == ("m.gguf", "out", "float16", 18, True)


def test_bad_parts_and_opset_are_value_errors(tmp_path):
    from splitserve.export.exporter import export_model, parse_parts
    assert parse_parts("batchful, embed_tokens") == ("batchful", "embed_tokens")
    with pytest.raises(ValueError, match="unknown attention"):
        parse_parts("batchful,attention")
    with pytest.raises(ValueError, match="opset must be at least 18"):
        export_model(None, str(tmp_path), opset=17)
