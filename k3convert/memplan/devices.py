"""Device memory budgets: the published capacities and ``--device-mem``."""

from __future__ import annotations

from ..errors import ConfigError
from ..units import parse_size

#: published memory per device, in bytes (vendors state decimal GB: 1 GB = 10^9 bytes;
#: what the driver reports is usually a little less, and serving engines reserve some)
DEVICES: dict[str, int] = {
    # NVIDIA A100 80GB: 80 GB HBM2e (https://www.nvidia.com/en-us/data-center/a100/)
    "a100": 80 * 10**9,
    # NVIDIA H100 SXM: 80 GB HBM3 (https://www.tweaktown.com/news/86032/nvidia-h100-sxm-in-
    # the-flesh-4nm-hopper-gpu-80gb-hbm3-memory/index.html; H100 vs H200 table at
    # https://lzwjava.github.io/nvidia-h200-gpu-specs-en)
    "h100": 80 * 10**9,
    # NVIDIA H200: 141 GB HBM3e (https://www.saulelectric.com/nvidia-h200.html,
    # https://www.aiminingco.com/gpu/h200/specs)
    "h200": 141 * 10**9,
    # NVIDIA B200 as shipped in DGX / HGX B200: 8 GPUs "provide 1,440 GB total GPU memory",
    # 180 GB each (https://docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html);
    # the package is often quoted at 192 GB (https://glennklockwood.com/garden/processors/B200)
    "b200": 180 * 10**9,
    # AMD Instinct MI300X: 192 GB HBM3 (https://aiwiki.ai/wiki/amd_instinct_mi300x,
    # https://www.jaredwatkins.com/research/ai-accelerators/amd-instinct/mi300-series/)
    "mi300x": 192 * 10**9,
    # AMD Instinct MI325X: 256 GB HBM3E as shipped (announced with up to 288 GB)
    # (https://aiwiki.ai/wiki/amd_instinct_mi325x, https://yobitel.com/knowledge-base/amd-mi325x)
    "mi325x": 256 * 10**9,
    # Moore Threads MTT S5000: 80 GB, 1.6 TB/s, disclosed in February 2026
    # (https://rutab.net/b/hardware/2026/02/12/novyy-kitayskiy-gpu-mtt-s5000-vpervye-
    # predstavlen-80-gb-pamyati-i-1-petaflops-dlya-konkurencii-s-nvidia-h100.html,
    # https://www.ldeepai.com/tech-hub/moore-threads-mtt-s5000-1000-tflops-fp8-gpu/)
    "mtt-s5000": 80 * 10**9,
}


def device_budget(device_mem: str | int | None, device: str | None) -> tuple[int | None, str]:
    """(bytes, label) of the memory per device; (None, '') when neither is given."""
    if device_mem is not None and device is not None:
        raise ConfigError("give --device-mem SIZE or --device NAME, not both.")
    if device is not None:
        key = device.strip().lower()
        if key not in DEVICES:
            raise ConfigError(
                f"--device '{device}' is not known; known devices: {', '.join(DEVICES)} "
                f"(or give --device-mem SIZE, e.g. 141GB)."
            )
        return DEVICES[key], f"{key} ({DEVICES[key] / 1e9:g} GB)"
    if device_mem is not None:
        n = parse_size(device_mem)
        return n, f"{device_mem}".strip()
    return None, ""
