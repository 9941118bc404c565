"""`write_kv_cache`: scatter new tokens' keys and values into their slots of the paged KV cache."""
import torch

from .._device import kernels, use_triton

# Elements of one token's [Hkv, D] row copied per program.
WRITE_BLOCK = 1024


def _check_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_pages, page_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along the head dim")
    row = tuple(k_cache.shape[2:])
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != row:
        raise ValueError(f"k and v must both be [T, {row[0]}, {row[1]}] to match the cache, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int32 or int64 of shape ({k.shape[0]},), got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Write k, v `[T, Hkv, D]` into k_cache, v_cache `[num_pages, page_size, Hkv, D]` in place.

    slot_mapping `[T]` (int32 or int64): token i goes to page slot_mapping[i] // page_size, offset
    slot_mapping[i] % page_size. A negative slot skips the token (as in vLLM: padding tokens). Values are
    cast to the cache's dtype. Slots must be < num_pages * page_size (not checked: that would need a sync).
    """
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    if not use_triton(k):
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)
        return
    kernels("paged_attention.kernel").write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, block=WRITE_BLOCK)


def write_kv_cache_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Torch path of write_kv_cache (CPU engines, and the reference the Triton kernel is tested against)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, offset = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[page, offset] = k[keep].to(k_cache.dtype)
    v_cache[page, offset] = v[keep].to(v_cache.dtype)
