"""The `headrace` command line: `models list` and `models prepare`.

A model counts as prepared when its folder holds the marker, so these tests make one by hand
instead of running the conversion (tests/worker/test_model_store.py covers that).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from headrace.sdk.cli import build_parser, main
from headrace.worker.models.store import CACHE_ENV, DEFAULT_MODEL, PREPARED_MARKER, model_dir


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def mark_prepared(name: str) -> Path:
    path = model_dir(name)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / PREPARED_MARKER).write_text("{}")
    return path


def test_models_list_shows_default_name_and_state(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row == [DEFAULT_MODEL, "(default)", "no", str(model_dir(DEFAULT_MODEL))]

    mark_prepared(DEFAULT_MODEL)
    assert main(["models", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[2] == "yes"


def test_models_prepare_prints_the_path(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = mark_prepared(DEFAULT_MODEL)
    assert main(["models", "prepare"]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert main(["models", "prepare", DEFAULT_MODEL]) == 0
    assert capsys.readouterr().out.strip() == str(path)


def test_models_prepare_unknown_name_fails_with_message(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "prepare", "gpt-5"]) == 1
    err = capsys.readouterr().err
    assert "unknown model name 'gpt-5'" in err
    assert DEFAULT_MODEL in err


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 2
    assert "usage: headrace" in capsys.readouterr().err


def test_cli_and_models_list_do_not_import_torch(cache: Path) -> None:
    code = (
        "import sys; from headrace.sdk.cli import main; main(['models', 'list']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert DEFAULT_MODEL in result.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _commands() -> dict[str, argparse.ArgumentParser]:
    top = _subparsers(build_parser())
    commands = {name: top[name] for name in ("worker", "router", "up", "generate")}
    commands.update({f"bench {n}": p for n, p in _subparsers(top["bench"]).items()})
    return commands


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_help_and_shows_its_default(name: str) -> None:
    parser = _commands()[name]
    help_text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        meaningful = action.default not in (None, False, "", [], argparse.SUPPRESS)
        if meaningful and action.nargs != 0:
            shown = f"(default: {action.default})"
            assert shown in " ".join(help_text.split()), f"{name} {action.option_strings[0]}"


def test_examples_in_help_keep_their_lines() -> None:
    help_text = _commands()["generate"].format_help()
    assert '    headrace generate "What is the capital of France?"' in help_text


@pytest.mark.parametrize("spelling", ["bf16", "fp16", "fp32", "bfloat16", "float"])
def test_dtype_takes_the_usual_spellings(spelling: str) -> None:
    from headrace.worker.config import EngineConfig

    assert EngineConfig(model="unused", dtype=spelling).dtype == spelling


@pytest.mark.parametrize("name", ["worker", "bench engine"])
def test_kernel_backend_choices_are_the_kernel_backends(name: str) -> None:
    from headrace.kernels import BACKEND_NAMES

    parser = _commands()[name]
    (action,) = [a for a in parser._actions if "--kernel-backend" in a.option_strings]
    assert tuple(action.choices) == BACKEND_NAMES
    assert parser.parse_args([]).kernel_backend == "auto"


def _engine_choices(flag: str) -> tuple[str, ...]:
    """The engine's own values for a flag whose choices the CLI spells out (no torch)."""
    from headrace.kernels.kv_layout import KV_CACHE_DTYPES
    from headrace.worker.config import QUANTIZATIONS, SCHEDULING_POLICIES

    return {
        "--quantization": QUANTIZATIONS,
        "--kv-cache-dtype": KV_CACHE_DTYPES,
        "--scheduling-policy": SCHEDULING_POLICIES,
    }[flag]


@pytest.mark.parametrize("name", ["worker", "bench engine"])
@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--quantization", "int4"),
        ("--kv-cache-dtype", "int8"),
        ("--scheduling-policy", "shortest-first"),
    ],
)
def test_quantization_choices_are_the_engines(name: str, flag: str, value: str) -> None:
    parser = _commands()[name]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert tuple(action.choices) == _engine_choices(flag)
    assert getattr(parser.parse_args([flag, value]), action.dest) == value
    assert getattr(parser.parse_args([]), action.dest) in action.choices


@pytest.mark.parametrize("name", ["worker", "bench engine"])
def test_attention_backend_is_a_deprecated_spelling_of_kernel_backend(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = _commands()[name]
    assert parser.parse_args(["--attention-backend", "cpu"]).kernel_backend == "cpu"
    assert "--attention-backend is deprecated; use --kernel-backend" in capsys.readouterr().err
    assert parser.parse_args(["--kernel-backend", "reference"]).kernel_backend == "reference"
    assert "deprecated" not in capsys.readouterr().err
    assert "--attention-backend" not in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])


def test_lora_flags_parse_name_path_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["worker", "--lora", "sql=/a/sql", "--lora", "chat=/a/c=d"])
    assert args.lora == [("sql", "/a/sql"), ("chat", "/a/c=d")]
    assert parser.parse_args(["generate", "--adapter", "sql", "hi"]).adapter == "sql"
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--lora", "no-equals-sign"])
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_tool_call_parser_takes_the_known_formats(capsys: pytest.CaptureFixture[str]) -> None:
    from headrace.sdk.errors import InvalidArgumentError
    from headrace.worker.serving.server import ServerOptions

    parser = build_parser()
    assert parser.parse_args(["worker"]).tool_call_parser is None  # from the chat template
    args = parser.parse_args(["worker", "--tool-call-parser", "llama3_json"])
    assert ServerOptions(tool_call_parser=args.tool_call_parser).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--tool-call-parser", "pythonic"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="hermes, llama3_json, mistral"):
        ServerOptions(tool_call_parser="pythonic")


