"""The expert-parallel forward of a sparse MoE block (torchtitan's all-to-all dispatcher, the local experts on
their chunks, combine) against the block's own loop over experts, on a 1-rank gloo `ep` mesh: same output
and same gradients, with an expert that no token reaches; and the placeholders keep the global names."""

from __future__ import annotations

import copy

import pytest
import torch

from engines.models.moe import Routing, SparseMoeBlock
from engines.trainer.expert_parallel import Elsewhere, Exchange, is_expert_param


@pytest.fixture(scope="module")
def ep_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from engines.trainer import compat

    compat.torchtitan_on_cpu()
    from torchtitan.distributed import utils as tt_dist

    tt_dist.set_spmd_backend("partial_dtensor")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def test_dispatched_experts_match_the_loop_over_experts(ep_mesh):
    torch.manual_seed(0)
    plain = SparseMoeBlock(16, 24, num_experts=4, top_k=2, norm_topk_prob=True, index=0)
    ep = copy.deepcopy(plain)
    ep.exchange = Exchange(4, 2, ep_mesh, range(4))
    x = torch.randn(2, 5, 16)
    replay = torch.empty((2, 5, 1, 2), dtype=torch.long)  # router replay of every token (gate weights recomputed)
    replay[0, :, 0] = torch.tensor([0, 1])
    replay[1, :, 0] = torch.tensor([2, 0])  # expert 3 gets no token
    outs = []
    for block in (plain, ep):
        xi = x.clone().requires_grad_()
        y = block(xi, Routing(replay=replay))
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}))
    (y1, gx1, g1), (y2, gx2, g2) = outs
    assert g1["experts.3.up_proj.weight"] is None and g1["experts.2.up_proj.weight"] is not None
    torch.testing.assert_close(y2, y1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx2, gx1, rtol=1e-6, atol=1e-7)
    for name, grad in g1.items():
        if grad is None:  # an expert no token reached: called on an empty chunk under EP, a zero gradient
            assert g2[name] is not None and not g2[name].any(), name
        else:
            torch.testing.assert_close(g2[name], grad, rtol=1e-5, atol=1e-7)
    assert ep.routed.tolist() == [10, 5, 5, 0]  # every (token, slot) assignment counted once, on its expert


def test_placeholders_keep_the_global_names_of_the_local_experts():
    block = SparseMoeBlock(8, 8, num_experts=4, top_k=2, norm_topk_prob=True, index=0)
    block.experts[0], block.experts[1] = Elsewhere(0), Elsewhere(0)
    names = [n for n in block.state_dict() if n.startswith("experts.")]
    assert {n.split(".")[1] for n in names} == {"2", "3"}
    assert is_expert_param("model.layers.0.mlp.experts.3.up_proj.weight")
    assert not is_expert_param("model.layers.0.mlp.gate.weight")
