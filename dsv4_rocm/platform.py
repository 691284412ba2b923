"""Which GPU this is and what follows from it (docs/platforms.md).

Detection reads ``torch.version.hip`` and ``gcnArchName`` on ROCm and the capability on CUDA; the
capability alone is never trusted (ROCm reports gfx942 as 9.4 and gfx90a as 9.0, like sm_90).

FP8 policy: the cache always holds OCP e4m3fn bytes with -0 flushed to 0x00, on every vendor.
gfx942 has only the fnuz convert, so it encodes ``x/2`` as fnuz and decodes with the scale exponent + 1;
gfx950, Hopper and Blackwell use the OCP convert directly.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DeviceProps:
    """What detection needs from a device; injectable so every arch is testable on a CPU."""
    is_rocm: bool
    gcn_arch_name: str = ""
    major: int = 0
    minor: int = 0
    name: str = ""
    shared_memory_per_block_optin: int = 0


@dataclass(frozen=True)
class Platform:
    vendor: str               # "amd" | "nvidia" | "cpu"
    arch: str                 # "gfx90a" | "gfx942" | "gfx950" | "sm_90" | "sm_100" | "sm_XY" | "cpu"
    wave_size: int            # 64 on AMD Instinct, 32 on NVIDIA, 0 on CPU
    fp8_decode: str           # how kernels read the OCP cache bytes: "ocp" | "fnuz_scale_plus_one" | "software"
    triton_fp8_dtype: Optional[str]  # Triton dtype whose hardware convert the kernels use
    shared_memory_bytes: int  # per workgroup / block (after opt-in on NVIDIA)
    has_fp8_mma: bool         # fp8 matrix instructions (MFMA fp8 / wgmma e4m3)
    device_name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def triton_target(self):
        """(backend, arch, warp size) as Triton's GPUTarget takes it, or None on CPU."""
        if self.vendor == "amd":
            return ("hip", self.arch, 64)
        if self.vendor == "nvidia":
            return ("cuda", int(self.arch[3:]), 32)
        return None


CPU = Platform("cpu", "cpu", 0, "software", None, 0, False, "cpu")

_AMD = {
    # arch: (fp8 decode, triton fp8 dtype, LDS bytes, fp8 MFMA)
    "gfx90a": ("software", None, 64 * 1024, False),
    "gfx942": ("fnuz_scale_plus_one", "fp8e4b8", 64 * 1024, True),
    "gfx950": ("ocp", "fp8e4nv", 160 * 1024, True),
}


def from_props(p: DeviceProps) -> Platform:
    """Classify a device from its properties (pure; used by ``detect`` and by tests)."""
    if p.is_rocm:
        arch = p.gcn_arch_name.split(":")[0].strip()
        if not arch.startswith("gfx"):
            raise ValueError(f"ROCm device with unreadable gcnArchName {p.gcn_arch_name!r}")
        fp8, tdt, lds, mma = _AMD.get(arch, ("software", None, 64 * 1024, False))
        return Platform("amd", arch, 64, fp8, tdt, lds, mma, p.name)
    arch = f"sm_{p.major}{p.minor}"
    smem = p.shared_memory_per_block_optin or 48 * 1024
    ocp = (p.major, p.minor) >= (8, 9)          # Ada and newer convert OCP e4m3 in hardware
    return Platform("nvidia", arch, 32, "ocp" if ocp else "software", "fp8e4nv" if ocp else None,
                    smem, p.major >= 9 or (p.major, p.minor) == (8, 9), p.name)


# the targets the kernels are written for, as their devices report themselves (shared memory after opt-in)
TARGET_PROPS = {
    "gfx942": DeviceProps(True, "gfx942", 9, 4, "MI300X"),
    "gfx950": DeviceProps(True, "gfx950", 9, 5, "MI355X"),
    "sm_90": DeviceProps(False, "", 9, 0, "H100", 232448),
    "sm_100": DeviceProps(False, "", 10, 0, "B200", 232448),
}


def target(arch: str) -> Platform:
    """The platform of a named target without its device (the AMD execution tier, ``_launch.emulate_target``)."""
    if arch not in TARGET_PROPS:
        raise ValueError(f"unknown target {arch!r}; known: {sorted(TARGET_PROPS)}")
    return from_props(TARGET_PROPS[arch])


def device_props(device: Optional[torch.device] = None) -> Optional[DeviceProps]:
    if not torch.cuda.is_available():
        return None
    idx = (device.index if device is not None and device.index is not None else torch.cuda.current_device())
    pr = torch.cuda.get_device_properties(idx)
    is_rocm = torch.version.hip is not None
    return DeviceProps(is_rocm=is_rocm, gcn_arch_name=getattr(pr, "gcnArchName", "") if is_rocm else "",
                       major=pr.major, minor=pr.minor, name=pr.name,
                       shared_memory_per_block_optin=getattr(pr, "shared_memory_per_block_optin", 0))


def detect(device=None) -> Platform:
    """The platform of ``device`` (default: the current GPU, else CPU)."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cpu":
            return CPU
    props = device_props(device)
    return CPU if props is None else from_props(props)
