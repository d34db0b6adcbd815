"""The vLLM shared server's LoRA settings (engines/inference/vllm/shared.py): vLLM 0.32 takes only some ranks for
--max-lora-rank, so the deployment's max_lora_rank is rounded up to one of them; every tenant fits one batch."""

from __future__ import annotations

import pytest

from config.tenant import SharedConfig, SharedInferenceSettings
from engines.inference.vllm.shared import lora_flags, vllm_rank


@pytest.mark.parametrize(("rank", "served"), [(1, 1), (2, 8), (8, 8), (9, 16), (33, 64), (256, 256)])
def test_max_lora_rank_is_rounded_up_to_a_rank_vllm_accepts(rank, served):
    assert vllm_rank(rank) == served


def test_lora_flags_hold_every_tenant_and_a_replaced_adapter_each():
    settings = SharedInferenceSettings(deploy_dir="/d", shared=SharedConfig(max_tenants=3, max_lora_rank=4))
    flags = lora_flags(settings)
    assert flags == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_cpu_loras": 6}
