"""Geometry of fp8_ds_mla pages, model configs, platform detection for every arch (injected props)."""
import pytest

from dsv4_rocm import layout as L
from dsv4_rocm.config import V4_FLASH, V4_PRO, AttentionConfig, LayerType, tiny_config
from dsv4_rocm.platform import CPU, DeviceProps, from_props


def test_page_geometry_matches_vllm_buckets():
    assert L.TOKEN_BYTES == 584 and L.DATA_BYTES == 576
    assert L.page_bytes(64) == 37440          # SWA and C4
    assert L.page_bytes(2) == 1728            # C128
    assert L.indexer_page_bytes(64) == 8640   # C4 indexer K
    for bs in (1, 2, 3, 7, 64, 100, 256):
        assert L.page_bytes(bs) % 576 == 0 and L.page_bytes(bs) >= bs * 584
    assert L.scale_offset(64) == 64 * 576


def test_slot_offsets():
    assert L.slot_id(3, 5, 64) == 197
    assert L.split_slot(197, 64) == (3, 5)
    data, scal = L.token_byte_offsets(197, 64)
    assert data == 3 * 37440 + 5 * 576 and scal == 3 * 37440 + 64 * 576 + 5 * 8
    with pytest.raises(ValueError, match="offset"):
        L.slot_id(0, 64, 64)
    with pytest.raises(ValueError, match="invalid"):
        L.split_slot(-1, 64)
    with pytest.raises(ValueError, match="block_size"):
        L.page_bytes(0)
    assert L.compressed_block_size(4) == 64 and L.compressed_block_size(128) == 2
    with pytest.raises(ValueError):
        L.compressed_block_size(8)


def test_presets_layer_types():
    f = V4_FLASH
    assert f.layer_type(0) == f.layer_type(1) == LayerType.SWA
    assert f.layer_type(2) == LayerType.C4 and f.layer_type(3) == LayerType.C128
    assert f.layer_type(42) == LayerType.C4
    assert f.layer_type(43) == LayerType.SWA          # MTP
    assert sum(f.layer_type(i) == LayerType.C4 for i in range(43)) == 21
    assert sum(f.layer_type(i) == LayerType.C128 for i in range(43)) == 20
    p = V4_PRO
    assert p.layer_type(0) == p.layer_type(1) == LayerType.C128
    assert sum(p.layer_type(i) == LayerType.C128 for i in range(61)) == 31
    assert sum(p.layer_type(i) == LayerType.C4 for i in range(61)) == 30
    assert f.padded_heads == 64 and p.padded_heads == 128 and p.with_tp(2).padded_heads == 64
    assert f.rope_base(LayerType.SWA) == 10000 and f.rope_base(LayerType.C4) == 160000
    assert f.softmax_scale == pytest.approx(0.044194173824159216)


def test_from_hf_config_round_trip_and_errors():
    hf = {"hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "q_lora_rank": 1024,
          "o_lora_rank": 1024, "o_groups": 8, "index_topk": 512, "compress_ratios": list(V4_FLASH.compress_ratios),
          "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1}, "sliding_window": 128}
    c = AttentionConfig.from_hf_config(hf, tp_size=8, name="v4-flash")
    assert c.local_heads == 8 and c.local_groups == 1 and c.layer_type(3) == LayerType.C128
    with pytest.raises(ValueError, match="lacks"):
        AttentionConfig.from_hf_config({"hidden_size": 1})
    with pytest.raises(ValueError, match="tp_size"):
        AttentionConfig.from_hf_config(hf, tp_size=3)
    with pytest.raises(ValueError, match="head_dim"):
        AttentionConfig.from_hf_config(dict(hf, head_dim=576))
    assert tiny_config().local_heads == 8


@pytest.mark.parametrize("props, arch, vendor, wave, fp8, tdt", [
    (DeviceProps(True, "gfx942:sramecc+:xnack-", 9, 4), "gfx942", "amd", 64, "fnuz_scale_plus_one", "fp8e4b8"),
    (DeviceProps(True, "gfx950:sramecc+:xnack-", 9, 5), "gfx950", "amd", 64, "ocp", "fp8e4nv"),
    (DeviceProps(True, "gfx90a:sramecc+:xnack-", 9, 0), "gfx90a", "amd", 64, "software", None),
    (DeviceProps(False, "", 9, 0, "H100", 232448), "sm_90", "nvidia", 32, "ocp", "fp8e4nv"),
    (DeviceProps(False, "", 10, 0, "B200", 232448), "sm_100", "nvidia", 32, "ocp", "fp8e4nv"),
    (DeviceProps(False, "", 8, 0, "A100", 166912), "sm_80", "nvidia", 32, "software", None),
])
def test_platform_from_injected_props(props, arch, vendor, wave, fp8, tdt):
    p = from_props(props)
    assert (p.arch, p.vendor, p.wave_size, p.fp8_decode, p.triton_fp8_dtype) == (arch, vendor, wave, fp8, tdt)


def test_platform_never_trusts_capability_alone():
    # gfx90a reports capability (9, 0) like Hopper: the ROCm flag decides
    assert from_props(DeviceProps(True, "gfx90a", 9, 0)).vendor == "amd"
    assert from_props(DeviceProps(False, "", 9, 0)).vendor == "nvidia"
    assert from_props(DeviceProps(True, "gfx942", 9, 4)).shared_memory_bytes == 64 * 1024
    assert from_props(DeviceProps(True, "gfx942", 9, 4)).triton_target == ("hip", "gfx942", 64)
    assert from_props(DeviceProps(False, "", 9, 0)).triton_target == ("cuda", 90, 32)
    assert CPU.triton_target is None and not CPU.is_gpu
    with pytest.raises(ValueError, match="gcnArchName"):
        from_props(DeviceProps(True, "", 9, 4))
