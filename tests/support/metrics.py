"""Reading a node's /metrics as Prometheus would: prometheus_client's own parser, samples by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http import raw

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """(sample name, sorted labels) -> value, as Prometheus would read them."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str, key: str | None = None) -> Samples:
    """The node's /metrics, parsed; fails unless it answered 200 with Prometheus's text format."""
    status, headers, data = raw(url, "GET", "/metrics", key=key, timeout=10)
    assert status == 200, (status, data[:300])
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse(data.decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when absent (a counter that never moved has no sample yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
