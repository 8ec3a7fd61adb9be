"""The KV pool is zeroed memory whose pages are touched only as blocks are written: a pool sized for the
host (GiBs) costs RSS for what requests use, not for its size (torch.zeros wrote every byte at start-up)."""
import torch

from pagedserve.runner.model_runner import _untouched_zeros


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_pool_is_zeroed_aligned_and_untouched_until_written():
    before = _rss_bytes()
    t = _untouched_zeros((2, 4096, 16, 8, 64), torch.bfloat16)           # 1 GiB
    assert t.shape == (2, 4096, 16, 8, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert _rss_bytes() - before < 64 * 2**20                           # not paid up front
    t[1, 17].fill_(1.5)                                                  # one block written: its pages only
    assert _rss_bytes() - before < 64 * 2**20
    assert t[1, 17].eq(1.5).all() and not t[0].any() and not t[1, 18].any()     # zeros where never written
