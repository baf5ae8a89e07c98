"""What `pat run` reports from a run folder: batch traces from the polled timeline, adaptive against fixed TP like
for like, the table, and the plots."""

import json
from pathlib import Path

import matplotlib
import pytest

from pat_operator.api import load_job
from pat_workers import report

ROOT = Path(__file__).parents[2]

matplotlib.use("Agg")


def poll(time, batch, done, layout, *requests, attempt=0, pod=0):
    groups = [{"ranks": [], "tp": tp, "running": n, "waiting": 0} for tp, n in zip(layout, requests)]
    return {"time": time, "attempt": attempt, "pod": pod, "batch_id": batch, "batch_done": done,
            "layout": list(layout), "groups": groups}


def test_batch_traces_run_from_the_first_poll_to_the_done_one():
    timeline = [
        poll(9.0, None, True, (1, 1), 0, 0),
        poll(10.0, "iter-1", False, (1, 1), 32, 32),
        poll(10.1, "iter-1", False, (1, 1), 3, 1),
        poll(10.2, "iter-1", False, (2,), 2),  # merged in the tail
        poll(10.5, "iter-1", True, (2,), 0),
        poll(10.6, "iter-1", True, (2,), 0),  # idle until the next batch: not part of it
        poll(11.0, "iter-2", False, (1, 1), 10, 12),
        # a restart: iter-2 runs again; the trace is the last attempt's
        poll(20.0, "iter-2", True, (1, 1), 0, 0, attempt=1),  # done as seen by the new attempt: not a start
        poll(21.0, "iter-2", False, (1, 1), 30, 30, attempt=1),
        poll(21.4, "iter-2", True, (1, 1), 0, 0, attempt=1),
    ]
    traces = report.batch_traces(timeline)
    assert list(traces) == ["iter-1", "iter-2"]
    assert traces["iter-1"][0] == [(0.0, 64, (1, 1)), (pytest.approx(0.1), 4, (1, 1)), (pytest.approx(0.2), 2, (2,)),
                                   (pytest.approx(0.5), 0, (2,))]
    assert traces["iter-2"][0] == [(0.0, 60, (1, 1)), (pytest.approx(0.4), 0, (1, 1))]


