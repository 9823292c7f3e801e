import jax
import numpy as np
import pytest

from jaxtrain.config import ConfigError, load_config
from jaxtrain.parallel.dims import MeshShape
from jaxtrain.parallel.mesh import build_mesh


def test_fill_axis_takes_the_remaining_devices():
    shape = MeshShape.resolve(load_config(None, ["mesh.ici.tensor=2"]).mesh, 8)
    assert shape.ici == (1, 1, 4, 1, 1, 2) and shape.dcn == (1, 1, 1, 1, 1, 1)
    assert shape.axis_sizes == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}


def test_size_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match="has 4 devices but 8 are available"):
        MeshShape.resolve(load_config(None, ["mesh.ici.fsdp=4"]).mesh, 8)


def test_dcn_axis_spans_hosts_and_ici_groups_stay_inside_one():
    # One process emulates 2 hosts of 4 devices: devices 0-3 are "host 0", 4-7 "host 1".
    cfg = load_config(None, ["mesh.dcn.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2"])
    mesh, _ = build_mesh(cfg, jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    host = ids // 4
    assert (host[0] == 0).all() and (host[1] == 1).all()  # stepping along data (dcn) changes host
    assert set(ids[0].ravel()) == {0, 1, 2, 3}


def test_stage_axis_across_hosts_and_inside_a_node():
    # dcn stage: each stage is one (emulated) host; ici stage: consecutive devices of a node.
    cfg = load_config(None, ["mesh.dcn.stage=2", "mesh.ici.fsdp=4", "train.microbatches=2"])
    mesh, _ = build_mesh(cfg, jax.devices()[:8])
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert (ids[0, 0] // 4 == 0).all() and (ids[0, 1] // 4 == 1).all()
    mesh, _ = build_mesh(load_config(None, ["mesh.ici.stage=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=2",
                                      "train.microbatches=2"]),
                         jax.devices()[:8])
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert sorted(ids[0, 0].ravel()) == [0, 1, 2, 3] and sorted(ids[0, 1].ravel()) == [4, 5, 6, 7]


def test_tensor_across_nodes_is_refused():
    with pytest.raises(ConfigError, match=r"mesh.dcn.tensor=2 .*keep it inside a node"):
        load_config(None, ["mesh.dcn.tensor=2", "mesh.ici.fsdp=4"])


def test_dcn_and_ici_parts_of_the_same_axis():
    cfg = load_config(None, ["mesh.dcn.fsdp=2", "mesh.ici.fsdp=4"])
    mesh, _ = build_mesh(cfg, jax.devices()[:8])
    ids = np.vectorize(lambda d: d.id)(mesh.devices).ravel()  # fsdp index = dcn * 4 + ici
    assert list(ids // 4) == [0, 0, 0, 0, 1, 1, 1, 1]
