"""``python -m lowprec bench train``: the Llama-style model, the step and the arguments, on the CPU
(timings need CUDA)."""

import json
import subprocess
import sys
import types
from unittest import mock

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import train
from lowprec.nn import FP8Linear, FP8SwiGLUMLP

TINY = train.LlamaConfig(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=64, batch=2, seq=32)


def test_registered_with_the_issue_sizes():
    assert "train" in BENCHES
    big, small = train.SIZES["llama3-8b-2l"], train.SIZES["h1024"]
    assert (big.hidden, big.heads, big.kv_heads, big.ffn, big.layers, big.vocab) == (4096, 32, 8, 14336, 2, 32000)
    assert (small.hidden, small.layers, small.ffn) == (1024, 8, 2816)
    assert big.batch * big.seq == small.batch * small.seq == 8192


def test_rotary_is_a_rotation_of_pairs():
    cos, sin = train.rotary_tables(16, 8)
    x = torch.randn(1, 2, 16, 8)
    y = train.apply_rotary(x, cos, sin)
    pairs = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pairs(y), pairs(x))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])  # position 0: angle 0


@pytest.mark.parametrize("weights", train.WEIGHTS)
def test_lowprec_model_converts_every_projection_but_the_lm_head_and_trains(weights):
    base = train.Llama(TINY)
    ref = train.make_model(TINY, "bf16", weights, device="cpu", base=base)
    fp8 = train.make_model(TINY, "lowprec", weights, device="cpu", base=base, min_weight_numel=0)
    kinds = {name: type(m) for name, m in fp8.named_modules() if isinstance(m, (torch.nn.Linear, FP8Linear))}
    assert kinds.pop("lm_head") is torch.nn.Linear
    # Q, K, V, O as FP8Linear; the MLP fused (its three nn.Linear layers hold the parameters)
    assert all(isinstance(b.mlp, FP8SwiGLUMLP) for b in fp8.blocks)
    mlp = {n for n in kinds if ".mlp." in n}
    assert len(mlp) == 3 * TINY.layers and {kinds[n] for n in mlp} == {torch.nn.Linear}
    assert len(kinds) == 7 * TINY.layers and {kinds[n] for n in kinds if n not in mlp} == {FP8Linear}
    want = torch.bfloat16 if weights == "bf16" else torch.float32
    assert all(p.dtype == want for p in fp8.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY.vocab, (TINY.batch, TINY.seq), generator=g)
    targets = torch.randint(0, TINY.vocab, (TINY.batch, TINY.seq), generator=g)
    losses = {}
    for name, model in (("bf16", ref), ("lowprec", fp8)):
        step = train.make_step(model, weights, compiled=False)
        losses[name] = [step(tokens, targets).item() for _ in range(3)]
    for name, v in losses.items():
        assert all(map(torch.isfinite, torch.tensor(v))), name
        assert v[-1] < v[0], name  # the same batch three times: it is learned
    assert abs(losses["lowprec"][0] - losses["bf16"][0]) < 0.05 * losses["bf16"][0]


@pytest.mark.parametrize("impl", ["lowprec-wgrad16", "lowprec-wgrad2d"])
def test_wgrad_models_fuse_the_mlps_with_their_recipe(impl):
    recipe = "fp8_block_" + impl.removeprefix("lowprec-")
    model = train.make_model(TINY, impl, "bf16", device="cpu", min_weight_numel=0)
    assert all(b.mlp.recipe == recipe for b in model.blocks)
    assert {m.recipe.name for m in model.modules() if isinstance(m, FP8Linear)} == {recipe}


def test_lowprec_model_keeps_layers_too_small_to_gain():
    model = train.make_model(TINY, "lowprec", "bf16", device="cpu")
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


def test_arguments():
    args = train.parse_args(["--sizes", "h1024", "--impls", "bf16,lowprec", "--modes", "eager"])
    assert (args.sizes, args.impls, args.modes, args.weights) == (["h1024"], ["bf16", "lowprec"], ["eager"],
                                                                  list(train.WEIGHTS))
    assert args.text_impls == ["bf16", "lowprec", "lowprec-wgrad16"]
    assert train.parse_args(["--text-impls", "bf16,lowprec-wgrad2d"]).text_impls == ["bf16", "lowprec-wgrad2d"]
    with pytest.raises(SystemExit):
        train.parse_args(["--impls", "fp4"])
    with pytest.raises(SystemExit):
        train.parse_args(["--text-impls", "torchao-tensorwise"])
    with pytest.raises(ValueError, match="impl"):
        train.make_model(TINY, "fp4", "bf16", device="cpu")


def test_text_run_over_seeds_on_the_cpu():
    """Each seed trains every implementation from its own initial weights and batches; the gaps are
    the seeds' mean, the plotted losses the first seed's."""
    out = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), seeds=2)
    assert out["seeds"] == 2 and len(out["losses"]["lowprec"]) == 2
    per_seed = out["relative_gap_per_seed"]["lowprec"]
    assert len(per_seed) == 2 and per_seed[0] != per_seed[1]
    assert out["relative_gap"]["lowprec"] == pytest.approx(sum(per_seed) / 2)
    first = out["losses"]
    assert out["last20_mean"]["bf16"] != pytest.approx(sum(first["bf16"]) / 2)  # the mean of both seeds
    with pytest.raises(SystemExit):
        train.parse_args(["--text-seeds", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--text-first-seed", "-1"])


def test_a_later_seed_range_continues_the_comparison():
    """``first_seed`` picks the seeds, so a many-seed comparison splits over runs: seed 1 alone
    gives the second seed of a two-seed run."""
    both = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), seeds=2)
    second = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), first_seed=1)
    assert second["first_seed"] == 1
    assert second["relative_gap"]["lowprec"] == pytest.approx(both["relative_gap_per_seed"]["lowprec"][1])


