"""Two hosts on one machine (kvshare.bench.netns): the server in one network
namespace, replicas in another, joined by a veth pair on 198.18.0.0/15.

Everything that talks to the server runs as a process inside a namespace (the test
process itself stays in the machine's namespace, which may route 198.18.0.0/15
elsewhere). Needs root, as CI runs; elsewhere these tests skip and say why.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshare.bench import netns
from kvshare.bench.netns import TwoHosts


@pytest.fixture(scope="session")
def rig() -> Iterator[TwoHosts]:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with netns.two_hosts() as made:
        yield made
