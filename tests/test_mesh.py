"""DeviceMesh: constructors, dims by name, groups, unbind, value semantics, errors. Pure."""

import copy
import pickle

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, MeshError, init_device_mesh


# seed 002 ------------------------------------------------------------------------------------
def test_seed_2x2_mesh_is_rows_of_ranks(m22):
    assert m22.mesh.tolist() == [[0, 1], [2, 3]]
    assert m22.mesh_list == [[0, 1], [2, 3]]
    assert m22.shape == (2, 2)
    assert m22.mesh_dim_names == ("dp", "tp")
    # ranks 0 and 1 sit along tp of the first dp row
    assert m22.groups("tp") == ((0, 1), (2, 3))
    assert m22.groups("dp") == ((0, 2), (1, 3))


# constructors --------------------------------------------------------------------------------
def test_nested_list_constructor():
    m = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    assert m.device_type == "cpu"
    assert m.shape == (2, 2) and m.ndim == 2
    assert m.ranks == (0, 1, 2, 3)
    assert m.mesh_dim_names == ("dp", "tp")
    assert m == init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_one_dim_list_and_tuple_constructors():
    a = DeviceMesh("cpu", [0, 1])
    b = DeviceMesh("cpu", (0, 1))
    assert a == b and a.shape == (2,) and a.ndim == 1 and a.mesh_dim_names is None


def test_tensor_constructor_matches_list():
    t = torch.tensor([[3, 1, 0], [2, 5, 4]])
    m = DeviceMesh("cpu", t, mesh_dim_names=("a", "b"))
    assert m == DeviceMesh("cpu", [[3, 1, 0], [2, 5, 4]], mesh_dim_names=("a", "b"))
    assert torch.equal(m.mesh, t)
    assert m.mesh.dtype == torch.int64
    assert m.ranks == (3, 1, 0, 2, 5, 4)


def test_three_dim_mesh():
    m = init_device_mesh("cpu", (2, 1, 3), mesh_dim_names=("pp", "dp", "tp"))
    assert m.mesh.tolist() == [[[0, 1, 2]], [[3, 4, 5]]]
    assert m.size() == 6 and m.size(0) == 2 and m.size("dp") == 1 and m.size("tp") == 3
    assert m.size(-1) == 3
    assert m.get_coordinate(4) == (1, 0, 1)
    assert m.groups("pp") == ((0, 3), (1, 4), (2, 5))
    assert m.groups("dp") == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert m.groups(2) == ((0, 1, 2), (3, 4, 5))


def test_init_device_mesh_int_shape():
    m = init_device_mesh("cpu", 4)
    assert m.shape == (4,) and m.ranks == (0, 1, 2, 3)
    assert m == DeviceMesh("cpu", [0, 1, 2, 3])


def test_default_mesh_is_world(monkeypatch):
    monkeypatch.setenv("DTORCH_WORKERS", "3")
    monkeypatch.setattr(dtorch.config, "_running_world_size", None)
    assert DeviceMesh("cpu").ranks == (0, 1, 2)


def test_cuda_device_type_is_metadata_only():
    m = DeviceMesh("cuda", [0, 1])
    assert m.device_type == "cuda"
    assert m != DeviceMesh("cpu", [0, 1])


# dims by name --------------------------------------------------------------------------------
def test_size_by_index_and_name(m22):
    assert m22.size() == 4
    assert m22.size(0) == 2 and m22.size(1) == 2
    assert m22.size("dp") == 2 and m22.size("tp") == 2
    m = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    assert m.size("dp") == 2 and m.size("tp") == 3 and m.size(-2) == 2


def test_dim_name_index(m22):
    assert m22.dim_name_index("dp") == 0
    assert m22.dim_name_index("tp") == 1
    assert m22.dim_name_index("pp") is None
    assert init_device_mesh("cpu", 2).dim_name_index("dp") is None


def test_dim_index_errors(m22):
    with pytest.raises(MeshError, match="no dim named 'pp'.*'dp', 'tp'"):
        m22.size("pp")
    with pytest.raises(MeshError, match="out of range"):
        m22.groups(2)
    with pytest.raises(MeshError, match="out of range"):
        m22.size(-3)
    with pytest.raises(MeshError):
        m22.groups(True)


def test_unbind(m22):
    subs = m22.unbind("dp")
    assert [s.ranks for s in subs] == [(0, 1), (2, 3)]
    assert all(s.mesh_dim_names == ("tp",) for s in subs)
    subs = m22.unbind("tp")
    assert [s.ranks for s in subs] == [(0, 2), (1, 3)]
    assert all(s.mesh_dim_names == ("dp",) for s in subs)
    assert m22.unbind("pp") == [m22]
    assert m22.unbind("pp")[0] is m22


def test_unbind_three_dims():
    m = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    subs = m.unbind("pp")
    assert [s.mesh.tolist() for s in subs] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert subs[1].mesh_dim_names == ("dp", "tp")
    subs = m.unbind("dp")
    assert [s.mesh.tolist() for s in subs] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert subs[0].mesh_dim_names == ("pp", "tp")


def test_unbind_one_dim_mesh():
    m = DeviceMesh("cpu", [2, 0, 1], mesh_dim_names=("pp",))
    subs = m.unbind("pp")
    assert [s.ranks for s in subs] == [(2,), (0,), (1,)]
    assert all(s.device_type == "cpu" for s in subs)


def test_unbind_without_names_returns_self():
    m = init_device_mesh("cpu", (2, 2))
    assert m.unbind("pp") == [m]


def test_check_all_dim_names_in_set(m22):
    m22.check_all_dim_names_in_set({"dp", "tp", "pp"})
    m22.check_all_dim_names_in_set(["dp", "tp"])
    with pytest.raises(MeshError, match="tp"):
        m22.check_all_dim_names_in_set({"dp"})
    with pytest.raises(MeshError, match="no dim names"):
        init_device_mesh("cpu", 2).check_all_dim_names_in_set({"dp"})


