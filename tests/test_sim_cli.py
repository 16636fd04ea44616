"""`april-ext simulate`: the table, the JSON report and the plots of a small run; bad flags are named."""

from __future__ import annotations

import json

import pytest

from april_ext.cli import main

SMALL = ["simulate", "--cluster", "h100-qwen3-4b", "--num-engines", "2", "--lengths", "deepscaler",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "8",
         "--max-response-len", "4096", "--steps", "3"]


def test_simulate_prints_the_table_and_writes_report_and_plots(tmp_path, capsys):
    assert main([*SMALL, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mode in ("baseline", "april-batch", "april-continuous", "april-adaptive"):
        assert mode in out
    assert "steady-state rate" in out and "ceil eff" in out and "+0.0%" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"baseline", "april-batch", "april-continuous", "april-adaptive"}
    assert len(report["april-batch"]["steps"]) == 3
    assert report["baseline"]["summary"]["partial_token_ratio"] == 0.0
    for name in ("throughput.png", "partial_offpolicy.png", "lengths.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_replays_a_trace_and_names_bad_values(tmp_path, capsys):
    trace = tmp_path / "lens.csv"
    trace.write_text("prompt_id,length\n" + "".join(f"p{i // 4},{100 + 37 * i}\n" for i in range(32)))
    assert main([*SMALL, "--lengths", str(trace), "--modes", "baseline,april-continuous"]) == 0
    assert "lens.csv" in capsys.readouterr().out
    assert main([*SMALL, "--cluster", "a100-qwen3-4b"]) == 2
    assert "SimConfig.cluster='a100-qwen3-4b' is not allowed" in capsys.readouterr().err
    assert main([*SMALL, "--lengths", "nope"]) == 2
    assert "SimConfig.lengths='nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*SMALL, "--modes", "fast"])


def test_simulate_compares_several_over_sampling_ratios(capsys):
    assert main([*SMALL, "--over-sampling-batch-size", "4,8", "--modes", "baseline,april-continuous"]) == 0
    lines = capsys.readouterr().out.splitlines()
    labels = [line.split("  ")[0].strip() for line in lines[4:]]
    assert labels == ["baseline", "april-continuous N'=4", "april-continuous N'=8"]
    with pytest.raises(SystemExit):
        main([*SMALL, "--over-sampling-batch-size", "4,x"])


def test_simulate_with_mixed_chunked_prefill(capsys):
    assert main([*SMALL, "--modes", "baseline,april-adaptive", "--mixed-chunk", "--chunked-prefill-size", "2048"]) == 0
    out = capsys.readouterr().out
    assert "(mixed chunk 2048)" in out and "april-adaptive" in out
    assert main([*SMALL, "--modes", "baseline"]) == 0
    assert "(separate prefill)" in capsys.readouterr().out
    assert main([*SMALL, "--mixed-chunk", "--chunked-prefill-size", "0"]) == 2
    assert "SimConfig.chunked_prefill_size=0" in capsys.readouterr().err


def test_simulate_with_the_april_scripts_engines(capsys):
    paper = ["--num-engines", "2", "--tensor-parallel", "2", "--mem-fraction-static", "0.6", "--abort-latency", "0.5",
             "--weight-sync", "4", "--warmup-steps", "2", "--modes", "baseline,april-batch"]
    assert main([*SMALL, *paper]) == 0
    out = capsys.readouterr().out
    assert "2 engines x 2 GPU" in out and "summary over steps 2.." in out
    assert main([*SMALL, *paper, "--abort-latency", "-1"]) == 2
    assert "abort_latency_s=-1.0" in capsys.readouterr().err
    assert main([*SMALL, "--warmup-steps", "3"]) == 2
    assert "SimConfig.warmup_steps=3" in capsys.readouterr().err
