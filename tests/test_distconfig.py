"""distconfig: layouts against torch's own shard arithmetic, and every user-facing error."""

import math
import pickle
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import placement_types as tp
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from hotswitch.distconfig import (
    GRAMMAR,
    DistConfig,
    Layout,
    Mesh,
    Partial,
    Replicate,
    Shard,
    Topology,
    from_torch,
    parse_configs,
    to_torch,
)
from tests.distributed import scaled

# ---------------------------------------------------------------- placements


def test_placement_reprs_and_kinds():
    assert [repr(p) for p in (Shard(0), Replicate(), Partial())] == ["Shard(0)", "Replicate()", "Partial(sum)"]
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("max").is_partial() and not Partial().is_replicate()
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and hash(Replicate()) == hash(Replicate())


@pytest.mark.parametrize("p", [Shard(0), Shard(-1), Replicate(), Partial(), Partial("avg"), Partial("max")])
def test_placement_torch_round_trip(p):
    t = to_torch(p)
    assert isinstance(t, (tp.Shard, tp.Replicate, tp.Partial))
    assert from_torch(t) == p


def test_placement_errors():
    with pytest.raises(ValueError, match="needs an int tensor dim"):
        Shard(1.0)
    with pytest.raises(ValueError, match="not a c10d reduction"):
        Partial("mean")
    with pytest.raises(ValueError, match="to_torch expects"):
        to_torch("S(0)")
    with pytest.raises(ValueError, match="from_torch expects"):
        from_torch(3)
    with pytest.raises(ValueError, match="no distconfig equivalent"):
        from_torch(tp._StridedShard(0, split_factor=2))


# ---------------------------------------------------------------- mesh


def test_mesh_from_shape_is_row_major():
    m = Mesh.from_shape((2, 3), ("dp", "tp"), [10, 11, 12, 13, 14, 15])
    assert (m.shape, m.ndim, m.size) == ((2, 3), 2, 6)
    assert m.devices == (10, 11, 12, 13, 14, 15)
    np.testing.assert_array_equal(m.as_array(), [[10, 11, 12], [13, 14, 15]])
    assert m.axis_size("tp") == 3 and m.axis_index("tp") == 1 and m.axis_index(-2) == 0
    assert m.coordinate(14) == (1, 1)
    assert m.axis_groups("tp") == ((10, 11, 12), (13, 14, 15))
    assert m.axis_groups("dp") == ((10, 13), (11, 14), (12, 15))
    assert m == Mesh([[10, 11, 12], [13, 14, 15]], ("dp", "tp"))
    assert pickle.loads(pickle.dumps(m)) == m


def test_mesh_coordinates_match_coordinate():
    m = Mesh.from_shape((2, 3, 2), ("a", "b", "c"), list(range(100, 112))[::-1])
    assert [tuple(r) for r in m.coordinates()] == [m.coordinate(d) for d in m.devices]


@pytest.mark.parametrize("shape", [(4,), (2, 3), (2, 3, 4), (3, 1, 2)])
def test_mesh_axis_groups_match_torch_device_mesh(shape):
    from torch.distributed._mesh_layout import _MeshLayout  # what DeviceMesh builds its groups from

    devices = list(np.random.default_rng(0).permutation(50)[: math.prod(shape)])
    m = Mesh.from_shape(shape, tuple("abc"[: len(shape)]), devices)
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    layout = _MeshLayout.from_sizes_strides(shape, strides)
    for axis in range(len(shape)):
        groups = _MeshLayout([layout[axis]]).remap_to_tensor(torch.tensor(devices)).tolist()
        assert m.axis_groups(axis) == tuple(map(tuple, groups))