# coordinates and groups ----------------------------------------------------------------------
def test_get_coordinate(m22):
    assert [m22.get_coordinate(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m22.get_coordinate(7) is None


def test_get_coordinate_permuted_ranks():
    m = DeviceMesh("cpu", [[5, 2], [0, 7]])
    assert m.get_coordinate(5) == (0, 0)
    assert m.get_coordinate(7) == (1, 1)
    assert m.get_coordinate(1) is None
    for r in m.ranks:
        assert m.rank_at(m.get_coordinate(r)) == r


def test_groups_by_index_and_name(m22):
    assert m22.groups(0) == m22.groups("dp") == m22.groups(-2) == ((0, 2), (1, 3))
    assert m22.groups(1) == m22.groups("tp") == m22.groups(-1) == ((0, 1), (2, 3))


def test_groups_permuted_mesh_follow_grid():
    m = DeviceMesh("cpu", [[5, 2, 9], [0, 7, 1]])
    assert m.groups(1) == ((5, 2, 9), (0, 7, 1))
    assert m.groups(0) == ((5, 0), (2, 7), (9, 1))


def test_groups_cover_every_rank_once():
    m = DeviceMesh("cpu", torch.randperm(8).reshape(2, 2, 2))
    for d in range(3):
        flat = [r for g in m.groups(d) for r in g]
        assert sorted(flat) == list(range(8))
        for g in m.groups(d):
            coords = [m.get_coordinate(r) for r in g]
            # a group varies only along d, in increasing coordinate order
            assert [c[d] for c in coords] == list(range(2))
            assert len({c[:d] + c[d + 1:] for c in coords}) == 1


# value semantics -----------------------------------------------------------------------------
def test_immutable(m22):
    with pytest.raises(AttributeError, match="immutable"):
        m22.foo = 1
    with pytest.raises(AttributeError):
        m22._shape = (4,)
    with pytest.raises(AttributeError):
        m22.shape = (4,)
    assert m22.shape == (2, 2)


def test_equality_and_hash():
    a = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    b = init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != DeviceMesh("cpu", [[0, 1], [2, 3]])  # names differ
    assert a != DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("tp", "dp"))
    assert a != DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))  # ranks
    assert DeviceMesh("cpu", [0, 1, 2, 3]) != init_device_mesh("cpu", (2, 2))  # shape
    assert a != "not a mesh" and a != [[0, 1], [2, 3]]


def test_pickle_and_copy_round_trip(m22):
    # warm the caches first: they must not break pickling
    m22.groups("dp"), m22.get_coordinate(0), m22.mesh_list
    for clone in (pickle.loads(pickle.dumps(m22)), copy.copy(m22), copy.deepcopy(m22)):
        assert clone == m22 and hash(clone) == hash(m22)
        assert clone.mesh_dim_names == ("dp", "tp")
        assert clone.groups("tp") == ((0, 1), (2, 3))
    m = DeviceMesh("cuda", torch.tensor([[[4], [1]], [[0], [2]]]))
    assert pickle.loads(pickle.dumps(m)) == m


def test_repr(m22):
    assert repr(m22) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    assert repr(DeviceMesh("cpu", [0, 1])) == "DeviceMesh('cpu', [0, 1])"
    assert "[[0, 1], [2, 3]]" in str(m22)


def test_mesh_property_is_a_fresh_tensor(m22):
    t = m22.mesh
    t[0, 0] = 99
    assert m22.mesh.tolist() == [[0, 1], [2, 3]]


# errors --------------------------------------------------------------------------------------
def test_mesh_error_is_value_error():
    assert issubclass(MeshError, ValueError)
    assert issubclass(MeshError, dtorch.DTorchError)


def test_ragged_mesh():
    with pytest.raises(MeshError, match="ragged"):
        DeviceMesh("cpu", [[0, 1], [2]])
    with pytest.raises(MeshError, match="ragged"):
        DeviceMesh("cpu", [[0, 1], 2])


def test_duplicate_rank():
    with pytest.raises(MeshError, match="only once"):
        DeviceMesh("cpu", [[0, 1], [1, 2]])


def test_negative_or_non_int_rank():
    with pytest.raises(MeshError, match="non-negative"):
        DeviceMesh("cpu", [0, -1])
    with pytest.raises(MeshError, match="non-negative"):
        DeviceMesh("cpu", [0, 1.5])
    with pytest.raises(MeshError, match="non-negative"):
        DeviceMesh("cpu", [True, 2])


def test_empty_mesh():
    with pytest.raises(MeshError, match="at least one rank"):
        DeviceMesh("cpu", [])


def test_wrong_number_of_names():
    with pytest.raises(MeshError, match="2 names for a 1-D mesh.*one name per mesh dim"):
        DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match="one name per mesh dim"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",))


def test_bad_names():
    with pytest.raises(MeshError, match="distinct"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))
    with pytest.raises(MeshError, match="distinct non-empty strings"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", ""))


def test_unknown_dim_name_says_which_exist(m22):
    with pytest.raises(MeshError) as e:
        m22.groups("pp")
    msg = str(e.value)
    assert "'pp'" in msg and "'dp'" in msg and "'tp'" in msg


def test_bad_device_type():
    with pytest.raises(MeshError, match="device_type must be one of"):
        DeviceMesh("tpu", [0, 1])


@pytest.mark.parametrize("shape", [0, (2, 0), (), (-1,), (2.0,), (True, 2)])
def test_bad_init_device_mesh_shape(shape):
    with pytest.raises(MeshError, match="mesh_shape"):
        init_device_mesh("cpu", shape)
