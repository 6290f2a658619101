"""Reading `mtcfs metrics` output and `/metrics` scrapes back: prometheus-client's parser,
not string compares."""

from __future__ import annotations

import urllib.request

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


#: name -> {sorted (label, value) pairs -> value}, every sample of a scrape
Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(address: str) -> tuple[Series, dict[str, str]]:
    """GET ``http://ADDRESS/metrics`` with a real HTTP client; return (every sample by name,
    including a histogram's ``_bucket``/``_sum``/``_count``; the type of each family)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: Series = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out, types


def only(series: Series, name: str, **labels: object) -> float:
    """The value of the one sample ``name`` whose labels include ``labels`` (fails if there
    is none or more than one)."""
    want = {(k, str(v)) for k, v in labels.items()}
    hits = [v for lab, v in series.get(name, {}).items() if want <= set(lab)]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples in {series.get(name)}"
    return hits[0]
