"""FSDP (ZeRO-3) and activation recomputation as parts of a DistConfig, on 4 gloo processes."""

import pytest

from hotswitch.distconfig import parse_configs
from tests.compile_checks import assert_equivalent
from tests.distributed import dist_fixture

pytestmark = pytest.mark.slow


def check_fsdp_gpt():
    return assert_equivalent("gpt", parse_configs("fsdp4,fsdp2tp2,dp4"))


def check_recompute_gpt():
    return assert_equivalent("gpt", parse_configs("dp4-full,dp2tp2-sel,tp4sp-full"))


results = dist_fixture(4, [check_fsdp_gpt, check_recompute_gpt])


def test_fsdp_gpt(results):
    print(results["check_fsdp_gpt"].raise_if_failed()[0])


def test_recompute_gpt(results):
    print(results["check_recompute_gpt"].raise_if_failed()[0])
