"""What a 1-D convolution costs through cuDNN by memory layout (H100 question: the flow's and HiFT's
convolutions run cuDNN's NHWC kernels behind two layout transforms each, one of them the weight's).

For shapes the flow (bf16) and HiFT (fp32, TF32) use, times one call (CUDA events, back-to-back)
and counts its kernels, for:
  ncl        F.conv1d on a contiguous (B, C, L) input and the module's weight (today)
  nlc_input  F.conv1d on an input stored (B, L, C) (a transposed view, as the flow's resnets get it)
  cl_weight  F.conv2d on the contiguous input viewed (B, C, 1, L), the weight kept channels-last once
  nhwc_2d    F.conv2d on the input viewed (B, C, 1, L) stored channels-last, with the weight kept
             channels-last once (B, C, L views of (B, L, C) storage in, the same out)
and checks each variant's output against the first.

    python bench/bench_conv_layout.py --out $OUT/conv_layout.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import replay_ms
from bench.report_file import write_report

# (name, dtype, batch, in channels, out channels, kernel, dilation, length)
SHAPES = [
    ("flow resnet conv, first chunk", torch.bfloat16, 2, 256, 256, 3, 1, 114),
    ("flow resnet conv, 8 later chunks", torch.bfloat16, 16, 256, 256, 3, 1, 114),
    ("hift stage 1, 1 row", torch.float32, 1, 256, 256, 7, 3, 56 * 8),
    ("hift stage 3, 1 row", torch.float32, 1, 64, 64, 11, 5, 56 * 120),
    ("hift stage 3, 8 rows", torch.float32, 8, 64, 64, 11, 5, 108 * 120),
]


def kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _variants(x, x_nlc, w, w_cl, bias, pad: int, d: int) -> dict:
    return {
        "ncl": lambda: F.conv1d(x, w, bias, padding=pad, dilation=d),
        "nlc_input": lambda: F.conv1d(x_nlc, w, bias, padding=pad, dilation=d),
        "cl_weight": lambda: F.conv2d(x.unsqueeze(2), w_cl, bias, padding=(0, pad), dilation=(1, d)).squeeze(2),
        "nhwc_2d": lambda: F.conv2d(x_nlc.unsqueeze(2), w_cl, bias, padding=(0, pad), dilation=(1, d)).squeeze(2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default: bench/results/conv_layout_<date>_h100.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_conv_layout: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for name, dtype, b, cin, cout, k, d, length in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(b, cin, length, device="cuda", dtype=dtype, generator=gen)
        w = torch.randn(cout, cin, k, device="cuda", dtype=dtype, generator=gen) / (cin * k) ** 0.5
        bias = torch.randn(cout, device="cuda", dtype=dtype, generator=gen) * 0.01
        pad = d * (k - 1) // 2
        x_nlc = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, L, C) storage
        w_cl = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        variants = _variants(x, x_nlc, w, w_cl, bias, pad, d)
        row = {"shape": name, "dtype": str(dtype), "batch": b, "in": cin, "out": cout, "kernel": k, "dilation": d,
               "length": length}
        with torch.inference_mode():
            ref = variants["ncl"]().float()
            for variant, fn in variants.items():
                out = fn()
                row[f"{variant}_ms"] = replay_ms(fn, iters=50)
                row[f"{variant}_kernels"] = kernels(fn)
                row[f"{variant}_max_rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                row[f"{variant}_out_strides"] = list(out.stride())
        rows.append(row)
        print(f"{name:34s} " + "  ".join(f"{v} {row[f'{v}_ms'] * 1e3:7.1f} us {row[f'{v}_kernels']} k "
                                         f"(err {row[f'{v}_max_rel_err']:.1e})" for v in variants), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "shapes": rows}
    write_report(report, args.out, "conv_layout", "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
