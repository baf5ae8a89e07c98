"""The operator's reading of Prometheus answers (pure): layouts, requests, staleness, and the planner's decision."""

import pytest

from pat_operator import metric_names as names
from pat_operator.autoscaler import decide
from pat_operator.prometheus import pod_metrics, selectors

NOW = 1_000_000.0


def sample(name, value, pod="job-generator-0", **labels):
    return {"metric": {"__name__": name, "namespace": "ns", "pod": pod, **labels}, "value": [NOW, str(value)]}


def pod_series(pod="job-generator-0", running=(1, 1), generated=(300, 300), batch_open=1):
    """Two TP=1 groups, one request each decoding (the tail), a profile in which TP=2 is almost twice as fast."""
    out = [sample(names.GENERATOR_LAYOUT_EPOCH, 3, pod), sample(names.GENERATOR_BATCH_OPEN, batch_open, pod),
           sample(names.GENERATOR_BATCH_MAX_TOKENS, 512, pod), sample(names.GENERATOR_BATCHES + "_total", 2, pod),
           sample(names.GENERATOR_REGROUP_COST, 0.005, pod, term="fixed_seconds"),
           sample(names.GENERATOR_PROFILE_CONTEXT, 64, pod),
           sample(names.GENERATOR_REGROUP_COST, 1e-6, pod, term="kv_seconds_per_token")]
    for g, n, gen in zip(("0-0", "1-1"), running, generated):
        out += [sample(names.GENERATOR_TP_SIZE, 1, pod, group=g), sample(names.GENERATOR_REQUESTS_RUNNING, n, pod, group=g),
                sample(names.GENERATOR_REQUESTS_WAITING, 0, pod, group=g),
                sample(names.GENERATOR_RUNNING_CONTEXT_TOKENS, n * (gen + 16), pod, group=g),
                sample(names.GENERATOR_RUNNING_GENERATED_TOKENS, n * gen, pod, group=g)]
    for tp, seconds in ((1, 0.02), (2, 0.011)):
        out += [sample(names.GENERATOR_PROFILE_STEP_SECONDS, seconds, pod, tp=str(tp), batch=str(b)) for b in (1, 8)]
        out.append(sample(names.GENERATOR_PROFILE_KV_SECONDS, 2e-6 / tp, pod, tp=str(tp)))
        out += [sample(names.GENERATOR_PREFILL_COST, 0.01, pod, tp=str(tp), term="seconds"),
                sample(names.GENERATOR_PREFILL_COST, 1e-4, pod, tp=str(tp), term="seconds_per_token")]
    for le, count in (("64", 10), ("128", 30), ("512", 32), ("+Inf", 32)):  # 10 <= 64, 20 in (64, 128], 2 long
        out.append(sample(names.GENERATOR_RESPONSE_TOKENS + "_bucket", count, pod, le=le))
    return out


def scraped(pod="job-generator-0", age=0.5):
    """The age query's answer: seconds since the pod's last scrape, as Prometheus computes them."""
    return [{"metric": {"namespace": "ns", "pod": pod}, "value": [NOW, str(age)]}]


def test_metrics_become_the_planners_inputs():
    found, skipped = pod_metrics(pod_series(running=(2, 1)), scraped(), max_age=5)
    assert not skipped
    m = found["job-generator-0"]
    assert m.layout == (1, 1) and m.epoch == 3 and m.batch_open and m.max_tokens == 512
    assert m.running == {(0,): [(316, 300), (316, 300)], (1,): [(316, 300)]}  # per-group means
    assert sorted(set(m.lengths)) == [64, 128, 512] and len(m.lengths) == 32
    assert m.profile.step_seconds(2, 1) == pytest.approx(0.011)
    assert m.profile.step_seconds(2, 1, context=64 + 1000) == pytest.approx(0.011 + 1e-3)  # the KV term
    assert m.costs.request_seconds(2, 100) == pytest.approx(1e-4)  # KV moves (1e-4 s) beat a re-prefill


def test_the_tail_merges_and_nothing_happens_without_an_open_batch():
    found, _ = pod_metrics(pod_series(), scraped(), max_age=5)
    decision = decide(found["job-generator-0"], [1, 2], margin=0.1)
    assert decision.layout == (2,), decision.reason
    found, _ = pod_metrics(pod_series(batch_open=0), scraped(), max_age=5)
    assert decide(found["job-generator-0"], [1, 2], margin=0.1).layout is None
    # Negative control: with TP=2 not allowed the same tail stays.
    found, _ = pod_metrics(pod_series(), scraped(), max_age=5)
    assert decide(found["job-generator-0"], [1], margin=0.1).layout is None


def test_stale_and_incomplete_pods_are_left_out_with_the_reason():
    series = pod_series() + pod_series("job-generator-1")
    found, skipped = pod_metrics(series, scraped() + scraped("job-generator-1", age=30), max_age=5)
    assert list(found) == ["job-generator-0"]
    assert skipped == {"job-generator-1": "stale: no scrape in the last 5 s"}
    found, skipped = pod_metrics(pod_series(), [], max_age=5)
    assert not found and "stale" in skipped["job-generator-0"]
    broken = [s for s in pod_series() if s["metric"]["__name__"] != names.GENERATOR_REGROUP_COST]
    found, skipped = pod_metrics(broken, scraped(), max_age=5)
    assert not found and "incomplete metrics" in skipped["job-generator-0"]


def test_selectors_name_the_pods_and_every_input():
    data, times = selectors("ns", ["b", "a"])
    assert 'namespace="ns",pod=~"a|b"' in data and names.GENERATOR_PROFILE_STEP_SECONDS in data
    assert times.startswith(f"time() - timestamp({names.GENERATOR_LAYOUT_EPOCH}{{")  # ages by Prometheus' clock


def test_selectors_match_a_dotted_pod_name_literally():
    data, _ = selectors("ns", ["job.v2-generator-0"])
    assert 'pod=~"job\\\\.v2-generator-0"' in data  # PromQL unquotes \\. to the regex \. (a literal dot)
