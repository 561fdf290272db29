"""plait's DCP metadata reader (``core.checkpoint.safe_dcp.load_metadata``) reads what torch's own
writer wrote under every supported Python, enum members pickled as ``getattr(cls, name)`` (Python 3.12,
and some 3.11 builds) included, and still refuses any other ``getattr``."""

from __future__ import annotations

import copyreg
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp


def saved(tmp_path):
    """A real single-process DCP checkpoint of a small state (its .metadata holds TensorProperties)."""
    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.randn(4, 3), "b": torch.zeros(3)}, checkpoint_id=str(folder))
    return folder


def as_python_312_pickles_it(folder, enum_cls, reduce=getattr):
    """Rewrite .metadata with each member of ``enum_cls`` reduced to ``reduce(cls, name)``, byte for
    byte the form ``Enum.__reduce_ex__`` gives on Python 3.12."""
    meta = pickle.loads((folder / ".metadata").read_bytes())
    table = copyreg.dispatch_table.copy()
    table[enum_cls] = lambda member: (reduce, (type(member), member.name))
    with open(folder / ".metadata", "wb") as f:
        pickler = pickle.Pickler(f)
        pickler.dispatch_table = table
        pickler.dump(meta)
    return meta


def test_enum_members_pickled_by_getattr_are_read(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from core.checkpoint.safe_dcp import load_metadata

    folder = saved(tmp_path)
    before = as_python_312_pickles_it(folder, _MEM_FORMAT_ENCODING)
    assert b"getattr" in (folder / ".metadata").read_bytes()
    meta = load_metadata(folder)
    assert meta.state_dict_metadata == before.state_dict_metadata
    assert meta.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format


def test_a_getattr_of_anything_but_an_enum_member_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from core.checkpoint.safe_dcp import load_metadata
    from core.contract.errors import CheckpointError

    folder = saved(tmp_path)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    with open(folder / ".metadata", "wb") as f:  # getattr(Metadata, "__init__"): an allowed class, no enum member
        pickler = pickle.Pickler(f)
        pickler.dispatch_table = copyreg.dispatch_table.copy()
        pickler.dispatch_table[_MEM_FORMAT_ENCODING] = lambda member: (getattr, (type(meta), "__init__"))
        pickler.dump(meta)
    with pytest.raises(CheckpointError, match=r"no enum member DCP metadata holds: refusing to load it"):
        load_metadata(folder)
