"""`mooncake profile` refuses bad options before it starts an engine (no vLLM needed)."""

import pytest

from conductor.profile.cli import build_parser, main, option_errors


def errors(tmp_path, *extra: str) -> list[str]:
    return option_errors(build_parser().parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "p.json"),
                                                    *extra]))


def test_the_defaults_pass(tmp_path):
    assert errors(tmp_path) == []


@pytest.mark.parametrize("extra, words", [
    (["--block-size", "100"], "--block-size"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--bandwidth", "nan"], "--bandwidth"),
    (["--bandwidth", "-1"], "--bandwidth"),
    (["--cached-shares", "0,1"], "--cached-shares"),
    (["--prompt-lengths", "0,256,512,1024"], "must be positive"),
    (["--decode-tokens", "1"], "--decode-tokens"),
    (["--prompt-lengths", "256", "--cached-shares", "0"], "the fit needs"),
])
def test_each_bad_option_is_named(tmp_path, extra, words):
    found = errors(tmp_path, *extra)
    assert len(found) == 1 and words in found[0]


def test_an_out_path_that_cannot_be_written_is_refused_first(tmp_path, capsys):
    found = option_errors(build_parser().parse_args(["--model", str(tmp_path), "--out", str(tmp_path)]))
    assert found and "is a directory" in found[0]
    missing = tmp_path / "no" / "such" / "p.json"
    found = option_errors(build_parser().parse_args(["--model", str(tmp_path), "--out", str(missing)]))
    assert found and "does not exist" in found[0]
    # main() exits with argparse's usage error before reading the model or importing vLLM.
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path / "nothing-here"), "--out", str(missing)])
    assert info.value.code == 2 and "--out" in capsys.readouterr().err


def test_lengths_beyond_the_model_s_context_are_refused_before_vllm_loads(model_path, capsys):
    from conductor.profile.cli import main as profile_main

    with pytest.raises(SystemExit) as info:
        profile_main(["--model", model_path, "--prompt-lengths", "256,512,1024,9000"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "9,128 is longer than the model's context (8,192 tokens" in err
