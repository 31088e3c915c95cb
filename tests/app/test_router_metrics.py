"""The router's Prometheus histogram: cumulative counts, quantiles and its round trip through the text format."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hurray_vllm.app.router.metrics import PAUSE_BUCKETS_S, RELAY_BUCKETS_S, Histogram

values = st.lists(st.floats(min_value=0.0, max_value=60.0, allow_nan=False), max_size=60)


@given(values, st.sampled_from([RELAY_BUCKETS_S, PAUSE_BUCKETS_S]))
def test_each_bucket_counts_what_is_at_most_its_edge(xs: list[float], buckets: tuple[float, ...]) -> None:
    h = Histogram(buckets)
    for x in xs:
        h.observe(x)
    assert h.counts == [sum(x <= edge for x in xs) for edge in h.buckets]
    assert h.count == len(xs)
    again = Histogram.from_cumulative(buckets, h.counts, h.count)
    assert again.counts == h.counts and again.count == h.count
    assert again.quantile(0.5) == h.quantile(0.5)


def test_an_edge_belongs_to_its_bucket_and_lines_are_prometheus_text() -> None:
    h = Histogram((0.1, 1.0))
    for x in (0.1, 0.5, 1.0, 2.0):
        h.observe(x)
    assert list(h.lines("x")) == [
        'x_bucket{le="0.1"} 1',
        'x_bucket{le="1.0"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 3.600000",
        "x_count 4",
    ]
    assert h.quantile(0.5) == 0.1 + (1.0 - 0.1) * (2 - 1) / 2
    assert Histogram((0.1,)).quantile(0.5) is None
    nan = Histogram((0.1, 1.0))
    nan.observe(float("nan"))
    assert nan.counts == [0, 0] and nan.count == 1
