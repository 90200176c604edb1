"""Reading Prometheus text exposition, through prometheus_client's parser only.

One parser for the harness, the real-vLLM runner and the tests, so escaping, label
quoting and counter suffixes are read the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created", "_info")


def samples(text: str, family: str | None = None) -> Iterator[Sample]:
    """Every sample of the exposition (counters keep their ``_total`` sample name).

    A malformed line (an HTML error page, a bad value) ends the reading with what came
    before it, as ``balancer.scrape`` does, so a broken endpoint reads as missing metrics.
    With ``family`` (a sample name), only the lines of that family reach the parser
    (samples and its HELP/TYPE), so a large exposition costs a line scan, not a parse.
    """
    if family is not None:
        text = "\n".join(_lines_of(text, family))
    try:
        for parsed in text_string_to_metric_families(text):
            yield from parsed.samples
    except ValueError:
        return


def _lines_of(text: str, name: str) -> Iterator[str]:
    base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
    for line in text.splitlines():
        if line.startswith(base) or (line.startswith("#") and base in line):
            yield line


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
        for s in samples(text, name)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def labels_of(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of the samples called ``name`` (an info gauge's payload)."""
    return [s.labels for s in samples(text, name) if s.name == name]


def histogram_quantile(text: str, name: str, q: float, **labels: str) -> float | None:
    """The ``q`` quantile of histogram ``name`` (its ``_bucket`` samples whose labels include
    ``labels``, summed per bound), interpolated within a bucket as Prometheus does; None
    without observations. Past the last finite bound it is that bound."""
    counts: dict[float, float] = {}
    for s in samples(text, name + "_bucket"):
        if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
            bound = float(s.labels["le"])
            counts[bound] = counts.get(bound, 0.0) + s.value
    bounds = sorted(counts)
    if not bounds or counts[bounds[-1]] <= 0:
        return None
    rank = q * counts[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            if bound == float("inf"):
                return lower
            share = (rank - below) / (counts[bound] - below) if counts[bound] > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, counts[bound]
    return lower