def test_generate_flags_become_constraints_and_logit_controls(tmp_path: Path) -> None:
    from headrace.sdk.errors import InvalidArgumentError
    from headrace.sdk.generate import _control_options

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = build_parser().parse_args(
        ["generate", "q", "--json-schema", str(schema), "--logit-bias", "5=-1.5",
         "--logit-bias", "7=2", "--bad-word", "no"]
    )  # fmt: skip
    options = _control_options(args)
    assert options["json_schema"] == '{"type": "object"}'
    assert (options["logit_bias"], options["bad_words"]) == ({5: -1.5, 7: 2.0}, ("no",))
    choices = build_parser().parse_args(["generate", "q", "--choice", "a", "--choice", "b"])
    assert _control_options(choices)["choice"] == ("a", "b")
    bad = build_parser().parse_args(["generate", "q", "--logit-bias", "five"])
    with pytest.raises(InvalidArgumentError) as refused:
        _control_options(bad)
    assert refused.value.field == "logit_bias"


def test_generate_beam_flags_become_the_config() -> None:
    from headrace.sdk.generate import generation_config

    argv = ["generate", "q", "--num-beams", "4", "--n", "2", "--length-penalty", "0.5"]
    config = generation_config(build_parser().parse_args([*argv, "--early-stopping", "never"]))
    assert (config.num_beams, config.n, config.length_penalty) == (4, 2, 0.5)
    assert config.early_stopping == "never" and config.temperature == 0.0
    for flag, value in (("true", True), ("false", False)):
        args = build_parser().parse_args([*argv, "--early-stopping", flag])
        assert generation_config(args).early_stopping is value
    assert generation_config(build_parser().parse_args(["generate", "q"])).num_beams == 1


def test_generate_refuses_a_beam_flag_combination_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from headrace.sdk.errors import InvalidArgumentError
    from headrace.sdk.generate import generation_config

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "q", "--early-stopping", "soon"])
    assert "invalid choice: 'soon'" in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "q", "--num-beams", "2", "--top-p", "0.5"])
    with pytest.raises(InvalidArgumentError) as refused:
        generation_config(args)
    assert refused.value.field == "top_p"


def test_generate_prints_each_beam_whole_under_its_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from headrace.sdk.generate import print_samples
    from headrace.sdk.outputs import FinishReason, GenerationResult, SampleDelta

    result = GenerationResult.empty("r", 2, with_logprobs=False)
    for index, text, logprob in ((0, "red", -1.5), (1, "blue", -2.25)):
        result.add(
            SampleDelta(index, [7, 8, 9], text, finish_reason=FinishReason.STOP,
                        cumulative_logprob=logprob, beam_score=logprob / 3)
        )  # fmt: skip
    print_samples(result)
    assert capsys.readouterr().out.splitlines() == [
        "[beam 0: score -0.5000, cumulative logprob -1.5000, 3 tokens, finish: stop]",
        "red",
        "[beam 1: score -0.7500, cumulative logprob -2.2500, 3 tokens, finish: stop]",
        "blue",
    ]


def test_speculative_flags_default_to_the_engines() -> None:
    from headrace.worker.config import EngineConfig

    parser = build_parser()
    args, config = parser.parse_args(["worker"]), EngineConfig(model="unused")
    for name in (
        "num_speculative_tokens",
        "speculative_ngram_min",
        "speculative_ngram_max",
        "speculative_max_seqs",
        "speculative_model",
        "speculative_quantization",
    ):
        assert getattr(args, name) == getattr(config, name), name
    speculating = parser.parse_args(["worker", "--num-speculative-tokens", "5"])
    assert speculating.num_speculative_tokens == 5


def test_node_flags_default_to_one_node_with_the_engines_node_timeout() -> None:
    from headrace.worker.distributed.nodes import DEFAULT_NODE_TIMEOUT_S, NodeConfig

    args = _commands()["worker"].parse_args([])
    assert (args.nnodes, args.node_rank, args.dist_init_addr, args.ranks_per_node) == (
        1, 0, None, None,
    )  # fmt: skip
    assert args.node_timeout == DEFAULT_NODE_TIMEOUT_S == NodeConfig().node_timeout_s


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("2x1", (2, 1, None, None, 1, False)),
        ("1x2:2/1", (1, 2, 2, 1, 1, False)),
        ("2x2@2", (2, 2, None, None, 2, False)),
        ("1x2/1@2", (1, 2, None, 1, 2, False)),
        ("2x1+ep", (2, 1, None, None, 1, True)),
        ("2x2@2+ep", (2, 2, None, None, 2, True)),
    ],
)
def test_bench_parallel_configs_parse_and_label_back(text: str, shape: tuple) -> None:
    from dataclasses import astuple

    from headrace.worker.bench.cli import parse_shape

    parsed = parse_shape(text)
    assert astuple(parsed) == shape and parsed.label == text


def test_models_list_names_every_family_the_worker_runs(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headrace.worker.models.registry import MODEL_REGISTRY

    assert main(["models", "list"]) == 0
    shown = capsys.readouterr().out
    for model_type in MODEL_REGISTRY:
        assert f"\n{model_type} " in shown, model_type
    assert "not yet: deepseek_v3" in shown


def test_bench_parallel_model_shapes_are_the_benchs() -> None:
    from headrace.worker.bench.parallel import MODEL_SHAPES

    parser = _commands()["bench parallel"]
    (action,) = [a for a in parser._actions if "--model-shape" in a.option_strings]
    assert tuple(action.choices) == tuple(MODEL_SHAPES)
