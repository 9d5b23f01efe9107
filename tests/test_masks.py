"""engine.runtime.masks: the one causal mask of Velox's own attention paths equals mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from engine.runtime.masks import apply_attention_mask, named_mask


@pytest.mark.parametrize(("n_queries", "offset"), [(1, 0), (1, 9), (4, 0), (5, 7)])
def test_named_causal_mask_equals_mlx_lm(n_queries: int, offset: int) -> None:
    n_keys = offset + n_queries
    assert mx.array_equal(named_mask("causal", offset, n_queries, n_keys), create_causal_mask(n_queries, offset))


def test_rows_of_the_causal_mask_are_rows_of_the_whole_mask() -> None:
    whole = named_mask("causal", 6, 10, 16)
    assert mx.array_equal(named_mask("causal", 6 + 3, 4, 16), whole[3:7])


def test_an_unknown_mask_name_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown attention mask 'sliding'"):
        named_mask("sliding", 0, 2, 2)


def test_causal_by_name_boolean_and_additive_masks_agree() -> None:
    scores = mx.random.normal((1, 2, 3, 4, 9))  # [B, n_kv_heads, repeats, L, N]
    boolean = create_causal_mask(4, offset=5)
    additive = mx.where(boolean, 0.0, -1e9)
    by_name = apply_attention_mask(scores, "causal", 4, 6)
    assert mx.array_equal(apply_attention_mask(scores, boolean, 4, 6), by_name)
    assert mx.allclose(mx.softmax(apply_attention_mask(scores, additive, 4, 6), axis=-1), mx.softmax(by_name, axis=-1))
    assert mx.array_equal(apply_attention_mask(scores, None, 4, 6), scores)