def test_mesh_errors():
    with pytest.raises(ValueError, match="rectangular"):
        Mesh([[0, 1], [2]], ("a", "b"))
    with pytest.raises(ValueError, match="one name per axis"):
        Mesh([[0, 1], [2, 3]], ("a",))
    with pytest.raises(ValueError, match="distinct non-empty strings"):
        Mesh([[0, 1], [2, 3]], ("a", "a"))
    with pytest.raises(ValueError, match="distinct non-negative"):
        Mesh([0, 0], ("a",))
    with pytest.raises(ValueError, match="must be ints"):
        Mesh([0.5, 1.5], ("a",))
    with pytest.raises(ValueError, match="at least one axis"):
        Mesh([], ("a",))
    with pytest.raises(ValueError, match="positive sizes"):
        Mesh.from_shape((2, 0), ("a", "b"))
    with pytest.raises(ValueError, match="pass exactly 4 devices"):
        Mesh.from_shape((2, 2), ("a", "b"), [0, 1, 2])
    m = Mesh.from_shape((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="no axis 'pp'"):
        m.axis_size("pp")
    with pytest.raises(ValueError, match="out of range"):
        m.axis_index(2)
    with pytest.raises(ValueError, match="not in this mesh"):
        m.coordinate(7)


# ---------------------------------------------------------------- layout vs torch


@st.composite
def layouts(draw, min_axes=1):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=min_axes, max_size=3)))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    ndim = len(shape)
    placement = st.one_of(
        st.integers(-ndim, ndim - 1).map(Shard), st.just(Replicate()), st.sampled_from([Partial(), Partial("max")])
    )
    placements = tuple(draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    devices = draw(st.permutations(range(math.prod(mesh_shape))))
    mesh = Mesh.from_shape(mesh_shape, tuple("xyz"[: len(mesh_shape)]), devices)
    return Layout(shape, mesh, placements)


def torch_box(layout, device):
    coordinate = list(layout.mesh.coordinate(device))
    shape, offset = _compute_local_shape_and_global_offset(
        layout.global_shape, layout.mesh.shape, coordinate, [to_torch(p) for p in layout.placements]
    )
    return tuple((o, o + s) for o, s in zip(offset, shape))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_layout_boxes_equal_torch(layout):
    boxes = layout.boxes()
    assert boxes.shape == (layout.mesh.size, layout.ndim, 2)
    for i, device in enumerate(layout.mesh.devices):
        expected = torch_box(layout, device)
        assert layout.box(device) == expected
        assert tuple(map(tuple, boxes[i].tolist())) == expected
        assert layout.local_shape(device) == tuple(b - a for a, b in expected)
        assert layout.global_offset(device) == tuple(a for a, _ in expected)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_layout_pieces_tile_the_tensor(layout):
    """Without Partial, every element is held by exactly (product of non-sharding axes) devices."""
    if layout.is_partial:
        return
    copies = math.prod(k for k, p in zip(layout.mesh.shape, layout.placements) if not p.is_shard())
    count = np.zeros(layout.global_shape, dtype=np.int64)
    for device in layout.mesh.devices:
        count[tuple(slice(a, b) for a, b in layout.box(device))] += 1
    assert np.all(count == copies)
    owners = layout.owners()
    assert sum(len(d) for d in owners.values()) == sum(layout.numel(d) > 0 for d in layout.mesh.devices)
    assert all(len(d) == copies for d in owners.values())


def test_layout_matches_torch_docstring_example():
    layout = Layout((2, 5), Mesh.from_shape((2, 2), ("dp", "tp")), (Shard(1), Shard(1)))
    assert [layout.local_shape(d) for d in range(4)] == [(2, 2), (2, 1), (2, 1), (2, 1)]
    assert [layout.global_offset(d) for d in range(4)] == [(0, 0), (0, 2), (0, 3), (0, 4)]


def test_layout_uneven_and_empty_trailing_shards():
    layout = Layout((5, 3), Mesh.from_shape((4,), ("tp",)), (Shard(0),))
    assert [layout.box(d)[0] for d in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert layout.numel(3) == 0 and layout.nbytes(0, torch.bfloat16) == 12 and layout.nbytes(2, 4) == 12
    assert len(layout.owners()) == 3


def test_layout_partial_and_normalization():
    mesh = Mesh.from_shape((2, 2), ("dp", "tp"))
    layout = Layout((4, 6), mesh, (Partial(), Shard(-1)))
    assert layout.placements == (Partial(), Shard(1)) and layout.is_partial
    assert layout.box(2) == ((0, 4), (0, 3))  # a full-height summand of its column block
    with pytest.raises(ValueError, match="reduce it first"):
        layout.owners()
    assert Layout((4,), mesh, (tp.Replicate(), tp.Shard(0))).placements == (Replicate(), Shard(0))
    assert Layout([3], mesh, [Replicate(), Replicate()]).is_replicated
    assert layout == Layout((4, 6), mesh, (Partial(), Shard(1))) and hash(layout) == hash(
        Layout((4, 6), mesh, (Partial(), Shard(1)))
    )


def test_layout_scalar_tensor():
    layout = Layout((), Mesh.from_shape((2,), ("dp",)), (Replicate(),))
    assert layout.box(1) == () and layout.numel(1) == 1 and layout.owners() == {(): (0, 1)}


def test_layout_boxes_fast_for_1024_devices():
    mesh = DistConfig("big", dp=8, tp=8, pp=16).mesh()
    start = time.perf_counter()
    for rows in range(1000, 1100):  # 100 parameters
        boxes = Layout((rows, 12288), mesh, (Replicate(), Shard(0), Replicate(), Shard(1))).boxes()
    assert time.perf_counter() - start < scaled(2.0)  # a guard against a complexity regression
    assert boxes.shape == (1024, 2, 2) and not boxes.flags.writeable


def test_layout_errors():
    mesh = Mesh.from_shape((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        Layout((4,), mesh, (Shard(0),))
    with pytest.raises(ValueError, match=r"shard a dim in \[-2, 2\)"):
        Layout((4, 4), mesh, (Shard(2), Replicate()))
    with pytest.raises(ValueError, match="non-negative ints"):
        Layout((4, -1), mesh, (Replicate(), Replicate()))
    with pytest.raises(ValueError, match="must be a distconfig Mesh"):
        Layout((4,), (2, 2), (Shard(0), Replicate()))
    with pytest.raises(ValueError, match="not in this mesh"):
        Layout((4,), mesh, (Shard(0), Replicate())).box(9)
    assert Layout((np.int64(4),), mesh, (Shard(0), Replicate())).global_shape == (4,)


# ---------------------------------------------------------------- topology


def test_topology_basics():
    t = Topology(16, 8)
    assert t.num_nodes == 2 and t.node_of(9) == 1 and t.node_of(np.int64(3)) == 0
    assert t.same_node(0, 7) and not t.same_node(7, 8)
    assert t.bandwidth(0, 7) == 100e9 and t.bandwidth(0, 8) == 12.5e9 and t.bandwidth(5, 5) == math.inf


def test_topology_errors():
    with pytest.raises(ValueError, match="not a multiple of devices_per_node=3"):
        Topology(8, 3)
    with pytest.raises(ValueError, match="positive int"):
        Topology(0, 1)
    with pytest.raises(ValueError, match="positive finite number"):
        Topology(4, 2, inter_node_bandwidth=0)
    with pytest.raises(ValueError, match=r"use a rank in \[0, 4\)"):
        Topology(4, 2).node_of(4)


def test_topology_from_env(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "HOTSWITCH_DEVICES_PER_NODE",
                "HOTSWITCH_INTRA_NODE_BW", "HOTSWITCH_INTER_NODE_BW"):
        monkeypatch.delenv(var, raising=False)
    assert Topology.from_env() == Topology(1, 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert Topology.from_env() == Topology(8, 8)
    monkeypatch.setenv("HOTSWITCH_DEVICES_PER_NODE", "2")  # one machine posing as four nodes
    monkeypatch.setenv("HOTSWITCH_INTER_NODE_BW", "1e9")
    t = Topology.from_env()
    assert (t.num_nodes, t.inter_node_bandwidth, t.intra_node_bandwidth) == (4, 1e9, 100e9)
    assert Topology.from_env(world_size=4).num_nodes == 2
    monkeypatch.setenv("HOTSWITCH_INTRA_NODE_BW", "fast")
    with pytest.raises(ValueError, match="HOTSWITCH_INTRA_NODE_BW='fast' is not a valid float"):
        Topology.from_env()


# ---------------------------------------------------------------- DistConfig


def test_distconfig_mesh_puts_tp_innermost():
    c = DistConfig("c", dp=2, tp=2, pp=2)
    assert c.world_size == 8 and c.axis_names == ("pp", "dp", "cp", "tp")
    mesh = c.mesh()
    assert mesh.shape == (2, 2, 1, 2) and mesh.axis_names == ("pp", "dp", "cp", "tp")
    assert mesh.axis_groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.axis_groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert DistConfig("d", dp=2, devices=[5, 3]).mesh().devices == (5, 3)
    assert DistConfig("d", dp=2, devices=[5, 3]).devices == (5, 3)


def test_context_parallel_configs_parse_and_lay_out():
    """cp in the one grammar (compact names in the order dp, tp, cp, pp; key=value), its mesh axis
    between dp and tp, a stage axis when above 1, kept by an elastic change, refused with sp."""
    c = DistConfig.parse("dp2tp2cp2")
    assert (c.dp, c.tp, c.cp, c.world_size, c.stage_axes) == (2, 2, 2, 8, ("dp", "cp", "tp"))
    assert DistConfig.parse("dp=2,tp=2,cp=2") == c and DistConfig.parse(c.spec()) == c
    assert [DistConfig.parse(n).name for n in ("cp4", "tp2cp2", "dp=2,cp=2")] == ["cp4", "tp2cp2", "dp2cp2"]
    mesh = c.mesh()
    assert mesh.shape == (1, 2, 2, 2) and mesh.axis_groups("cp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert c.instantiate(16) == DistConfig("dp2tp2cp2", dp=4, tp=2, cp=2)
    assert (c.sequence_shards, DistConfig.parse("tp4sp").sequence_shards, DistConfig.parse("dp4").sequence_shards) \
        == (2, 4, 1)
    assert "cp=2" in c.describe()
    with pytest.raises(ValueError, match="sp and cp both shard the sequence"):
        DistConfig.parse("tp2cp2sp")
    with pytest.raises(ValueError, match="cp must be a positive int"):
        DistConfig("x", cp=0)
    with pytest.raises(ValueError, match="cp\\*tp\\*pp = 4 must divide"):
        c.instantiate(6)
    with pytest.raises(ValueError, match="uses dp\\*cp\\*tp\\*pp = 8 devices but the job has 4"):
        c.check_world_size(4)


def test_distconfig_check_world_size():
    DistConfig("ok", dp=2, tp=2).check_world_size(4)
    DistConfig("sub", dp=2, devices=[4, 6]).check_world_size(8)
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 4 devices but the job has 8 processes; .*"
                                         r"pass devices=\[\.\.\.\] with 4 of the 8 ranks"):
        DistConfig("dp2tp2", dp=2, tp=2).check_world_size(8)
    with pytest.raises(ValueError, match=r"so that dp\*tp\*pp = 2$"):
        DistConfig("dp2tp2", dp=2, tp=2).check_world_size(2)
    with pytest.raises(ValueError, match=r"uses devices \[9\] but the job has 8 processes"):
        DistConfig("sub", dp=2, devices=[0, 9]).check_world_size(8)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        DistConfig("x").check_world_size(0)


def test_distconfig_instantiate():
    c = DistConfig("long", dp=2, tp=4, pp=2, sp=True)
    assert c.instantiate(32) == DistConfig("long", dp=4, tp=4, pp=2, sp=True)
    assert c.instantiate(8, devices=range(8, 16), name="long8").devices == tuple(range(8, 16))
    with pytest.raises(ValueError, match="tp\\*pp = 8 must divide the device count"):
        c.instantiate(12)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dp=8,tp=8,pp=16", DistConfig("dp8tp8pp16", dp=8, tp=8, pp=16)),
        (" tp=4 , sp ", DistConfig("tp4sp", tp=4, sp=True)),
        ("name=long,dp=1,tp=2,sp=true", DistConfig("long", tp=2, sp=True)),
        ("dp=2,devices=4:5", DistConfig("dp2", dp=2, devices=(4, 5))),
        ("", DistConfig("dp1")),
    ],
)
def test_distconfig_parse(spec, expected):
    assert DistConfig.parse(spec) == expected


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 16), st.integers(1, 8), st.integers(1, 4), st.booleans(), st.booleans(),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,10}", fullmatch=True),
)
def test_distconfig_spec_round_trips(dp, tp_, pp, sp, with_devices, name):
    sp = sp and tp_ > 1
    devices = tuple(range(100, 100 + dp * tp_ * pp))[::-1] if with_devices else None
    c = DistConfig(name, dp=dp, tp=tp_, pp=pp, sp=sp, devices=devices)
    assert DistConfig.parse(c.spec()) == c
    assert c.name in c.describe() and f"tp={tp_}" in c.describe()


