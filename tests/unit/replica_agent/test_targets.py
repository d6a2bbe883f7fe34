"""Clients that name several servers (replica_agent.targets): one gRPC target, round
robin across the servers, and calls sent again after UNAVAILABLE."""

from __future__ import annotations

import json

import pytest

from replica_agent.targets import balancing_options, grpc_target, is_balanced


def test_a_list_of_servers_becomes_one_balanced_target() -> None:
    assert grpc_target("10.0.0.7:50051") == "10.0.0.7:50051"
    assert grpc_target(["10.0.0.7:50051"]) == "10.0.0.7:50051"
    target = grpc_target(["10.0.0.7:50051", "10.0.0.8:50051"])
    assert target == "ipv4:10.0.0.7:50051,10.0.0.8:50051"
    assert grpc_target(["[::1]:1", "[::2]:2"]) == "ipv6:[::1]:1,[::2]:2"
    assert is_balanced(target) and is_balanced("dns:///store.internal:50051")
    assert not is_balanced("10.0.0.7:50051") and not is_balanced("ipv4:10.0.0.7:50051")


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        (["store-a:1", "store-b:1"], "name each by IP address"),
        (["10.0.0.7:1", "[::1]:1"], "mix of IPv4 and IPv6"),
        ([], "no server address"),
    ],
)
def test_servers_that_cannot_be_balanced_are_refused(servers: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        grpc_target(servers)


def test_balanced_channels_round_robin_and_retry_unavailable() -> None:
    assert balancing_options("10.0.0.7:50051") == []
    options = dict(balancing_options("ipv4:10.0.0.7:1,10.0.0.8:1"))
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    (method,) = config["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert options["grpc.enable_retries"] == 1
