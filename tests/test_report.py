"""report.json -> report.md + plots without models, and each doctor rule on crafted numbers."""
import json

import pytest

from distill import report as rpt
from distill.doctor import diagnose


def row(**kw):
    """A healthy speculative row; tests change one number at a time."""
    base = dict(
        name="best", kind="model", draft="runs/r/distill/best", eval_set="mt_bench", temperature=0.0, top_p=1.0,
        gamma=4, batch_size=1, acceptance_rate=0.8, draft_acceptance_ratio=0.7, tokens_per_target_call=3.4,
        teacher_forced_acceptance=0.78, cost_ratio=0.1, tokens_per_s=50.0, speedup=2.2, speedup_spread=[2.1, 2.3],
        predicted_speedup=2.4, per_position_acceptance=[0.8, 0.8, 0.8, 0.8], greedy_identical=True,
        float_ties=[], greedy_mismatches=[], error=None, wall_time_s=1.0, draft_time_s=0.2, target_time_s=0.7,
        prefill_time_s=0.05, verify_call_s=0.012, target_step_s=0.01,
        by_category={"writing": {"acceptance_rate": 0.9}, "math": {"acceptance_rate": 0.7}},
        accepted_length_histogram=[2, 3, 4, 5, 10],
    )
    return {**base, **kw}


def rules(rows):
    return {f["rule"] for f in diagnose(rows)}


def test_healthy_numbers_raise_nothing():
    found = diagnose([row(), row(gamma=2, per_position_acceptance=[0.8, 0.85])])
    assert [f["rule"] for f in found] == ["recommendation"]  # advice on what to ship, no problem
    assert "ship best at γ = 4: mean speedup 2.20×" in found[0]["message"]


def test_draft_too_slow():
    assert "draft_too_slow" in rules([row(speedup=0.9, cost_ratio=0.3)])
    assert "draft_too_slow" not in rules([row(speedup=0.9, cost_ratio=0.1)])
    assert "draft_too_slow" not in rules([row(speedup=1.2, cost_ratio=0.5, predicted_speedup=1.3)])
    (f,) = [f for f in diagnose([row(speedup=0.9, cost_ratio=0.3)]) if f["rule"] == "draft_too_slow"]
    assert "smaller draft" in f["message"] and f["severity"] == "warning"


def test_low_acceptance():
    (f,) = [f for f in diagnose([row(acceptance_rate=0.3)]) if f["rule"] == "low_acceptance"]
    assert "distill longer" in f["message"] and "loss=" in f["message"] and "family" in f["message"]
    assert "low_acceptance" not in rules([row(acceptance_rate=0.5)])


def test_decoder_overhead_says_where_time_goes():
    (f,) = [f for f in diagnose([row(speedup=1.5, predicted_speedup=2.4)]) if f["rule"] == "decoder_overhead"]
    assert "draft 20%" in f["message"] and "target 70%" in f["message"] and "prefill 5%" in f["message"]
    assert "1.20×" in f["message"]  # verify call vs one target step
    assert "decoder_overhead" not in rules([row(speedup=2.0, predicted_speedup=2.4)])  # 83% of predicted


def test_acceptance_falling_with_position_suggests_lower_gamma():
    (f,) = [f for f in diagnose([row(per_position_acceptance=[0.9, 0.8, 0.6, 0.5])])
            if f["rule"] == "acceptance_falls_with_position"]
    assert "evaluate.gammas=[2]" in f["message"]
    assert "acceptance_falls_with_position" not in rules([row(per_position_acceptance=[0.8, 0.85, 0.8, 0.82])])
    assert "acceptance_falls_with_position" not in rules([row(per_position_acceptance=[0.5, 0.7, 0.9, 0.95])])
    # deep positions tried only a few times are noise, not evidence
    noisy = row(per_position_acceptance=[0.9, 0.85, 0.2, 0.0], counters={"tried_at": [100, 80, 5, 2]})
    assert "acceptance_falls_with_position" not in rules([noisy])


def test_temperature_effect():
    greedy, sampled = row(acceptance_rate=0.8), row(temperature=1.0, acceptance_rate=0.5, greedy_identical=None)
    (f,) = [f for f in diagnose([greedy, sampled]) if f["rule"] == "temperature_effect"]
    assert "0.50 sampled vs 0.80 greedy" in f["message"]
    assert "temperature_effect" not in rules([greedy, {**sampled, "acceptance_rate": 0.75}])
    assert "temperature_effect" not in rules([greedy, {**sampled, "gamma": 2}])  # different γ: not comparable