def test_distconfig_errors():
    with pytest.raises(ValueError, match="non-empty identifier"):
        DistConfig("")
    with pytest.raises(ValueError, match="non-empty identifier"):
        DistConfig("a b")
    with pytest.raises(ValueError, match="tp must be a positive int"):
        DistConfig("x", tp=0)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        DistConfig("x", dp=True)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        DistConfig("x", pp=2.0)
    with pytest.raises(ValueError, match="sp must be True or False"):
        DistConfig("x", tp=2, sp=1)
    with pytest.raises(ValueError, match="it needs tp > 1; set tp>=2 or sp=False"):
        DistConfig("x", sp=True)
    with pytest.raises(ValueError, match="needs dp\\*tp\\*pp = 4 devices but 3 were given"):
        DistConfig("x", dp=4, devices=[0, 1, 2])
    with pytest.raises(ValueError, match="repeat a rank"):
        DistConfig("x", dp=2, devices=[1, 1])
    with pytest.raises(ValueError, match="non-negative int ranks"):
        DistConfig("x", dp=2, devices=[0, -1])
    with pytest.raises(ValueError, match="must be a list of ranks"):
        DistConfig("x", dp=2, devices="01")


@pytest.mark.parametrize(
    "spec, phrase",
    [
        ("dp=2,zz=3", "cannot read 'zz=3'"),
        ("dp", "cannot read 'dp'"),
        ("dp=2,dp=4", "sets 'dp' twice"),
        ("dp=two", "dp='two' is not a number"),
        ("tp=2,sp=maybe", "is not a boolean"),
        ("dp=2,devices=0;1", "write e.g. devices=0:1:2:3"),
    ],
)
def test_distconfig_parse_errors(spec, phrase):
    with pytest.raises(ValueError, match=phrase):
        DistConfig.parse(spec)


