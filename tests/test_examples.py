"""Smoke tests of examples/: char_gpt.py trains a tiny model for a few steps, saves it and
generates; its KV-cache decoding gives the logits of the full forward; attention_heatmaps.py
draws a PNG from the checkpoint. A few seconds each on 2 CPU cores."""

import contextlib
import importlib.util
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONTEXT = 48
TINY = ["--steps", "6", "--context", str(CONTEXT), "--d-model", "32", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--batch-size", "4", "--log-every", "2", "--eval-every", "4"]


def load_example(name):
    """Import examples/<name>.py as the module ``name`` (attention_heatmaps imports char_gpt by that name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def char_gpt():
    return load_example("char_gpt")


@pytest.fixture(scope="module")
def trained(char_gpt, tmp_path_factory):
    """Run char_gpt's command line once: a tiny model, 6 steps, 50 generated characters (more than the context,
    so the generation window restarts once). Returns (checkpoint path, stdout, generated text)."""
    ckpt = tmp_path_factory.mktemp("char_gpt") / "tiny.pt"
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(stdout):
            text = char_gpt.main(TINY + ["--out", str(ckpt), "--generate", "50", "--prompt", "Shall I"])
    finally:
        torch.set_num_threads(threads)
    return ckpt, stdout.getvalue(), text


def test_char_gpt_trains_saves_and_generates(char_gpt, trained):
    ckpt, stdout, text = trained
    assert ckpt.is_file()
    model, vocab, saved = char_gpt.load_checkpoint(ckpt)
    assert saved["config"] == {"vocab_size": len(vocab.chars), "context": CONTEXT, "d_model": 32, "n_layers": 2,
                               "n_heads": 4, "n_kv_heads": 2, "dropout": 0.1}
    assert saved["train"]["steps"] == 6
    assert all(len(b.attn.in_proj_weight) == 32 + 2 * 16 for b in model.blocks)  # 2 kv heads of 8 dims

    train_losses = [float(x) for x in re.findall(r"^step +\d+ \| train loss ([\d.]+)", stdout, re.M)]
    val_losses = [float(x) for x in re.findall(r"val loss ([\d.]+) +\|", stdout)]
    assert len(train_losses) == 3 and len(val_losses) == 3, stdout  # steps 2, 4, 6; val at 0, 4, 6
    assert all(math.isfinite(x) and 0 < x < 10 for x in train_losses + val_losses), stdout
    assert val_losses[0] == pytest.approx(math.log(len(vocab.chars)), abs=1.0)  # untrained: near uniform

    assert len(text) == 50 and set(text) <= set(vocab.chars)
    assert "Shall I" + text in stdout


def test_kv_cache_decoding_matches_full_forward(char_gpt, trained):
    """Prefill + one-token (and a few-token) steps with attn_ext.KVCache give the logits of the uncached
    causal forward over the whole prefix, and greedy generation picks the same characters."""
    model, vocab, _ = char_gpt.load_checkpoint(trained[0])
    text = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:"
    ids = torch.tensor([vocab.encode(text)[:CONTEXT]])
    with torch.no_grad():
        full, _ = model(ids)
        caches = [char_gpt.attn_ext.KVCache() for _ in model.blocks]
        pieces, start = [], 0
        for n in [7, 1, 1, 3] + [1] * (CONTEXT - 12):  # a prefill, single steps, a 3-token step
            logits, _ = model(ids[:, start : start + n], caches)
            pieces.append(logits)
            start += n
    assert start == CONTEXT and all(len(c) == CONTEXT for c in caches)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)

    # greedy decoding through generate() (prefill, then one cached token per step) picks, at every step, the
    # argmax of the uncached forward's logits (up to rounding, in case of a near-tie)
    prompt = ids[0, :5].tolist()
    new = char_gpt.generate(model, prompt, CONTEXT - 5, temperature=0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new]))[0][0, 4:-1]  # the logits that chose each new token
    chosen = logits.gather(-1, torch.tensor(new)[:, None])[:, 0]
    assert (chosen >= logits.max(-1).values - 1e-4).all()


def test_char_gpt_bad_argument_is_one_line(char_gpt, capsys):
    with pytest.raises(SystemExit) as exc:
        char_gpt.main(["--heads", "4", "--kv-heads", "3"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--kv-heads must divide --heads (4)")


def test_attention_heatmaps_png(char_gpt, trained, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "heads.png"
    snippet = "Shall I compare thee\nto a summer's day?"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "attention_heatmaps.py"), "--checkpoint", str(trained[0]),
                           "--text", snippet, "--out", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert proc.stdout.count("% on the previous character") == 2 * 4  # layers x heads

    heatmaps = load_example("attention_heatmaps")
    model, vocab, _ = char_gpt.load_checkpoint(trained[0])
    maps = heatmaps.attention_maps(model, vocab, snippet)
    L = len(snippet)
    assert [tuple(m.shape) for m in maps] == [(4, L, L)] * 2
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(4, L))  # each query's weights sum to 1
        assert not m.triu(diagonal=1).any()  # causal: no weight on later characters


def test_hf_llama_sonnets_trains_on_attn_ext_and_agrees_with_sdpa():
    """examples/hf_llama_sonnets.py: a tiny transformers Llama trains a few steps with
    attn_implementation="attn_ext" (the loss falls below the uniform guess), its held-out loss
    equals the one computed with "sdpa", and generate() writes the requested characters."""
    pytest.importorskip("transformers")
    hf_example = load_example("hf_llama_sonnets")
    stdout = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(stdout):
            ours, theirs, sample = hf_example.main(["--steps", "8", "--context", "32", "--batch", "4", "--layers", "2",
                                            "--hidden", "32", "--generate", "40", "--prompt", "Shall I"])
    finally:
        torch.set_num_threads(threads)
    out = stdout.getvalue()
    assert "attention: attn_ext" in out
    n_chars = int(re.search(r"(\d+) characters", out).group(1))
    assert ours < math.log(n_chars)  # learnt something: below the uniform guess
    assert math.isclose(ours, theirs, rel_tol=1e-5)
    assert sample.startswith("Shall I") and len(sample) == len("Shall I") + 40 and sample in out


def test_char_gpt_context_parallel_matches_one_process():
    """examples/char_gpt_context_parallel.py: the same seed gives the same loss curve in one
    process and with every sequence split over 2 processes (torchrun, gloo), both layouts."""
    tiny = ["--steps", "4", "--log-every", "1", "--context", "48", "--d-model", "32", "--layers", "2",
            "--batch-size", "4"]
    script = str(EXAMPLES / "char_gpt_context_parallel.py")

    def losses(cmd):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [float(x) for x in re.findall(r"train loss ([0-9.]+)", proc.stdout)]

    one = losses([sys.executable, script, *tiny])
    assert len(one) == 4 and one[-1] < one[0]
    for layout in ("zigzag", "contiguous"):
        two = losses([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      script, *tiny, "--layout", layout])
        assert two == pytest.approx(one, rel=1e-5), (layout, two, one)