def test_greedy_mismatch_float_tie_and_broken_draft():
    bad = row(greedy_identical=False, greedy_mismatches=[{"prompt_id": "p1", "position": 3, "gap": 2.5,
                                                           "expected": 7, "got": 8}])
    tie = row(float_ties=[{"prompt_id": "p2", "position": 9, "gap": 3e-5, "expected": 1, "got": 2}])
    broken = {"name": "checkpoint-5", "kind": "model", "draft": "x", "error": "OSError: bad file"}
    found = {f["rule"]: f for f in diagnose([bad, tie, broken])}
    assert found["greedy_mismatch"]["severity"] == "error" and "p1" in found["greedy_mismatch"]["message"]
    assert found["float_tie"]["severity"] == "info" and "3e-05" in found["float_tie"]["message"]
    assert found["broken_draft"]["severity"] == "error"
    assert [f["severity"] for f in diagnose([tie, bad, broken])][:2] == ["error", "error"]  # errors first


def test_one_finding_per_rule_and_draft_worst_shown():
    findings = diagnose([row(acceptance_rate=0.3), row(acceptance_rate=0.1, gamma=2)])
    (f,) = [f for f in findings if f["rule"] == "low_acceptance"]
    assert f["count"] == 2 and "α = 0.10" in f["message"] and "γ=2" in f["setting"]


def crafted_report():
    rows = [
        row(name="target", kind="target", draft=None, gamma=0, acceptance_rate=None, speedup=1.0,
            speedup_spread=[0.98, 1.02], predicted_speedup=None, per_position_acceptance=[], greedy_identical=None,
            by_category={}, accepted_length_histogram=[]),
        row(gamma=2, speedup=1.8, per_position_acceptance=[0.8, 0.8], accepted_length_histogram=[2, 3, 9]),
        row(),
        row(eval_set="humaneval", by_category={"humaneval": {"acceptance_rate": 0.85}}),
        row(name="init", acceptance_rate=0.3, speedup=0.9, by_category={"writing": {"acceptance_rate": 0.2}}),
        row(name="prompt_lookup", kind="prompt_lookup", draft=None, acceptance_rate=0.2, cost_ratio=0.01,
            teacher_forced_acceptance=None, speedup=1.1, predicted_speedup=1.2),
        {"name": "hf_assisted", "kind": "hf_assisted", "draft": "runs/r/distill/best", "eval_set": "mt_bench",
         "temperature": 0.0, "top_p": 1.0, "gamma": 4, "batch_size": 1, "tokens_per_s": 30.0, "speedup": 1.4,
         "speedup_spread": [1.3, 1.5], "greedy_identical": None, "error": None},
        {"name": "checkpoint-5", "kind": "model", "draft": "runs/r/distill/checkpoint-5", "error": "OSError: bad"},
    ]
    return {
        "target": "tiny", "run_name": "r",
        "settings": {"device": "cpu", "dtype": "float32", "max_new_tokens": 64, "repeats": 3, "warmup": 1,
                     "temperatures": [0.0], "batch_sizes": [1], "gammas": [2, 4],
                     "eval_sets": {"mt_bench": {"prompts": 8}, "humaneval": {"prompts": 4}}},
        "definitions": rpt.DEFINITIONS, "rows": rows, "greedy_identical": True,
        "best": {"name": "best", "draft": "runs/r/distill/best", "gamma": 4, "temperature": 0.0, "top_p": 1.0,
                 "batch_size": 1, "eval_sets": ["mt_bench", "humaneval"], "speedup": 2.2, "acceptance_rate": 0.8,
                 "teacher_forced_acceptance": 0.78, "tokens_per_target_call": 3.4, "cost_ratio": 0.1,
                 "predicted_speedup": 2.4, "init_speedup": 0.9, "prompt_lookup_speedup": 1.1,
                 "hf_assisted_speedup": 1.4},
        "doctor": diagnose(rows),
    }


def test_render_writes_markdown_and_nonempty_plots(tmp_path):
    paths = rpt.render(crafted_report(), tmp_path)
    for name in rpt.PLOTS:
        data = (tmp_path / "plots" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    md = (tmp_path / "report.md").read_text()
    assert paths["report.md"] == str(tmp_path / "report.md")
    assert "**Best draft: `best`**" in md and "2.20× measured on the timed prompts" in md and "transformers assisted generation" in md
    flat = " ".join(md.split())  # tables are padded to align
    assert "| draft | mt_bench/writing | mt_bench/math | humaneval |" in flat
    assert "| init | 0.20 | – | – |" in flat
    assert "Not evaluated" in md and "checkpoint-5" in md and "low_acceptance" in md
    for name in rpt.PLOTS:
        assert f"plots/{name}.png" in md


def test_render_with_reference_rows_only(tmp_path):
    rep = crafted_report()
    rep["rows"], rep["best"], rep["doctor"] = rep["rows"][:1], None, []
    rpt.render(rep, tmp_path)
    assert all((tmp_path / "plots" / f"{n}.png").stat().st_size > 0 for n in rpt.PLOTS)
    assert "No draft was evaluated" in (tmp_path / "report.md").read_text()


def test_cli_rerenders_a_report(tmp_path, capsys):
    path = tmp_path / "evaluate" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(crafted_report()))
    rpt.main([str(path)])
    out = capsys.readouterr().out
    assert (path.parent / "report.md").is_file() and "speedup [95% CI]" in out and "Best draft: best" in out
    with pytest.raises(SystemExit) as exc:
        rpt.main([str(tmp_path / "missing.json")])
    assert exc.value.code == 2


