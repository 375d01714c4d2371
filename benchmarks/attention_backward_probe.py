"""Which exact-attention backward the FP8 forward's training step should call (H100/H200, bf16):
F.scaled_dot_product_attention's forward + backward per backend, against the aten backward ops
lowprec can call with its own ``out`` and LSE (flash with GQA heads expanded, as shipped; cuDNN,
whose op takes the grouped heads as they are). Synced ms, median; gradients compared."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowprec.bench.common import synced_wall_ms


def _one_shape(b: int, h: int, hkv: int, s: int, d: int) -> None:
    from lowprec.attention.ops import attention_backward

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for n in (h, hkv, hkv))
    dout = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = d ** -0.5
    print(f"B{b} H{h}/{hkv} S{s} d{d} causal")

    def sdpa(backends):
        if backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    for name, backends in (("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("flash", [SDPBackend.FLASH_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION])):
        try:
            f = synced_wall_ms(lambda backends=backends: sdpa(backends))
            fb = synced_wall_ms(lambda backends=backends: torch.autograd.grad(sdpa(backends), (q, k, v), dout))
            print(f"  sdpa {name:9s} fwd {f:7.2f}  fwd+bwd {fb:7.2f}  bwd {fb - f:7.2f}")
        except RuntimeError as err:
            print(f"  sdpa {name:9s} unavailable: {str(err).splitlines()[0][:100]}")
    qd, kd, vd = (t.detach() for t in (q, k, v))
    r = h // hkv
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        qd, kd.repeat_interleave(r, 1), vd.repeat_interleave(r, 1), 0.0, True, False, scale=scale)[:2]
    ref = attention_backward(dout, qd, kd, vd, out, lse, True, scale)
    shipped = synced_wall_ms(lambda: attention_backward(dout, qd, kd, vd, out, lse, True, scale))
    print(f"  lowprec attention_backward (flash, K/V expanded): {shipped:7.2f}")
    try:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, True, 0.0, True, False,
                                                                 scale=scale)
        c_lse = res[1]
        print(f"  cudnn fwd lse {tuple(c_lse.shape)} {tuple(c_lse.stride())} {c_lse.dtype}; vs flash lse max diff "
              f"{(c_lse.reshape(lse.shape).float() - lse.float()).abs().max().item():.3e}")
        lse_c = lse.reshape(c_lse.shape).contiguous()

        def cudnn_bwd():
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, qd, kd, vd, out, lse_c, res[6], res[7], torch.empty(0, device="cuda"), res[2], res[3], s, s,
                0.0, True, scale=scale)

        for n_, x, y in zip("qkv", cudnn_bwd(), ref, strict=True):
            cos = F.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0).item()
            print(f"    d{n_} {tuple(x.shape)} cos to flash's {cos:.6f}")
        print(f"  cudnn backward on lowprec's out / lse, grouped heads: {synced_wall_ms(cudnn_bwd):7.2f}")
    except RuntimeError as err:
        print(f"  cudnn backward unavailable: {str(err).splitlines()[0][:160]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1,32,8,16384,128;4,32,8,4096,128;16,32,8,1024,128")
    args = p.parse_args()
    for spec in args.shapes.split(";"):
        _one_shape(*map(int, spec.split(",")))


if __name__ == "__main__":
    main()
