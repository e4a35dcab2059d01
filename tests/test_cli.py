"""python -m attn_ext: what info reports, and one-line errors with a non-zero exit for bad input."""

import subprocess
import sys

import pytest
import torch

import attn_ext._build


def _run(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "attn_ext", *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def test_info_reports_build_runtime_and_every_kernel_family():
    rc, out, err = _run("info")
    assert rc == 0, err
    assert f"running on      torch {torch.__version__}" in out
    assert "built against   torch" in out
    for family in ("default", "generic", "tensor"):
        assert family in out, out
    # every kernel line says usable or why not
    cpu_isas = attn_ext._build.library_info()["cpu_isas"].split()
    families = (*cpu_isas, "generic", "tensor")
    kernel_lines = [line.strip() for line in out.splitlines()
                    if line.startswith("    ") and line.split()[0] in families]
    assert len(kernel_lines) == len(families), out  # one line per compiled CPU variant and CUDA family
    for line in kernel_lines:
        status = line.split(None, 1)[1]
        assert status.startswith("usable") or (status.startswith("not ") and ": " in status), line
    # and the CPU variant that runs is exactly one of them
    assert sum(", running" in line for line in kernel_lines[:len(cpu_isas)]) == 1, out
    # and each CPU variant's line says what it is
    assert all("; " in line and line.split("; ", 1)[1].strip() for line in kernel_lines[:len(cpu_isas)]), out
    # and what is deterministic, with torch's switch as it is now
    determinism = out[out.index("  determinism"):]
    assert "CPU " in determinism and "use_deterministic_algorithms(True) (off now)" in determinism, out


@pytest.mark.parametrize("args,pattern", [
    (["check", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["check", "--devcie", "cpu"], "unrecognized arguments"),
    (["bench", "--variant", "nope"], "invalid choice: 'nope'"),
    (["bench", "--variant", "varlen", "--shapes", "2x8x512x64"], "varlen shapes are 1xHxTxE"),
    (["bench", "--decode", "--lengths", "0"], "--lengths, --batches and --rounds must be >= 1"),
    (["bench", "--decode", "--lengths", "4k"], "--lengths must be comma-separated integers, got '4k'"),
    (["bench", "--decode", "--tokens", "128"], "--tokens must be in 1..127"),
    (["bench", "--decode", "--dtype", "int8"], "int8"),
    (["bench", "--decode", "--written", "0"], "--written must be comma-separated fractions in (0, 1], got '0'"),
    (["bench", "--decode", "--written", "0.5,x"], "--written must be comma-separated fractions in (0, 1], got '0.5,x'"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, pattern):
    rc, out, err = _run(*args)
    assert rc == 2
    assert pattern in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_a_gpu_without_one_gives_one_line_and_exit_2():
    for args in (["check", "--device", "cuda"], ["bench", "--decode", "--device", "cuda"]):
        rc, out, err = _run(*args)
        assert rc == 2, args
        assert "no CUDA device" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_bench_writes_a_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    rc, out, err = _run("bench", "--shapes", "1x2x64x16,1x2x128x16,1x2x128x16:causal", "--min-run-time", "0.02",
                        "--rounds", "1", "--json", str(json_path), "--plot", str(png_path))
    assert rc == 0, err[-2000:]
    import json

    saved = json.loads(json_path.read_text())
    # attn_ext itself was timed (not the SDPA stand-in), with the CPU kernel variant named
    assert not saved["stand_in"] and "CPU kernels: " in saved["ours"], saved["ours"]
    results = saved["results"]
    assert {r["impl"] for r in results} == {"ours", "sdpa", "plain"}
    assert len(results) == 3 * 3 * 3  # 3 shapes x 3 passes x 3 implementations
    pass_factor = {"fwd": 1.0, "fwd+bwd": 3.5, "bwd": 2.5}
    for r in results:
        assert r["check_ok"], r
        flops = 4 * r["B"] * r["H"] * r["L"] * r["S"] * r["E"] * (0.5 if r["causal"] else 1.0) * pass_factor[r["pass"]]
        assert r["flops"] == flops, r
        if r["ms"] is None:  # a backward shorter than the timing noise of these tiny calls
            assert r["pass"] == "bwd" and r["gflops"] is None, r
            continue
        assert r["ms"] > 0 and r["gflops"] > 0, r
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_shape_gives_one_line_and_exit_2():
    rc, out, err = _run("bench", "--shapes", "2x2x1xz")
    assert rc == 2 and "bad shape '2x2x1xz'" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# Tiny cases (--quick divides L by 4; --tokens is taken as given): a few seconds each.
VARIANT_ARGS = {
    "window": ["--shapes", "1x2x256x16:causal", "--window", "16"],
    "softcap": ["--shapes", "1x2x128x16:causal,1x2x128x16"],
    "alibi": ["--shapes", "1x2x128x16:causal,1x2x128x16"],
    "sinks": ["--shapes", "1x2x128x16:causal,1x2x128x16"],
    "varlen": ["--shapes", "1x2x64x16:causal", "--tokens", "600", "--lengths", "16-200"],
}
VARIANT_IMPLS = {
    "window": {"ours", "ours+mask", "sdpa+mask", "ours causal", "flex"},
    "softcap": {"ours", "ours plain"},
    "alibi": {"ours", "ours plain", "sdpa+bias"},
    "sinks": {"ours", "ours plain"},
    "varlen": {"ours", "dense same tokens", "padded+mask", "sdpa padded"},
}


def _exact_pairs(variant, r, case_check):
    """The visible (query, key) pairs of one result row, counted here row by row."""
    B, H, L = (int(x) for x in r["shape"].split(":")[0].split("x")[:3])
    causal = r["shape"].endswith(":causal")
    full = B * H * (L * (L + 1) // 2 if causal else L * L)
    if variant == "window" and r["impl"] != "ours causal":
        return B * H * sum(min(i, 16) + 1 for i in range(L))
    if variant == "varlen" and r["impl"] != "dense same tokens":
        return H * sum(n * (n + 1) // 2 for n in case_check["seq_lengths"])
    return full


@pytest.mark.parametrize("variant", sorted(VARIANT_ARGS))
def test_bench_variant_checks_times_and_writes_json(variant, tmp_path):
    import json

    json_path = tmp_path / f"{variant}.json"
    rc, out, err = _run("bench", "--variant", variant, "--quick", "--threads", "1", "--rounds", "1",
                        "--min-run-time", "0.01", *VARIANT_ARGS[variant], "--json", str(json_path))
    assert rc == 0, out[-2000:] + err[-2000:]
    saved = json.loads(json_path.read_text())
    assert saved["variant"] == variant and "CPU kernels: " in saved["ours"], saved["ours"]
    assert "time/ours" in out and "WRONG" not in out
    results, checks = saved["results"], saved["checks"]
    assert len(results) == len(checks) * 2 * len(VARIANT_IMPLS[variant])  # cases x passes x impls
    assert {r["impl"] for r in results} == VARIANT_IMPLS[variant]
    for r in results:
        case_check = next(c for c in checks if c["case"] == r["case"] and c["dtype"] == r["dtype"])
        assert r["pairs"] == _exact_pairs(variant, r, case_check), r
        E = int(r["shape"].split(":")[0].split("x")[3])
        assert r["flops"] == 4 * E * r["pairs"] * (3.5 if r["pass"] == "fwd+bwd" else 1.0), r
        if r["impl"] == "flex" and r["ms"] is None:  # no flex backward on the CPU: the row says why
            assert r["pass"] == "fwd+bwd" and r["error"], r
            continue
        assert r["ms"] > 0 and r["gflops"] > 0 and r["error"] is None and r["peak_bytes"] is not None, r
    grads = {"out", "dq", "dk", "dv"} | ({"dsinks"} if variant == "sinks" else set())
    for c in checks:
        assert c["ok"] and "ours" in c["impls"], c
        assert set(c["impls"]["ours"]["rel_err"]) == grads, c
        assert c["impls"]["ours"]["max_rel_err"] <= c["tol"], c
    if variant == "varlen":
        assert sum(checks[0]["seq_lengths"]) == 600 and all(1 <= n <= 200 for n in checks[0]["seq_lengths"])
    # every target is printed with its value, or why it was not measured
    assert len(saved["targets"]) >= 2
    for t in saved["targets"]:
        assert (t["value"] is None) == (t["met"] is None) and (t["value"] is not None or t["why_not_measured"])
        assert f"{t['target']}: " in out


def test_bench_decode_times_steps_and_the_char_gpt(tmp_path):
    import json

    json_path = tmp_path / "decode.json"
    rc, out, err = _run("bench", "--decode", "--lengths", "40,300", "--batches", "2", "--rounds", "1",
                        "--tokens", "6", "--threads", "1", "--json", str(json_path))
    assert rc == 0, out[-2000:] + err[-2000:]
    saved = json.loads(json_path.read_text())
    steps = saved["steps"]
    # batch 2 x (MHA 8/8, GQA 8/2) x two cache lengths, one query row each
    assert sorted((r["Hkv"], r["S"]) for r in steps) == [(2, 40), (2, 300), (8, 40), (8, 300)]
    for r in steps:
        assert r["B"] == 2 and r["Hq"] == 8 and r["E"] == 64 and r["target"] is None, r
        assert r["ours_us"] > 0 and r["sdpa_us"] > 0, r
        # the table prints each step: its cache length, both times and their ratio
        assert any(f"{r['S']}  64" in line and f"{r['ratio']:.2f}" in line for line in out.splitlines()), r
        assert r["rel_err_vs_sdpa"] < 1e-5, r  # float32: the same attention as SDPA's
    gpt = saved["char_gpt"]
    assert gpt["config"]["generated_tokens"] == 6
    assert set(gpt["tokens_per_s"]) == {"ours cached", "ours compiled", "ours recompute", "torch recompute"}
    assert all(tps > 0 for tps in gpt["tokens_per_s"].values()), gpt
    # cached decoding on attn_ext, compiled or not, picks the tokens torch.nn.MultiheadAttention
    # picks recomputing
    assert all(gpt["same_tokens"].values()), gpt
    # prefill and steps reuse their graphs (not one per token; 8 is torch.compile's recompile limit)
    assert 1 <= gpt["compiled"]["graphs"] <= 8, gpt["compiled"]
    assert "ours/sdpa" in out and "tokens/s" in out and "NO" not in out and "graphs for the whole" in out


def test_bench_decode_on_a_preallocated_cache_masks_both_implementations(tmp_path):
    import json

    json_path = tmp_path / "written.json"
    rc, out, err = _run("bench", "--decode", "--written", "0.25,0.05", "--lengths", "400", "--batches", "1,3",
                        "--no-model", "--rounds", "1", "--json", str(json_path))
    assert rc == 0, out[-2000:] + err[-2000:]
    steps = json.loads(json_path.read_text())["steps"]
    assert sorted((r["B"], r["Hkv"], r["S"]) for r in steps) == [(1, 2, 400), (1, 8, 400), (3, 2, 400), (3, 8, 400)]
    for r in steps:
        # the same masked attention as SDPA's, and as attention over each entry's written keys
        # alone (100, 20 and 100 of them; a mask left out of either call would make it differ)
        assert r["written"] == [0.25, 0.05], r
        assert r["rel_err_vs_sdpa"] < 1e-5 and r["rel_err_vs_written_keys_only"] < 1e-5, r
        assert r["target"] is None, r
    assert "the first 0.25, 0.05 x S written by the batch entries in turn" in out


def test_bench_decode_targets_are_issue_13s_shapes(tmp_path):
    import json

    json_path = tmp_path / "targets.json"
    rc, out, err = _run("bench", "--decode", "--targets", "--no-model", "--rounds", "1", "--json", str(json_path),
                        timeout=900)
    assert rc == 0, out[-2000:] + err[-2000:]
    steps = json.loads(json_path.read_text())["steps"]
    assert [(r["B"], r["Hq"], r["Hkv"], r["S"], r["E"]) for r in steps] == [
        (1, 8, 8, 4000, 64), (4, 8, 8, 1024, 64), (1, 8, 8, 32768, 64), (1, 4, 4, 100, 32), (1, 1, 1, 32768, 128)]
    for r in steps:
        assert r["target"] is not None and f"<= {r['target']}: " in out, r
        assert r["rel_err_vs_sdpa"] < 1e-5, r
