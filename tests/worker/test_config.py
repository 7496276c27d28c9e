"""EngineConfig's defaults that depend on the device, and their command-line flags."""

from __future__ import annotations

import pytest
from headrace.sdk.cli import build_parser
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import CPU_STEP_TOKENS, STEP_TOKENS, EngineConfig


def test_a_cpu_step_holds_fewer_tokens_than_a_cuda_one_by_default() -> None:
    cpu = EngineConfig(model="unused", device="cpu")
    cuda = EngineConfig(model="unused", device="cuda")
    assert cpu.max_num_batched_tokens == CPU_STEP_TOKENS < STEP_TOKENS
    assert cuda.max_num_batched_tokens == STEP_TOKENS


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_budget_given_is_kept_on_every_device(device: str) -> None:
    config = EngineConfig(model="unused", device=device, max_num_batched_tokens=4096)
    assert config.max_num_batched_tokens == 4096


def test_a_negative_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfig(model="unused", max_num_batched_tokens=-1)
    assert info.value.field == "max_num_batched_tokens"


@pytest.mark.parametrize("command", [["worker"], ["bench", "engine"]])
def test_the_flag_left_out_takes_the_devices_budget(command: list[str]) -> None:
    args = build_parser().parse_args(command)
    config = EngineConfig(
        model="unused", device="cpu", max_num_batched_tokens=args.max_num_batched_tokens
    )
    assert config.max_num_batched_tokens == CPU_STEP_TOKENS
