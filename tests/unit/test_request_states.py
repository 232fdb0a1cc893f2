"""The CPU stand-ins for the V2 runner's Triton kernels (issue #45, engine/request_states.py):
they make the stores the kernels make, addressed as the kernels address them.

The lab's environment has no torch: the tensors here are numpy arrays behind the three tensor
methods the stand-ins call (``numpy``, ``tolist``, ``data_ptr``). The release's own
``RequestState`` / ``BlockTables`` driving them run in tests/integration/test_request_states.py."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_repro.engine.request_states import _CpuApplyWrite, _CpuPostUpdate


class T:
    """A tensor stand-in over a numpy array (shares its memory, as ``Tensor.numpy()``)."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def numpy(self):
        return self.a

    def tolist(self):
        return self.a.tolist()

    def data_ptr(self):
        return self.a.__array_interface__["data"][0]

    def __getitem__(self, key):
        return T(self.a[key])


def i32(x):
    return T(np.array(x, dtype=np.int32))


def test_staged_writes_land_at_row_and_column_through_the_row_stride():
    out = np.zeros((3, 4), dtype=np.int32)
    kernel = _CpuApplyWrite()
    # row 2 from column 1: [7, 8]; row 0 from column 0: [5]; row 1 from column 3: [1, 2]
    # (past row 1's end: the kernel's stores go on into row 2, as on the GPU)
    kernel[(3, 1)](T(out), 4, i32([2, 0, 1]), i32([1, 0, 3]), i32([7, 8, 5, 1, 2]),
                   i32([2, 3, 5]), None, BLOCK_SIZE=1024, MULTI_GROUP=False)
    assert out.tolist() == [[5, 0, 0, 0], [0, 0, 0, 1], [2, 7, 8, 0]]


def test_a_store_outside_the_tensor_raises_where_the_gpu_would_fault():
    out = np.zeros((2, 3), dtype=np.int32)
    with pytest.raises(RuntimeError, match="falls outside the tensor"):
        _CpuApplyWrite()[(1, 1)](T(out), 3, i32([1]), i32([2]), i32([4, 4]), i32([2]), None,
                                 MULTI_GROUP=False)


def test_multi_group_writes_find_their_tensors_by_data_pointer():
    a = np.zeros((2, 3), dtype=np.int32)
    b = np.zeros((2, 5), dtype=np.int32)
    kernel = _CpuApplyWrite()
    ta, tb = T(a), T(b)
    kernel.register(ta)
    kernel.register(tb)
    ptrs = T(np.array([ta.data_ptr(), tb.data_ptr()], dtype=np.uint64))
    strides = T(np.array([3, 5], dtype=np.int64))
    kernel[(2, 1)](ptrs, strides, i32([1, 0]), i32([0, 2]), i32([9, 6, 7]), i32([1, 3]),
                   i32([0, 1]), MULTI_GROUP=True)
    assert a.tolist() == [[0, 0, 0], [9, 0, 0]]
    assert b.tolist() == [[0, 0, 6, 7, 0], [0, 0, 0, 0, 0]]
    unknown = T(np.array([12345], dtype=np.uint64))
    with pytest.raises(RuntimeError, match="no registered tensor"):
        kernel[(1, 1)](unknown, strides, i32([0]), i32([0]), i32([1]), i32([1]), i32([0]),
                       MULTI_GROUP=True)


def test_post_update_advances_the_sampled_rows_and_skips_negative_slots():
    computed = np.array([10, 20, 30], dtype=np.int32)
    last = np.zeros((3, 1), dtype=np.int64)
    total = np.array([4, 6, 8], dtype=np.int32)
    tokens = np.zeros((3, 12), dtype=np.int32)
    # batch rows: slot 2 (a decode with 2 drafts: 3 scheduled, 2 sampled, 1 rejected),
    # slot 0 (a partial prefill chunk of 5: nothing sampled or rejected), a left-out row (-1)
    sampled = T(np.array([[41, 42, 0], [0, 0, 0], [9, 9, 9]], dtype=np.int64))
    _CpuPostUpdate()[(3,)](T(np.array([2, 0, -1])), T(computed), T(last), None, 0, sampled, 3,
                           i32([2, 0, 1]), i32([1, 0, 0]), i32([0, 3, 8, 9]), T(tokens), 12,
                           T(total), None, None, 0, num_warps=1)
    assert computed.tolist() == [15, 20, 32]  # + query length - rejected
    assert total.tolist() == [4, 6, 10]
    assert last[:, 0].tolist() == [0, 0, 42]
    assert tokens[2, 8:10].tolist() == [41, 42] and not tokens[0].any() and not tokens[1].any()