def test_parse_configs_takes_every_form_of_a_config_list():
    """The one reader of a job's configs (hs.compile, Trainer, ElasticJob and every CLI --configs)."""
    expected = [DistConfig("dp4", dp=4), DistConfig("dp2tp2", dp=2, tp=2), DistConfig("tp4sp", tp=4, sp=True)]
    for configs in (
        ["dp4", "dp2tp2", "tp4sp"],
        ["dp=4", "dp=2,tp=2", "tp=4,sp"],
        ("dp4", DistConfig("dp2tp2", dp=2, tp=2), "tp=4,sp=1"),
        (c for c in ["dp4", "dp2tp2", "tp4sp"]),
        "dp4,dp2tp2,tp4sp",
        "dp=4;dp=2,tp=2;tp=4,sp",
        " dp4 ; dp2tp2 ;tp4sp; ",
    ):
        assert parse_configs(configs) == expected, configs
    assert parse_configs("dp=2,tp=2,sp") == [DistConfig("dp2tp2sp", dp=2, tp=2, sp=True)]  # one config's pairs
    assert parse_configs(DistConfig("x", tp=2)) == [DistConfig("x", tp=2)]
    assert parse_configs(["dp2tp2sp"]) == parse_configs(["dp=2,tp=2,sp"])


@pytest.mark.parametrize(
    "configs, phrase",
    [
        ([], "no configs given: pass at least one"),
        ("", "no configs given"),
        (" ; ", "no configs given"),
        (["dp4", "dp=4"], r"repeat the name\(s\) \['dp4'\]: give each config once"),
        (4, "configs must be a list of DistConfigs or config strings, got int"),
        (["dp4", 2], "a DistConfig or a config string is needed, got int"),
        (["dp4,tp4sp"], "'dp4' is a whole config; one string is one config"),
        ("dp4;banana", "cannot read 'banana'"),
    ],
)
def test_parse_configs_errors_list_the_accepted_forms(configs, phrase):
    with pytest.raises(ValueError, match=phrase) as e:
        parse_configs(configs)
    if "repeat" not in phrase:  # one message, wherever a config is read: it lists the accepted forms
        assert GRAMMAR in str(e.value)


def test_chunk_span_is_torch_chunks_cut():
    """The one rule for a dim cut over ranks (cp's sequence, fsdp's shards, DTensor's Shard): the
    pieces torch.chunk gives, padded with empty ones where it gives fewer than asked."""
    from hotswitch.distconfig import chunk_span

    for n in range(0, 20):
        for parts in range(1, 7):
            pieces = torch.arange(n).chunk(parts) if n else ()
            spans = [chunk_span(n, parts, i) for i in range(parts)]
            assert [size for _, size in spans] == [len(p) for p in pieces] + [0] * (parts - len(pieces)), (n, parts)
            assert all(p.tolist() == list(range(start, start + size)) for p, (start, size) in zip(pieces, spans))
