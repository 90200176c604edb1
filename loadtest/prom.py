"""Reading Prometheus text exposition, through prometheus_client's parser only.

One parser for the harness, the real-vLLM runner and the tests, so escaping, label
quoting and counter suffixes are read the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str) -> Iterator[Sample]:
    """Every sample of the exposition (counters keep their ``_total`` sample name).

    A malformed line (an HTML error page, a bad value) ends the reading with what came
    before it, as ``balancer.scrape`` does, so a broken endpoint reads as missing metrics.
    """
    try:
        for family in text_string_to_metric_families(text):
            yield from family.samples
    except ValueError:
        return


def totals(text: str) -> dict[str, float]:
    """Sample name → value summed over its label sets."""
    out: dict[str, float] = {}
    for s in samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def values(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples called ``name`` whose labels include ``labels``."""
    return [
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def labels_of(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of the samples called ``name`` (an info gauge's payload)."""
    return [s.labels for s in samples(text) if s.name == name]
