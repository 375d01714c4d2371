"""bench decode on the CPU: arguments, the weight-byte floor, and that each lowprec implementation
computes x · Wᵀ (the timing itself needs a GPU)."""

import pytest
import torch

from lowprec.bench import decode


def test_arguments_and_defaults():
    args = decode.parse_args([])
    assert args.ms == [1, 4, 16, 64, 256] and args.shapes == list(decode.SHAPES) and args.impls == list(decode.IMPLS)
    args = decode.parse_args(["--ms", "1,8", "--shapes", "256x512", "--impls", "bf16,lowprec-nvfp4"])
    assert (args.ms, args.shapes, args.impls) == ([1, 8], [(256, 512)], ["bf16", "lowprec-nvfp4"])
    with pytest.raises(SystemExit):
        decode.parse_args(["--impls", "int4"])
    assert decode.parse_args([]).model_modes == list(decode.MODEL_MODES)
    assert decode.parse_args(["--model-modes", "compiled"]).model_modes == ["compiled"]
    with pytest.raises(SystemExit):
        decode.parse_args(["--model-modes", "graph"])


def test_impls_has_help_and_is_in_the_usage_line(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert "--impls IMPLS projection implementations, comma-separated (bf16, fp8-cublas," in text
    assert "[--impls bf16,fp8-cublas,lowprec-fp8,lowprec-nvfp4]" in decode.__doc__  # the usage line


def test_weight_bytes():
    n, k = 4096, 4096
    assert decode.weight_bytes("bf16", n, k) == 2 * n * k
    assert decode.weight_bytes("lowprec-nvfp4", n, k) == n * k * 0.5625  # 4.5 bits
    assert decode.weight_bytes("lowprec-fp8", n, k) == n * k + 4 * (n // 128) * (k // 128)


@pytest.mark.parametrize("impl", ["bf16", "lowprec-fp8", "lowprec-nvfp4"])
def test_each_implementation_computes_the_product(impl):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=g).to(torch.bfloat16) * 512 ** -0.5
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        y = decode._make(impl, weight)(x)
    ref = x.float() @ weight.float().t()
    assert y.shape == (4, 256) and ((y.float() - ref).norm() / ref.norm()) < 0.15


def test_ratio_summary_geomean_per_format_and_timing():
    def row(impl, m, graph_us, after_op_us=None, n=4096):
        r = {"impl": impl, "n": n, "k": 4096, "m": m, "graph_us": graph_us}
        return r if after_op_us is None else {**r, "after_op_us": after_op_us}

    rows = [row("bf16", 1, 10.0, 12.0), row("lowprec-nvfp4", 1, 4.0, 6.0),
            row("bf16", 4, 10.0, 12.0), row("lowprec-nvfp4", 4, 2.5, 3.0),
            row("bf16", 64, 10.0, 12.0), row("lowprec-nvfp4", 64, 1.0, 1.0),  # M = 64: not summarized
            row("bf16", 1, 20.0, n=8192), row("lowprec-nvfp4", 1, 5.0, n=8192),  # no after_op_us there
            row("lowprec-fp8", 16, 5.0, 5.0)]  # no bf16 row at that shape: not summarized
    summary = decode.ratio_summary(rows)
    assert set(summary) == {"lowprec-nvfp4"}
    graph, after = summary["lowprec-nvfp4"]["graph_us"], summary["lowprec-nvfp4"]["after_op_us"]
    assert graph["cells"] == 3 and graph["geomean"] == pytest.approx((2.5 * 4.0 * 4.0) ** (1 / 3))
    assert graph["lowest"] == pytest.approx(2.5)
    assert after["cells"] == 2 and after["geomean"] == pytest.approx((2.0 * 4.0) ** 0.5) and after["lowest"] == 2.0


def test_rotation_reads_more_than_l2_per_round():
    for impl in decode.IMPLS:
        for n, k in decode.SHAPES:
            nbytes = decode.weight_bytes(impl, n, k)
            copies = decode.rotation_copies(nbytes)
            assert copies * nbytes >= decode.ROTATE_BYTES and (copies - 1) * nbytes < decode.ROTATE_BYTES
    assert decode.rotation_copies(1e9) == 1


def test_decode_step_matches_the_full_forward():
    """Positions decoded one by one through the KV caches give the full causal forward's logits."""
    from lowprec.bench.train import Llama, LlamaConfig

    torch.manual_seed(0)
    c = LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=100, seq=8)
    model = Llama(c).double()
    tokens = torch.randint(0, c.vocab, (3, c.seq))
    caches = [tuple(torch.zeros(3, c.kv_heads, c.seq, c.head_dim, dtype=torch.float64) for _ in range(2))
              for _ in range(c.layers)]
    with torch.no_grad():
        full = model(tokens)
        for pos in range(c.seq):
            step = decode.decode_step(model, tokens[:, pos], caches, pos)
            torch.testing.assert_close(step, full[:, pos])


def test_decode_step_traces_in_one_graph_with_nvfp4_layers():
    """The compiled mode of the model decode step: torch.compile(fullgraph) traces the step of a
    model whose linears are NVFP4 inference layers (their custom op), with the eager step's result."""
    import lowprec
    from lowprec.bench.train import Llama, LlamaConfig

    torch.manual_seed(0)
    c = LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=96, seq=8)
    model = Llama(c).to(torch.bfloat16)
    lowprec.convert(model, "nvfp4", inference=True)
    tokens = torch.randint(0, c.vocab, (2,))
    caches = [tuple(torch.randn(2, c.kv_heads, c.seq, c.head_dim, dtype=torch.bfloat16) for _ in range(2))
              for _ in range(c.layers)]
    with torch.no_grad():
        eager = decode.decode_step(model, tokens, caches, c.seq - 1)
        compiled = torch.compile(decode.decode_step, fullgraph=True, backend="aot_eager")(model, tokens, caches,
                                                                                        c.seq - 1)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("argv", [["--shapes", "x"], ["--shapes", "4096"], ["--ms", "a"], ["--batches", "b"],
                                  ["--shapes", "100x4096"], ["--shapes", "4096x100", "--impls", "bf16,lowprec-nvfp4"]])
def test_bad_lists_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        decode.parse_args(argv)
    assert exit_info.value.code == 2


def test_odd_shapes_parse_for_bf16_only():
    """Only the FP8 / NVFP4 projections need multiples of 16; a bf16-only run takes any shape."""
    assert decode.parse_args(["--shapes", "100x200", "--impls", "bf16"]).shapes == [(100, 200)]
