"""Every public property of ``torch.Tensor`` on a DTensor: torch's answer for the gathered
tensor, or the clear UnsupportedAttributeError (listed in UNSUPPORTED below, so a property a
new torch adds cannot slip through silently); and the methods DTensors refuse."""

import warnings

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.ops.methods import UnsupportedAttributeError
from test_ops_support import Batch, dt

R = Replicate()
PUBLIC = sorted(n for n in dir(torch.Tensor)
                if not n.startswith("_") and not callable(getattr(torch.Tensor, n)))
TENSOR_VALUED = ("H", "mH", "T", "mT", "real", "imag", "data")
UNSUPPORTED: dict[str, str] = {}  # name -> a word of the error message; none today

CASES = [  # (value, placements)
    (torch.randn(4, 3), (Shard(0),)),
    (torch.randn(4, 6), (Shard(1),)),
    (torch.randn(5, 3, dtype=torch.complex64), (Shard(0),)),  # uneven: rows 2, 2, 1, 0
    (torch.randn(3, 4, dtype=torch.complex64), (R,)),
    (torch.randn(4, 2, 3, dtype=torch.complex128), (Shard(0),)),
    (torch.arange(6), (Shard(0),)),
    (torch.tensor(2.5), (R,)),
    (torch.tensor(1 + 2j), (R,)),
]
IDS = [f"{tuple(v.shape)}-{v.dtype}-{p[0]}".replace("torch.", "") for v, p in CASES]


def torch_answer(t: torch.Tensor, name: str):
    """``t.<name>``, or the exception torch raises for it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .T on >2-D, .volatile: deprecation warnings
            return getattr(t, name)
    except Exception as exc:  # noqa: BLE001 - the answer to compare with
        return exc


def test_every_public_property_is_known():
    assert "H" in PUBLIC and "mH" in PUBLIC and "grad_fn" in PUBLIC and len(PUBLIC) > 30
    assert set(UNSUPPORTED) <= set(PUBLIC), "UNSUPPORTED names a property torch lacks"


@pytest.mark.parametrize("value,placements", CASES, ids=IDS)
def test_properties_match_torch(mesh1d, value, placements):
    x = dt(value, mesh1d, placements)
    batch = Batch()
    for name in PUBLIC:
        if name in UNSUPPORTED:
            with pytest.raises(UnsupportedAttributeError, match=UNSUPPORTED[name]):
                getattr(x, name)
            assert not hasattr(x, name)
            continue
        expected = torch_answer(value, name)
        if isinstance(expected, Exception):
            with pytest.raises(type(expected), match=_escape(expected)):
                getattr(x, name)
        elif name in TENSOR_VALUED:
            batch.add(getattr(x, name), expected.resolve_conj())
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert getattr(x, name) == expected, name
    batch.check()


def _escape(exc: Exception) -> str:
    import re
    return re.escape(str(exc).splitlines()[0])


def test_transposes_keep_the_shard_where_its_dim_lands(mesh1d):
    value = torch.randn(4, 2, 6, dtype=torch.complex64)
    x = dt(value, mesh1d, [Shard(2)])
    m = dt(value[0], mesh1d, [Shard(1)])
    batch = Batch()
    batch.add(x.mH, value.mH.resolve_conj(), [Shard(1)])
    batch.add(x.mT, value.mT, [Shard(1)])
    batch.add(m.H, value[0].H.resolve_conj(), [Shard(0)])
    batch.add(x.real, value.real, [Shard(2)])
    batch.add(x.imag * 2, value.imag * 2, [Shard(2)])
    batch.add(x.conj(), value.conj().resolve_conj(), [Shard(2)])
    batch.check()


def test_unknown_names_are_attribute_errors(mesh1d):
    x = dt(torch.randn(4, 3), mesh1d, [Shard(0)])
    assert hasattr(x, "mH") and hasattr(x, "grad_fn") and hasattr(x, "softmax")
    assert not hasattr(x, "no_such_attribute") and not hasattr(x, "_private")
    assert getattr(x, "no_such_attribute", 7) == 7


@pytest.mark.parametrize("call", [
    lambda x: x.data_ptr(), lambda x: x.untyped_storage(),
    lambda x: x.share_memory_(), lambda x: x.pin_memory()],
    ids=["data_ptr", "untyped_storage", "share_memory_", "pin_memory"])
def test_methods_without_a_dtensor_meaning_say_what_to_do(mesh1d, call):
    x = dt(torch.randn(4, 3), mesh1d, [Shard(0)])
    with pytest.raises(dtorch.ops.UnsupportedOpError, match=r"not supported on DTensors.*"
                                                            r"to_torch\(\)"):
        call(x)


def test_requires_grad_false_is_a_no_op(mesh1d):
    x = dt(torch.randn(4, 3), mesh1d, [Shard(0)])
    assert x.requires_grad_(False) is x and x.requires_grad is False
