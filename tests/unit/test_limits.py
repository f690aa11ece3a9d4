"""pdproc.limits: the descriptor plan at start and the gRPC listener's bounds."""

from __future__ import annotations

import resource

import pytest

from pdproc.limits import (
    GRPC_MAX_CONNECTIONS,
    HTTP_MAX_CONNECTIONS,
    MIN_DESCRIPTORS,
    RESERVE_DESCRIPTORS,
    apply_descriptor_limit,
    grpc_options,
    needed_descriptors,
    plan_descriptors,
)

UNLIMITED = resource.RLIM_INFINITY


def test_needed_descriptors_counts_every_bound() -> None:
    base = 1024 + GRPC_MAX_CONNECTIONS + 1 + RESERVE_DESCRIPTORS
    assert needed_descriptors(1024, metrics_listener=False) == base
    assert needed_descriptors(1024, metrics_listener=True) == base + HTTP_MAX_CONNECTIONS + 1


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    plan = plan_descriptors(soft=1024, hard=65536, needed=2000)
    assert (plan.soft, plan.warning, plan.refusal) == (65536, None, None)


def test_below_what_the_settings_can_use_warns_and_names_the_flag() -> None:
    plan = plan_descriptors(soft=512, hard=1024, needed=2000)
    assert plan.soft == 1024
    assert plan.refusal is None
    assert plan.warning is not None
    assert "1024" in plan.warning
    assert "2000" in plan.warning
    assert "--max-prefill-connections" in plan.warning


def test_below_the_minimum_refuses_to_start() -> None:
    plan = plan_descriptors(soft=100, hard=MIN_DESCRIPTORS - 1, needed=2000)
    assert plan.warning is None
    assert plan.refusal is not None
    assert f"at least {MIN_DESCRIPTORS}" in plan.refusal


def test_unlimited_limits_are_enough() -> None:
    plan = plan_descriptors(UNLIMITED, UNLIMITED, 2000)
    assert (plan.soft, plan.warning, plan.refusal) == (UNLIMITED, None, None)
    # No hard limit: the soft one is raised to what the settings need, no further.
    plan = plan_descriptors(1024, UNLIMITED, 2000)
    assert (plan.soft, plan.warning, plan.refusal) == (2000, None, None)
    plan = plan_descriptors(4096, UNLIMITED, 2000)
    assert (plan.soft, plan.warning, plan.refusal) == (4096, None, None)


def test_apply_leaves_this_process_at_least_as_able_as_before() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        plan = apply_descriptor_limit(needed_descriptors(16, metrics_listener=True))
        now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert now_hard == hard
        assert now_soft == plan.soft
        assert now_soft == UNLIMITED or soft == UNLIMITED or now_soft >= soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("grpc.max_allowed_incoming_connections", GRPC_MAX_CONNECTIONS),
        ("grpc.server_handshake_timeout_ms", 10_000),
    ],
)
def test_grpc_options_carry_the_bounds(option: str, value: int) -> None:
    assert dict(grpc_options())[option] == value
