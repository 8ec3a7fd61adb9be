"""KVLayout: which block table and which pool plane each layer uses (core/kv_layout.py)."""
from pagedserve.core.kv_layout import KVLayout


def test_one_table_when_every_layer_sees_the_same_window():
    for w in (0, 4096):
        lay = KVLayout.of([w] * 30)
        assert (lay.windows, lay.planes, lay.layer_plane) == ((w,), 30, tuple(range(30)))
        assert set(lay.layer_group) == {0}


def test_gemma3_layers_form_equal_groups():
    """Gemma-3-4B: every 6th of 34 layers global. 5 full layers -> groups of 5 planes: one full group,
    six sliding ones (29 layers in 30 planes)."""
    windows = [0 if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    lay = KVLayout.of(windows)
    assert lay.windows == (0,) + (1024,) * 6 and lay.planes == 5 and lay.num_layers == 34
    assert [i for i in range(34) if lay.layer_group[i] == 0] == [5, 11, 17, 23, 29]
    assert [lay.layer_plane[i] for i in (5, 11, 17, 23, 29)] == [0, 1, 2, 3, 4]
    # every (group, plane) pair is one layer's at most: no two layers write the same memory
    pairs = list(zip(lay.layer_group, lay.layer_plane))
    assert len(set(pairs)) == 34
    assert all(lay.windows[g] == windows[i] for i, g in enumerate(lay.layer_group))
    assert lay.describe() == "1 full group, 6 window-1024 groups of 5 layer planes"


def test_gemma2_alternates_into_two_groups():
    lay = KVLayout.of([4096 if i % 2 == 0 else 0 for i in range(26)])
    assert lay.windows == (0, 4096) and lay.planes == 13