def write_run(path, generate, lengths):
    """A run folder: metrics rows with generation seconds, and rollouts of responses with these lengths."""
    (path / "rollouts").mkdir(parents=True)
    rows = [{"iteration": i, "seconds": {"generate": s}} for i, s in enumerate(generate, 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i, (token, per_response) in enumerate(lengths, 1):
        rollouts = [{"id": f"0.{g}", "tokens": [token] * n} for g, n in enumerate(per_response)]
        (path / "rollouts" / f"iter-{i:04d}.json").write_text(json.dumps(rollouts))


def test_compare_is_like_for_like_over_the_iterations_of_the_same_lengths(tmp_path):
    # Iteration 1: identical; 2: other tokens, same lengths (the same work); 3: other lengths.
    write_run(tmp_path / "adaptive", [1.0, 2.0, 4.0], [(5, [3, 9]), (5, [3, 9]), (5, [3, 9])])
    write_run(tmp_path / "fixed", [2.0, 3.0, 1.0], [(5, [3, 9]), (6, [3, 9]), (5, [3, 8])])
    c = report.compare(tmp_path / "adaptive", tmp_path / "fixed")
    assert c["like_for_like_iterations"] == [1, 2]
    assert c["generate_seconds_like_for_like_adaptive"] == 3.0 and c["generate_seconds_like_for_like_fixed"] == 5.0
    assert c["generate_ratio_like_for_like"] == pytest.approx(0.6)
    assert (c["generate_seconds_adaptive"], c["generate_seconds_fixed"]) == (7.0, 6.0)
    assert (c["responses_compared"], c["responses_differing"], c["identical_tokens"]) == (6, 3, False)


ROWS = [{"iteration": i, "seconds": {"generate": 1.0 + i, "train": 2.0}, "regroups": 1, "reward_mean": 0.1 * i,
         "score_mean": 0.1 * i, "response_tokens_mean": 12.0, "tokens_per_second": 100.0} for i in (1, 2)]


def test_the_table_puts_the_fixed_runs_generation_beside():
    fixed = {1: [{**r, "seconds": {"generate": 5.0 + r["iteration"]}} for r in ROWS],
             2: [{**r, "seconds": {"generate": 4.0 + r["iteration"]}} for r in ROWS[:1]]}
    head, _, first, second = report.table(ROWS, fixed).splitlines()
    assert head.split()[:6] == ["iter", "generate", "fixed", "TP1", "fixed", "TP2"]
    assert first.split()[:4] == ["1", "2.00", "6.00", "5.00"] and second.split()[:4] == ["2", "3.00", "7.00", "nan"]
    assert report.table(ROWS).splitlines()[0].split()[:3] == ["iter", "generate", "reward"]


def test_the_best_fixed_layout_generated_fastest_over_the_iterations_all_fixed_runs_completed():
    rows = lambda *seconds: [{"iteration": i, "seconds": {"generate": g}} for i, g in enumerate(seconds, 1)]  # noqa
    assert report.best_fixed({1: rows(3.0, 3.0), 2: rows(2.0, 2.5)}) == 2
    assert report.best_fixed({1: rows(3.0, 3.0, 1.0), 2: rows(2.0, 4.5)}) == 1  # iteration 3 only in one
    assert report.best_fixed({1: rows(2.0), 2: rows(2.0)}) == 1 and report.best_fixed({}) is None


def test_the_summary_shows_adaptive_against_fixed_tp1_and_the_best_fixed_layout(tmp_path, capsys):
    """Three run folders as `pat run --baseline` leaves them: adaptive, fixed TP=1 (slower) and fixed TP=2 (faster
    than TP=1, slower than adaptive); the same lengths in all."""
    same = [(5, [3, 9]), (5, [3, 9])]
    write_run(tmp_path / "run", [1.0, 2.0], same)
    write_run(tmp_path / "run" / "fixed-tp1", [3.0, 4.0], same)
    write_run(tmp_path / "run" / "fixed-tp2", [2.0, 2.0], [(6, [3, 9]), (5, [3, 9])])  # other tokens, same work
    for run in (tmp_path / "run", tmp_path / "run" / "fixed-tp1", tmp_path / "run" / "fixed-tp2"):
        rows = [{**r, **ROWS[0], "iteration": r["iteration"], "seconds": r["seconds"]}
                for r in report.read_jsonl(run / "metrics.jsonl")]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = load_job(ROOT / "examples" / "local.yaml")
    outcome = {"seconds": 30.0, "restarts": []}
    turns = [["job", "fixed-tp1", "fixed-tp2"], ["fixed-tp1", "fixed-tp2", "job"]]
    path = report.write(tmp_path / "run", job, outcome, {2: (tmp_path / "run" / "fixed-tp2", outcome),
                                                         1: (tmp_path / "run" / "fixed-tp1", outcome)}, turns)
    summary = json.loads(path.read_text())
    assert summary["best_fixed_tp"] == 2 and summary["turns"] == turns
    assert {tp: f["generate_seconds"] for tp, f in summary["fixed_layouts"].items()} == {"1": 7.0, "2": 4.0}
    tp1, best = summary["adaptive_vs_fixed_tp1"], summary["adaptive_vs_best_fixed"]
    assert (tp1["fixed_tp"], tp1["generate_seconds_fixed"], tp1["identical_tokens"]) == (1, 7.0, True)
    assert (best["fixed_tp"], best["generate_ratio_like_for_like"], best["responses_differing"]) == (2, 0.75, 2)
    assert "adaptive_vs_fixed" not in summary
    out = capsys.readouterr().out
    assert "generation, adaptive vs fixed TP=1: 3.00 s vs 7.00 s in all" in out
    assert "generation, adaptive vs the best fixed layout (TP=2): 3.00 s vs 4.00 s in all" in out
    assert "fixed layouts, generation: TP=1 7.00 s, TP=2 4.00 s; the best fixed layout is TP=2" in out


def test_groups_label_counts_groups_by_tp_size():
    assert report.groups_label((1, 1)) == "2 x TP=1"
    assert report.groups_label((2, 1, 1)) == "1 x TP=2 + 2 x TP=1"


def test_the_plots_show_whole_requests_and_keep_legends_off_the_data(tmp_path):
    timeline = [poll(10.0 + 0.1 * k, f"iter-{b}", n == 0, (1, 1) if n > 2 else (2,), *([n // 2, n - n // 2]
                                                                                        if n > 2 else [n]))
                for b in (1, 2) for k, n in enumerate((64, 9, 3, 1, 0))]
    fixed = {1: (ROWS, timeline), 2: (ROWS, timeline)}
    written = report.plots(tmp_path, ROWS, timeline, fixed)
    assert written == [str(tmp_path / "timeline.png"), str(tmp_path / "iterations.png")]
    assert all((tmp_path / name).stat().st_size > 10_000 for name in ("timeline.png", "iterations.png"))
    import matplotlib.pyplot as plt

    traces = report.batch_traces(timeline)
    fig = report.timeline_figure(plt, traces, {1: traces, 2: traces}, ROWS, {1: ROWS, 2: ROWS})
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2 and all(ax.get_legend() is None for ax in panels) and len(fig.legends) == 1
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["1", "2", "4", "8", "16", "32", "64"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["adaptive TP: 2 x TP=1", "adaptive TP: 1 x TP=2",
                                                                  "fixed TP=1", "fixed TP=2"]
    assert panels[0].get_title() == "iter-1: 2.00 s (fixed TP1 2.00, TP2 2.00)"
    plt.close(fig)


def test_learning_tells_a_trend_from_noise():
    """The scores (rounded) of an e2e run whose last quarter beat the first by only 2.9 of their standard errors: its
    trend over all 20 iterations is 4.7 standard errors. The same scores in a shuffled order (the negative control)
    show no trend, with the same values."""
    scores = [0.03, 0.05, 0.11, 0.15, 0.12, 0.14, 0.2, 0.17, 0.18, 0.14, 0.17, 0.27, 0.17, 0.18, 0.16, 0.2, 0.2, 0.3,
              0.35, 0.65]
    rising = report.learning([{"score_mean": s} for s in scores], "score_mean")
    assert rising["iterations_compared"] == 5 and rising["z"] == pytest.approx(2.89, abs=0.01)
    assert rising["slope"] == pytest.approx(0.0162, abs=1e-4) and rising["trend_t"] == pytest.approx(4.67, abs=0.01)
    shuffled = [scores[i] for i in (7, 19, 2, 12, 0, 15, 9, 4, 17, 11, 1, 14, 6, 18, 3, 10, 16, 5, 13, 8)]
    flat = report.learning([{"score_mean": s} for s in shuffled], "score_mean")
    assert abs(flat["trend_t"]) < 1.5, flat
    assert report.learning([{"score_mean": 0.1}] * 3, "score_mean")["iterations_compared"] == 0  # too few


def test_rollout_mismatch_averages_the_means_and_keeps_the_largest_delta():
    rows = [{"logprob_diff_mean": 0.1, "logprob_diff_max": 0.5, "logprob_kl": 0.01},
            {"logprob_diff_mean": 0.3, "logprob_diff_max": 2.0, "logprob_kl": 0.03}]
    m = report.rollout_mismatch(rows)
    assert m == pytest.approx({"logprob_diff_mean": 0.2, "logprob_diff_max": 2.0, "logprob_kl": 0.02})
    assert report.rollout_mismatch([{"iteration": 1}]) is None  # a run from before the measurements
