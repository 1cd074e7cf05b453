"""MXFP4 as the published checkpoints store it, for the fixture and training scripts (torch).

blocks U8 [..., N, K/32, 16]: byte j of a group holds element 2j in the low nibble and 2j+1 in the
high nibble; an element is an E2M1 code (bit 3 = sign); scales U8 [..., N, K/32] are E8M0 exponents:
W[n, k] = E2M1(code) * 2^(scale - 127). Quantization takes the group's scale from its largest
magnitude (the largest E2M1 value is 6 = 1.5 * 2^2) and rounds to the nearest code.
"""
import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w):
    """w [..., N, K] float -> (blocks U8 [..., N, K/32, 16], scales U8 [..., N, K/32])."""
    *lead, n, k = w.shape
    assert k % 32 == 0, (n, k)
    g = w.float().reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    x = g / torch.exp2(e).unsqueeze(-1)
    mag = x.abs().clamp(max=6.0)
    idx = (mag.unsqueeze(-1) - E2M1).abs().argmin(-1)
    code = (idx | (((x < 0) & (idx > 0)).long() << 3)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (e + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequant_mxfp4(blocks, scales):
    """(blocks, scales) as above -> float32 [..., N, K]."""
    lo = (blocks & 0x0F).long()
    hi = (blocks >> 4).long()
    codes = torch.stack([lo, hi], -1).reshape(*blocks.shape[:-1], 32)
    mag = E2M1[codes & 7]
    val = torch.where(codes >= 8, -mag, mag)
    val = val * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return val.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