def test_a_run_of_the_next_seeds_is_appended_to_the_saved_text_run():
    """``--text-first-seed`` right after the saved run's seeds: the saved section's text run grows
    by them (per-seed gaps in order, means over every seed, the first seed's plotted losses); a run
    that does not follow on replaces it."""
    both = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), seeds=2)
    first = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), seeds=1)
    second = train.train_on_text(TINY, steps=2, device="cpu", impls=("bf16", "lowprec"), first_seed=1)
    merged = train.merged_with_saved({"sizes": {}, "rows": [], "text": second},
                                     {"sizes": {}, "rows": [], "text": first})["text"]
    assert merged["seeds"] == 2 and merged["first_seed"] == 0 and merged["losses"] == first["losses"]
    assert merged["relative_gap_per_seed"]["lowprec"] == pytest.approx(both["relative_gap_per_seed"]["lowprec"])
    assert merged["relative_gap"]["lowprec"] == pytest.approx(both["relative_gap"]["lowprec"])
    assert merged["last20_mean"]["bf16"] == pytest.approx(both["last20_mean"]["bf16"])
    assert train.continued_text(first, first) is first  # seed 0 again: not a continuation


def test_results_merge_into_the_saved_section():
    """A run of one size and implementation replaces only its own rows; the other size's rows, the
    saved loss run and the --min-weight-numel rows stay."""
    row = lambda size, impl, ms, **kw: {"size": size, "weights": "bf16", "mode": "eager", "impl": impl,  # noqa: E731
                                        "step_ms": ms, **kw}
    saved = {"note": "old", "text": {"steps": 300}, "sizes": {"h1024": 1, "llama3-8b-2l": 2},
             "rows": [row("h1024", "bf16", 30.0), row("llama3-8b-2l", "lowprec", 50.0),
                      row("llama3-8b-2l", "lowprec", 47.0, min_weight_numel=0)]}
    payload = {"device": "H100", "sizes": {"llama3-8b-2l": 2}, "rows": [row("llama3-8b-2l", "lowprec", 45.0)]}
    merged = train.merged_with_saved(payload, saved)
    assert merged["note"] == "old" and merged["text"] == {"steps": 300} and merged["device"] == "H100"
    assert set(merged["sizes"]) == {"h1024", "llama3-8b-2l"}
    assert sorted(r["step_ms"] for r in merged["rows"]) == [30.0, 45.0, 47.0]
    assert train.merged_with_saved(payload, None) is payload


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_exits_1_without_a_gpu():
    res = subprocess.run([sys.executable, "-m", "lowprec", "bench", "train"], capture_output=True, text=True)
    assert res.returncode == 1 and "needs a CUDA GPU" in res.stderr


def test_a_negative_min_weight_numel_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--min-weight-numel", "-1"])
    assert exit_info.value.code == 2 and "--min-weight-numel" in capsys.readouterr().err
    assert train.parse_args(["--min-weight-numel", "0"]).min_weight_numel == 0
    assert train.parse_args([]).min_weight_numel is None  # convert's own default


def test_loss_plot_beside_an_out_file_in_the_working_directory(tmp_path, monkeypatch):
    # matplotlib is not a dependency: a stub that records where the figure goes
    fig = mock.MagicMock()
    pyplot = types.SimpleNamespace(subplots=lambda **kwargs: (fig, mock.MagicMock()))
    monkeypatch.setitem(sys.modules, "matplotlib", types.SimpleNamespace(use=lambda *a, **k: None, pyplot=pyplot))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    monkeypatch.chdir(tmp_path)
    train._plot({"losses": {"bf16": [5.0, 4.0], "lowprec": [5.0, 4.1]}}, "gpu", "results.json")  # --out results.json
    assert fig.savefig.call_args.args[0] == "train_text_gpu.png"
    train._plot({"losses": {"bf16": [5.0, 4.0]}}, "gpu", str(tmp_path / "sub" / "results.json"))
    assert fig.savefig.call_args.args[0] == str(tmp_path / "sub" / "train_text_gpu.png")
    assert (tmp_path / "sub").is_dir()


def test_peak_memory_is_the_steps_not_the_timers_flush_buffer(tmp_path, monkeypatch):
    """bench_ms allocates its 256 MiB L2-flush buffer before the first step and frees it after the
    last: the row's peak_gib is the step's own peak, without it."""
    from lowprec.bench import common

    step_peak = 3 << 30
    peak = {"now": 0}

    def fake_bench_ms(fn, warmup=10, rep=50, queued=False, before=None):
        peak["now"] = common._FLUSH_BYTES + step_peak  # the flush buffer lives through every step
        return 1.0

    monkeypatch.setitem(train.SIZES, "tiny", TINY)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FAKE GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: peak.update(now=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak["now"])
    monkeypatch.setattr(train.torch, "randint",  # the tokens: on the CPU
                        lambda low, high, size, device=None: torch.zeros(size, dtype=torch.long))
    real_make_model = train.make_model
    monkeypatch.setattr(train, "make_model", lambda *a, **k: real_make_model(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(common, "bench_ms", fake_bench_ms)
    out = str(tmp_path / "gpu.json")
    train.main(["--sizes", "tiny", "--impls", "bf16", "--weights", "bf16", "--modes", "eager", "--out", out])
    (row,) = json.load(open(out))["train"]["rows"]
    assert row["peak_gib"] == pytest.approx(step_peak / 2**30)
