"""Read a Prometheus text endpoint into {(name, labels): value} for exact assertions."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Series = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


def scrape_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return str(response.read().decode("utf-8"))


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 for a series never recorded (a counter that stayed at 0)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def settled(scrape: Callable[[], Samples], expected: dict[Series, float]) -> Samples:
    """Scrape until every expected value is reached (the server counts a call after its
    reply has gone, so a scrape right after the reply may miss it), then return the
    samples to assert on."""
    deadline = time.monotonic() + 5
    while True:
        samples = scrape()
        reached = all(
            value(samples, name, **dict(labels)) >= v for (name, labels), v in expected.items()
        )
        if reached or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
