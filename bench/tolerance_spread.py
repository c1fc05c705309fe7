"""How far apart two correct computations of the same gradient are, per dtype.

    .venv/bin/python bench/tolerance_spread.py [--models mlp,cnn-bn,…] [--world-size 2]

For each model and dtype, gradcheck in controlled mode (no batch statistics, no random
draws: single, DataParallel and DDP compute the same function) — what is left between
them is the order in which the sums are taken (per replica, then across replicas). The
largest relative norm error per dtype is the measured spread; gradcheck's tolerance
(``TOLERANCES``) must sit above it and below 0.1 (a 10 % error must fail).

Last line: ``tolerance / largest spread: fp32 N, bf16 N, fp16 N``.
"""

from __future__ import annotations

import argparse
import time

MODELS = (
    "mlp",
    "cnn-bn",
    "torchvision:resnet18?num_classes=10",
    "torchvision:mobilenet_v3_small?num_classes=10",
    "torchvision:convnext_tiny?num_classes=10",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    from gpudiag.checks.gradcheck import TOLERANCES, gradcheck_spec

    spread = dict.fromkeys(TOLERANCES, 0.0)
    for model in args.models.split(","):
        for dtype in TOLERANCES:
            start = time.perf_counter()
            report = gradcheck_spec(model, dtype=dtype, mode="controlled", world_size=args.world_size)
            worst = max(c.rel_norm_err for c in report.comparisons)
            spread[dtype] = max(spread[dtype], worst)
            print(
                f"{model:<50} {dtype:<5} spread {worst:.3g}  (tolerance {TOLERANCES[dtype]:.3g}, "
                f"{time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    for dtype, value in spread.items():
        print(f"largest spread {dtype}: {value:.3g}")
    print(
        "tolerance / largest spread: "
        + ", ".join(f"{d} {TOLERANCES[d] / s:.3g}" if s else f"{d} inf" for d, s in spread.items())
    )


if __name__ == "__main__":
    main()
