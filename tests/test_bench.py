"""``hf2q bench``: runs end to end on a tiny pair in seconds; its JSON has the documented keys with
sane values; bad options fail with one line naming the fix before anything is loaded."""

from __future__ import annotations

import json

import pytest

from hf2q.cli.app import main
from hf2q.runtime.bench import BenchConfig, make_prompts, parse_slots

ROW_KEYS = {
    "slots",
    "mode",
    "tokens_per_s",
    "tokens_per_s_min",
    "tokens_per_s_max",
    "per_slot_tokens_per_s",
    "prefill_tokens_per_s",
    "tau",
    "tau_per_slot",
    "accepted_histogram_per_slot",
    "acceptance_rate",
    "round_ms",
    "round_ms_min",
    "round_ms_max",
    "draft_ms",
    "verify_ms",
    "rollback_ms",
    "E",
    "speedup_vs_plain",
    "scaling_vs_1_slot",
    "peak_memory_gb",
    "rounds",
    "busy_rows",
    "lookup_share",
    "generation_tokens",
    "block_size",
    "matches_plain",
    "trials",
}


def _json_line(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_bench_runs_end_to_end_and_reports_documented_json(fitted_pairs, tmp_path, capsys):
    target, draft = fitted_pairs["qwen35"]
    out_file = tmp_path / "bench.json"
    argv = ["bench", "-m", str(target), "-d", str(draft), "--slots", "2,1", "--gen-tokens", "12"]
    argv += [
        "--trials",
        "2",
        "--warmup",
        "0",
        "--block-size",
        "8",
        "--no-chat",
        "--dtype",
        "float32",
    ]
    code = main([*argv, "--json", "--out", str(out_file)])
    assert code == 0
    report = _json_line(capsys)
    assert json.loads(out_file.read_text()) == report
    assert report["config"]["slots"] == [1, 2] and report["config"]["block_size"] == 8
    assert report["config"]["lookup"] is True
    assert report["dtype"] == "float32" and report["model"] == str(target)
    assert report["platform"]["backend"] == "cpu"
    # How fast this host ran Python, before and after (host-bound rounds follow it).
    host = report["host"]
    assert host["python_loop_adds"] == 10**6
    assert 0 < host["python_loop_ms_before"] < 10_000 and 0 < host["python_loop_ms_after"] < 10_000
    rows = report["results"]
    assert [(r["slots"], r["mode"]) for r in rows] == [
        (n, m) for n in (1, 2) for m in ("plain", "dflash-seq", "dflash")
    ]
    for r in rows:
        assert set(r) == ROW_KEYS
        n = r["slots"]
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert len(r["per_slot_tokens_per_s"]) == n and all(
            x > 0 for x in r["per_slot_tokens_per_s"]
        )
        assert r["round_ms_min"] <= r["round_ms"] <= r["round_ms_max"] and r["round_ms"] > 0
        assert 0 < r["peak_memory_gb"] < 1
        assert r["trials"] == 2 and r["rounds"] >= 1
        assert n * 2 <= r["generation_tokens"] <= n * 12
        if r["mode"] == "plain":
            assert r["tau"] is None and r["E"] is None and r["matches_plain"] is None
            assert r["lookup_share"] is None
            # One step per token after the first, rows in lockstep.
            assert r["rounds"] >= (r["generation_tokens"] - n) / n
            # Each busy row commits one token per step.
            assert r["busy_rows"] == pytest.approx((r["generation_tokens"] - n) / r["rounds"], 0.01)
            continue
        # DFlash rows: lossless at T = 0 (float32), tau within 1..B, a histogram per slot.
        assert r["matches_plain"] == 1.0
        assert 0.0 <= r["lookup_share"] <= 1.0  # lookup on by default, as in hf2q generate
        assert 1.0 <= r["tau"] <= 8.0 and len(r["tau_per_slot"]) == n
        hists = r["accepted_histogram_per_slot"]
        assert len(hists) == n and all(len(h) == 8 for h in hists)
        row_rounds = sum(map(sum, hists))  # rounds each slot took part in
        if r["mode"] == "dflash-seq":
            assert row_rounds == r["rounds"] and r["busy_rows"] == 1.0
        else:
            assert r["rounds"] <= row_rounds <= n * r["rounds"]
            assert r["busy_rows"] == pytest.approx(row_rounds / r["rounds"], abs=0.005)
        assert r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["rollback_ms"] >= 0
        assert r["draft_ms"] + r["verify_ms"] + r["rollback_ms"] <= r["round_ms"] * 1.05
        assert r["E"] > 0 and r["speedup_vs_plain"] > 0
    by = {(r["slots"], r["mode"]): r for r in rows}
    assert by[(2, "dflash")]["scaling_vs_1_slot"] == pytest.approx(
        by[(2, "dflash")]["tokens_per_s"] / by[(1, "dflash")]["tokens_per_s"], rel=1e-2
    )
    # Same requests, same tokens: batched and sequential DFlash committed the same count.
    assert by[(2, "dflash")]["generation_tokens"] == by[(2, "dflash-seq")]["generation_tokens"]


def test_bench_random_workload_generates_every_token_and_renders_a_table(fitted_pairs, capsys):
    target, draft = fitted_pairs["qwen35"]
    argv = ["bench", "-m", str(target), "-d", str(draft), "--slots", "3", "--gen-tokens", "6"]
    argv += ["--trials", "1", "--warmup", "0", "--workload", "random", "--prompt-tokens", "5"]
    assert main([*argv, "--no-baseline"]) == 0
    text = capsys.readouterr().out
    table = [line.split() for line in text.split("generation tok/s")[0].splitlines()]
    assert [row[:2] for row in table[1:]] == [["3", "dflash"]]  # --no-baseline: DFlash only
    assert "generation tok/s by slot count" in text and "█" in text
    assert "host: 1,000,000 Python additions in" in text  # what host-bound rounds follow
    assert main([*argv, "--json"]) == 0
    rows = _json_line(capsys)["results"]
    # EOS is ignored: every request generates exactly --gen-tokens.
    assert all(r["generation_tokens"] == 3 * 6 for r in rows)
    assert {r["mode"] for r in rows} == {"plain", "dflash-seq", "dflash"}


def test_trials_alternate_between_slot_counts_after_every_warm_up(fitted_pairs):
    """The ratios a user reads (N slots over one, DFlash over plain) come from runs made side by
    side: every warm-up first, then trial k of every slot count and mode before trial k + 1, so
    a machine drifting during the run moves every row alike."""
    from hf2q.runtime.bench import run_bench
    from hf2q.runtime.pair import load_pair

    target, draft = fitted_pairs["qwen35"]
    pair = load_pair(str(target), str(draft))
    seen: list[str] = []
    config = BenchConfig(
        slots=(1, 2), gen_tokens=4, trials=2, warmup=1, workload="random", prompt_tokens=4
    )
    report = run_bench(pair.target, pair.drafter, config, progress=seen.append)
    modes = ("plain", "dflash-seq", "dflash")
    expected = [
        f"{n} slot{'s' if n > 1 else ''}, {m}, {what}"
        for what, n, m in (
            *(("warm-up", n, m) for n in (1, 2) for m in modes),
            *((f"trial {k}/2", n, m) for k in (1, 2) for n in (1, 2) for m in modes),
        )
    ]
    assert seen == expected
    assert [(r["slots"], r["mode"], r["trials"]) for r in report["results"]] == [
        (n, m, 2) for n in (1, 2) for m in modes
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slots", "0"], "--slots needs counts of at least 1"),
        (["--slots", "two"], "--slots takes a count or a comma-separated list"),
        (["--gen-tokens", "1"], "--gen-tokens must be at least 2"),
        (["--trials", "0"], "--trials must be at least 1"),
        (["--prompt-tokens", "9"], "--prompt-tokens applies to --workload random"),
        (["--workload", "chat"], "--workload must be one of prompts, random"),
        (["--idle", "sleep"], "--idle must be one of compact, keep"),
        (["--dtype", "int4"], "--dtype must be one of auto, native, float32, bfloat16, float16"),
        (["--out", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    ],
)
def test_bad_bench_options_fail_with_one_line_naming_the_fix(args, message, capsys):
    assert main(["bench", "-m", "/nowhere", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf2q: error:") and message in err and "\n" not in err


def test_bench_without_a_model_uses_the_demo_pair_or_says_how_to_pass_one(capsys):
    from hf2q.errors import ModelError
    from hf2q.runtime.pair import demo_pair

    try:
        demo_pair()
    except ModelError:
        assert main(["bench", "--slots", "1"]) != 0
        err = capsys.readouterr().err
        assert "no embedded demo pair" in err and "--model" in err
        return
    argv = ["bench", "--slots", "1", "--gen-tokens", "4", "--trials", "1", "--warmup", "0"]
    assert main([*argv, "--no-baseline", "--json"]) == 0
    assert _json_line(capsys)["results"][0]["mode"] == "dflash"


def test_workloads_and_slot_lists_parse_as_documented():
    assert parse_slots("8, 1,2,2") == (1, 2, 8) and parse_slots("4") == (4,)
    cfg = BenchConfig(workload="random", prompt_tokens=7, seed=3)
    a = make_prompts(cfg, 3, vocab_size=50, avoid=[0, 1, 2])
    assert a == make_prompts(cfg, 3, vocab_size=50, avoid=[0, 1, 2])  # seeded
    assert all(len(p) == 7 and not {0, 1, 2} & set(p) for p in a)
    assert len({tuple(p) for p in a}) == 3  # different prompts per slot


def test_requests_per_slot_queues_work_on_the_slots(fitted_pairs, capsys):
    """--requests-per-slot 3 on 2 slots: 6 requests, continuous batching, same tokens as plain."""
    target, draft = fitted_pairs["qwen35"]
    argv = ["bench", "-m", str(target), "-d", str(draft), "--slots", "2", "--gen-tokens", "10"]
    argv += ["--requests-per-slot", "3", "--trials", "1", "--warmup", "0", "--block-size", "6"]
    assert main([*argv, "--no-chat", "--dtype", "float32", "--json"]) == 0
    report = _json_line(capsys)
    assert report["config"]["requests_per_slot"] == 3
    by = {r["mode"]: r for r in report["results"]}
    assert {r["slots"] for r in report["results"]} == {2}
    for mode, r in by.items():
        # 6 requests of at most 10 tokens; the two slots' figures aggregate their queued requests.
        assert 6 * 2 <= r["generation_tokens"] <= 6 * 10
        assert len(r["per_slot_tokens_per_s"]) == 2
        if mode != "plain":
            assert r["matches_plain"] == 1.0
            hists = r["accepted_histogram_per_slot"]
            assert len(hists) == 2 and len(r["tau_per_slot"]) == 2
            if mode == "dflash":
                assert sum(map(sum, hists)) == pytest.approx(
                    r["busy_rows"] * r["rounds"], abs=0.01 * r["rounds"]
                )
                assert 1.0 <= r["busy_rows"] <= 2.0
    # Every mode decoded the same six requests to the same tokens.
    assert len({r["generation_tokens"] for r in by.values()}) == 1
    # More requests than slots: the batched runs took more rounds than one request needs alone.
    assert by["plain"]["rounds"] > 10


@pytest.mark.parametrize("value", ["0", "-2"])
def test_requests_per_slot_must_be_positive(value, capsys):
    assert main(["bench", "--requests-per-slot", value]) != 0
    assert "--requests-per-slot must be at least 1" in capsys.readouterr().err


def test_the_view_says_when_the_batch_drained_and_how_to_keep_it_full():
    from hf2q.cli.bench_view import drain_note

    def report(busy, rps=1):
        rows = [
            {"slots": 1, "mode": "dflash", "busy_rows": 1.0},
            {"slots": 8, "mode": "plain", "busy_rows": 8.0},
            {"slots": 8, "mode": "dflash", "busy_rows": busy},
        ]
        return {"config": {"requests_per_slot": rps}, "results": rows}

    note = drain_note(report(4.37))
    assert note.startswith("note: at 8 slots batched DFlash kept 4.4 rows busy on average")
    assert "--requests-per-slot K" in note
    assert "--requests-per-slot" not in drain_note(report(4.37, rps=4))
    assert drain_note(report(6.81)) is None  # busy enough


def test_the_view_says_when_the_host_changed_speed_during_the_runs():
    from hf2q.cli.bench_view import host_note

    def report(before, after):
        host = {"python_loop_adds": 10**6, "python_loop_ms_before": before}
        return {"host": {**host, "python_loop_ms_after": after}, "results": []}

    note = host_note(report(68.0, 100.0))  # session 32's first H200 host, start and end
    assert note.startswith("note: this host ran Python 1.5x slower after the runs than before")
    assert "68 against 100 ms for 1,000,000 additions" in note
    assert "faster" in host_note(report(156.0, 88.0))
    assert host_note(report(70.0, 75.0)) is None  # steady enough
    assert host_note({"results": []}) is None  # records made before the host entry
