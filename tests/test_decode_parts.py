"""The rule that picks the decode graphs captured in two parts, and each part's programs' order
(engine/decode_parts.py); the parts' tokens are checked against transformers in tests/test_graphs_on_cpu.py and,
on a GPU, tests/test_gpu.py."""

from __future__ import annotations

import pytest

from minisgl.attention.triton_backend import TritonAttnBackend
from minisgl.engine.decode_parts import attention_matcher, part_split


@pytest.mark.parametrize(
    "bs, parts_from, split",
    [
        (256, 64, 128),
        (64, 64, 32),
        (48, 64, 0),
        (200, 64, 96),
        (16, 16, 8),
        (8, 8, 0),
        (256, 0, 0),
        (40, 16, 16),
    ],
)
def test_part_split(bs: int, parts_from: int, split: int) -> None:
    assert part_split(bs, parts_from) == split
    if split:
        assert split % 8 == 0 and 0 < split <= bs - split


def test_each_part_is_ordered_over_its_own_rows() -> None:
    lens = [5, 9, 1, 7, 3, 8]
    assert TritonAttnBackend.order_row(lens) == [1, 5, 3, 0, 4, 2]
    # the first part rows 0-2 (9, 5, 1), the second rows 3-5 as 0-2 of their own (8, 7, 3)
    assert TritonAttnBackend.order_row(lens, 3) == [1, 0, 2, 2, 0, 1]


def test_only_decode_attention_waits_behind_the_others() -> None:
    high = attention_matcher()
    for low in ("_decode_kernel", "_decode_merge_kernel", "decode_tc_bf16_g2_t64", "decode_fp8_g4_s1"):
        assert not high(low)
    for name in ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "_rope_kernel", "_silu_and_mul_kernel"):
        assert high(name)
