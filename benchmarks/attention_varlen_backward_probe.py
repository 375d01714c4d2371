"""Whether PyTorch's cuDNN attention backward takes packed variable-length sequences (the nested /
THD path: ``[total, H, D]`` with ``cum_seq``) and what LSE layout it wants, against the aten varlen
flash backward lowprec calls (GQA heads expanded). Gradients compared, synced ms."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowprec.bench.common import synced_wall_ms


def main():
    from lowprec.attention.varlen_ops import _flash_varlen_backward

    h, hkv, d = 32, 8, 128
    lens = [1000, 2000, 500, 4692]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, mx = int(cu[-1]), max(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for n in (h, hkv, hkv))
    dout = torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = d ** -0.5
    r = h // hkv
    res = torch.ops.aten._flash_attention_forward(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), cu, cu, mx,
                                                  mx, 0.0, True, False, scale=scale)
    out, lse = res[0], res[1]
    print(f"flash varlen fwd: out {tuple(out.shape)}, lse {tuple(lse.shape)} {lse.dtype}")
    ref = _flash_varlen_backward(dout, q, k, v, out, lse, cu, cu, mx, mx, True, scale)
    shipped = synced_wall_ms(lambda: _flash_varlen_backward(dout, q, k, v, out, lse, cu, cu, mx, mx, True, scale))
    print(f"lowprec varlen backward (flash, K/V expanded): {shipped:.2f} ms")
    for dtype in (torch.int32, torch.int64):
        try:
            c = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu.to(dtype), cu.to(dtype), mx, mx, True, 0.0,
                                                        True, False, scale=scale)
            c_lse = c[1]
            print(f"cudnn nested fwd (cum {dtype}): out {tuple(c[0].shape)} cos to flash "
                  f"{F.cosine_similarity(c[0].float().flatten(), out.float().flatten(), dim=0).item():.6f}; "
                  f"lse {tuple(c_lse.shape)} {tuple(c_lse.stride())} {c_lse.dtype}")
            cands = {"lse as returned by cudnn": c_lse}
            for name, x in (("flash lse [H,total] -> [total,H,1]", lse.t().reshape(total, h, 1)),
                            ("flash lse [H,total] -> [H,total,1]", lse.reshape(h, total, 1))):
                if x.shape == c_lse.shape:
                    cands[name] = x.contiguous()
            for name, lx in cands.items():
                def bwd(lx=lx, dtype=dtype, c=c):
                    return torch.ops.aten._cudnn_attention_backward(
                        dout, q, k, v, out, lx, c[6], c[7], None, cu.to(dtype), cu.to(dtype), mx, mx, 0.0, True,
                        scale=scale)
                try:
                    got = bwd()
                    cos = [F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()
                           for a, b in zip(got, ref, strict=True)]
                    print(f"  cudnn nested bwd, {name}: cos dq/dk/dv {cos[0]:.6f} {cos[1]:.6f} {cos[2]:.6f}; "
                          f"{synced_wall_ms(bwd):.2f} ms")
                except RuntimeError as err:
                    print(f"  cudnn nested bwd, {name}: {str(err).splitlines()[0][:200]}")
        except RuntimeError as err:
            print(f"cudnn nested fwd (cum {dtype}): {str(err).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
