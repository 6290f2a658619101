"""Reading `mtcfs metrics` output back: prometheus-client's parser, not string compares."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def value(text: str, name: str, **labels: object) -> float | None:
    """Return the value of the first sample ``name`` whose labels include ``labels`` (values
    compared as strings), or None if there is none."""
    want = {k: str(v) for k, v in labels.items()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and want.items() <= s.labels.items():
                return s.value
    return None
