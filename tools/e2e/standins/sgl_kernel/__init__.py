"""``sgl_kernel`` for the H200 end-to-end harness: the few kernels a tiny DeepSeek-V4 + DSpark at
TP1 reaches, as torch or in-tree JIT/Triton equivalents; every other name is the import-only
stand-in (calling it raises, naming it). A test harness, never product: users install upstream's
real ``sglang-kernel``, which does not load on the test machine's torch.
"""

from __future__ import annotations

import torch
from _importonly_standin import standin

standin(__name__, globals())


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()).to(
        input.dtype
    )
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, as sgl_kernel's: ``residual += input``; ``input = rmsnorm(residual)``."""
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def moe_sum_reduce(input, output, routed_scaling_factor=1.0):
    torch.sum(input, dim=1, out=output)
    output.mul_(routed_scaling_factor)


def moe_align_block_size(
    topk_ids,
    num_experts,
    block_size,
    sorted_token_ids,
    expert_ids,
    num_tokens_post_pad,
    cumsum_buffer,
    pad_sorted_token_ids=False,
    ignore_invalid_expert=False,
):
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size as jit

    jit(
        topk_ids,
        num_experts,
        block_size,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad,
        cumsum_buffer,
        pad_sorted_token_ids,
        map_invalid_experts_to_sentinel=ignore_invalid_expert,
    )


def weak_ref_tensor(tensor):
    """A tensor over ``tensor``'s memory that does not keep it alive (as sgl_kernel's)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        return tensor
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(),
        tensor.device,
        tensor.untyped_storage().nbytes(),
    )
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def silu_and_mul(input, out=None):
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d].float()) * input[..., d:].float()
    if out is None:
        return y.to(input.dtype)
    out.copy_(y)
    return out
