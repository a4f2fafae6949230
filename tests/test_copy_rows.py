"""ops.copy_rows (cq_copy_rows): dst = src byte for byte for views whose last dim is contiguous; on
CUDA through the copy engines, as the Ulysses exchange uses it (cquant.ulysses)."""

import pytest
import torch

from cquant import ops

# (shape, how src and dst are cut from larger buffers): 1 to 4 dims, rows apart, outer dims transposed
VIEWS = [
    ((7,), lambda t: t[3:10]),
    ((5, 9), lambda t: t[:, 2:11]),
    ((3, 1, 8), lambda t: t[:, :, 4:12]),
    ((2, 6, 16), lambda t: t[:, :, 8:24].transpose(0, 1)),
    ((2, 3, 5, 12), lambda t: t[:, :, :, 4:16].transpose(1, 2)),
    ((2, 4, 3, 8), lambda t: t.transpose(0, 2)[..., :8]),
]


def _case(shape, cut, device, dtype, gen):
    big = [s + 2 for s in shape[:-1]] + [shape[-1] + 16]
    src_buf = torch.randn(*big, generator=gen).to(dtype).to(device)
    dst_buf = torch.zeros(*big, dtype=dtype, device=device)
    src, dst = cut(src_buf), cut(dst_buf)
    src, dst = src[tuple(slice(0, n) for n in src.shape)], dst[tuple(slice(0, n) for n in dst.shape)]
    return src_buf, dst_buf, src, dst


def _expected(dst_buf, dst, src):
    want = dst_buf.clone()
    # the same view of the clone: dst's offset and strides in dst_buf
    torch.as_strided(want, dst.shape, dst.stride(), dst.storage_offset()).copy_(src)
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("view", range(len(VIEWS)))
def test_copy_rows_cpu(view, dtype):
    shape, cut = VIEWS[view]
    gen = torch.Generator().manual_seed(view)
    src_buf, dst_buf, src, dst = _case(shape, cut, "cpu", dtype, gen)
    want = _expected(dst_buf, dst, src)
    assert ops.copy_rows(src, dst) is dst
    assert torch.equal(dst_buf, want)  # the view's bytes, nothing around them


def test_copy_rows_refuses():
    x = torch.randn(4, 8)
    cases = [
        (x, torch.zeros(4, 9), ValueError, "dst has shape"),
        (x, torch.zeros(4, 8, dtype=torch.float64), TypeError, "expected the same dtype"),
        (x[:, ::2], torch.zeros(4, 4), ValueError, "last dim"),
        (x, x, ValueError, "overlaps src"),
        (torch.randn(1, 2, 3, 4, 5), torch.zeros(1, 2, 3, 4, 5), ValueError, "1 to 4"),
        (x, torch.zeros(8).expand(4, 8), ValueError, "rows"),
        (torch.zeros(8).expand(4, 8), torch.zeros(4, 8), ValueError, "rows"),
        (torch.randn(0, 8), torch.zeros(0, 8), ValueError, "zero-size"),
    ]
    for src, dst, error, words in cases:
        with pytest.raises(error, match=words):
            ops.copy_rows(src, dst)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("view", range(len(VIEWS)))
def test_copy_rows_cuda(view):
    """The copy engines' copy of each view, on a side stream and replayed from a CUDA graph."""
    shape, cut = VIEWS[view]
    gen = torch.Generator().manual_seed(view)
    src_buf, dst_buf, src, dst = _case(shape, cut, "cuda", torch.bfloat16, gen)
    want = _expected(dst_buf, dst, src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.copy_rows(src, dst)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(dst_buf, want)
    dst_buf.zero_()
    want = _expected(dst_buf, dst, src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.copy_rows(src, dst)
    src_buf.add_(1)  # the replay copies what src holds then
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst_buf, _expected(want, dst, src))
