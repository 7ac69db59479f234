"""Peak dense throughput of common GPUs, for model FLOPs utilisation (MFU).

MFU is the model's training FLOPs per second divided by what the devices could
do at most. The numbers are the vendors' data-sheet figures for dense math
(without the 2:4 sparsity that doubles some published numbers), in TFLOP/s
per GPU. A GPU not listed gets no MFU unless ``peak_tflops`` is given; CPUs
have no such figure here. Pure: no torch.
"""

from __future__ import annotations

# (name fragment, {math: TFLOP/s}); the first fragment found in the device's
# name wins, so more specific names stand first.
PEAK_TFLOPS = (
    ("H200 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "tf32": 494.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def math_kind(precision: str, tf32: bool) -> str:
    """Which peak applies: bf16 tensor cores, TF32 tensor cores, or plain float32."""
    if precision == "bf16":
        return "bf16"
    return "tf32" if tf32 else "fp32"


def peak_tflops(device_name: str, precision: str = "fp32", tf32: bool = False) -> float | None:
    """The data-sheet peak of one device of this name for this math, or None if unknown."""
    for fragment, peaks in PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks[math_kind(precision, tf32)]
    return None