def test_summary_shows_greedy_failure(capsys):
    rep = crafted_report()
    rep["greedy_identical"] = False
    rpt.print_summary(rep)
    assert "GREEDY MISMATCH" in capsys.readouterr().out


def test_noise_rules_flag_speedups_the_measurement_cannot_support():
    from distill.doctor import noise_flags

    ok = {"repeats": 3, "warmup": 1}
    clean = row(speedup=1.3, speedup_ci=[1.2, 1.4], modeled_speedup=1.25, modeled_speedup_ci=[1.1, 1.4],
                modeled_speedup_timed=1.28, tokens_per_target_call=1.6)
    assert noise_flags(clean, ok) == {}
    assert set(noise_flags({**clean, "speedup_ci": [0.9, 1.4]}, ok)) == {"speedup"}
    assert set(noise_flags({**clean, "modeled_speedup_ci": [0.95, 1.3]}, ok)) == {"modeled_speedup"}
    assert "1.2 × the modeled" in noise_flags({**clean, "speedup": 1.6, "speedup_ci": [1.5, 1.7]}, ok)["speedup"]
    no_acc = noise_flags({**clean, "tokens_per_target_call": 1.0}, ok)
    assert set(no_acc) == {"speedup", "modeled_speedup"} and "nothing was accepted" in no_acc["speedup"]
    short = noise_flags(clean, {"repeats": 1, "warmup": 0})
    assert set(short) == {"speedup", "modeled_speedup"} and "evaluate.repeats" in short["speedup"]
    assert noise_flags(row(name="target", kind="target", speedup=1.0, speedup_ci=[1.0, 1.0]), ok) == {}
    # a speedup measured (or a sampled row decoded) on one prompt has no interval over prompts
    one = noise_flags({**clean, "timed_prompts": 1, "prompts": 48, "scored_by": "replay", "speedup_ci": None}, ok)
    assert set(one) == {"speedup"} and "from 1 prompt(s)" in one["speedup"]
    sampled = {**clean, "scored_by": "decoding", "timed_prompts": 0, "decoded_prompts": 1, "modeled_speedup_ci": None}
    assert "modeled_speedup" in noise_flags(sampled, ok)
    # the doctor reports each flagged number as noise
    assert "noise" in rules([{**clean, "flagged": noise_flags({**clean, "speedup_ci": [0.9, 1.4]}, ok)}])


def test_headline_never_shows_a_flagged_number():
    report = crafted_report()
    flagged = {"speedup": "its 95% interval [0.93, 3.10] includes 1"}
    report["best"] = {**report["best"], "speedup": 2.2, "flagged": flagged}
    text = rpt.headline(report)
    assert "2.20" not in text and "no speedup over the target alone that the measurement can support" in text
    assert "prompt lookup" not in text  # no comparison against a number that is not shown
    report["best"]["modeled_speedup"] = 1.37
    text = rpt.headline(report)
    assert "1.37× modeled speedup" in text and "2.20" not in text
    cells = rpt.table_rows({**report, "rows": [row(speedup=2.2, flagged=flagged, modeled_speedup=1.37)]})
    assert cells[0][rpt.COLUMNS.index("speedup [95% CI]")] == "n.s."
    assert cells[0][rpt.COLUMNS.index("modeled [95% CI]")] == "1.37×"


def test_the_doctor_recommends_the_fastest_unflagged_drafter():
    from distill.doctor import recommend

    def r(name, kind, es, v, **kw):
        return row(name=name, kind=kind, eval_set=es, modeled_speedup=v, **kw)

    rows = [r("best", "model", "a", 1.2), r("best", "model", "b", 1.1),
            r("prompt_lookup", "prompt_lookup", "a", 1.05), r("prompt_lookup", "prompt_lookup", "b", 1.4),
            r("hybrid", "hybrid", "a", 1.25), r("hybrid", "hybrid", "b", 1.45),
            r("fast", "model", "a", 3.0, flagged={"modeled_speedup": "noise"}), r("fast", "model", "b", 3.0)]
    ship = recommend(rows)
    assert ship["draft"] == "hybrid" and "ship hybrid at γ = 4: mean speedup 1.35×" in ship["message"]
    assert "fast" not in ship["message"]  # a flagged number never wins, and a set without one does not count
    assert "recommendation" in rules(rows)
    slow = recommend([r("best", "model", "a", 0.8)])
    assert slow["draft"] == "best" and "nothing measured here beats the target alone" in slow["message"]
