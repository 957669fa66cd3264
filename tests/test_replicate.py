"""transport.replicate_to: a model's replicated arrays placed on another mesh, byte for byte, lost devices unread."""

import jax
import ml_dtypes
import numpy as np
import pytest
from _bytes import random_bytes
from jax.sharding import PartitionSpec as PS

from moe_eplb_jax import transport
from moe_eplb_jax.transport import replicate
from moe_eplb_jax.transport.packing import byte_rows_numpy

pytestmark = pytest.mark.devices(8)
DTYPES = [ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn, ml_dtypes.bfloat16, np.float16]
DTYPES += [np.float32, np.int8, np.bool_]


def assert_replicated(arrays, host, mesh):
    for array, want in zip(jax.tree.leaves(arrays), jax.tree.leaves(host)):
        assert array.sharding.is_fully_replicated and array.sharding.mesh == mesh
        assert {s.device for s in array.addressable_shards} == set(mesh.devices.flat)
        for shard in array.addressable_shards:
            got = byte_rows_numpy(np.asarray(shard.data)[None], 1)
            np.testing.assert_array_equal(got, byte_rows_numpy(np.asarray(want)[None], 1))


@pytest.mark.parametrize("path", ["local", "broadcast"])
def test_every_dtype_arrives_byte_for_byte_on_disjoint_devices(rng, path):
    devices = jax.devices()
    old, new = transport.ep_mesh(4, devices=devices[:4]), transport.ep_mesh(4, devices=devices[4:])
    host = {np.dtype(d).name: random_bytes(rng, d, (3, 8)) for d in DTYPES}
    host["step"] = np.int32(7)  # 0-d, as an optimizer's count
    arrays = {k: transport.put_host(v, old) for k, v in host.items()}
    if path == "local":
        moved = transport.replicate_to(arrays, old, new, lost_ranks=[0, 2])
    else:  # what a process with no surviving old device gets: the broadcast over the union
        leaves, treedef = jax.tree.flatten(arrays)
        moved = jax.tree.unflatten(treedef, replicate._broadcast(leaves, list(old.devices.flat)[1:], new, "ep"))
    assert_replicated(moved, host, new)
    assert_replicated(arrays, host, old)  # the input stays valid


def test_bad_leaves_are_refused_before_any_device_work():
    old, new = transport.ep_mesh(8), transport.ep_mesh(4)
    sharded = transport.put_host(np.zeros((8, 2), np.float32), old, PS("ep"))
    with pytest.raises(ValueError, match=r"tree\['w'\] is sharded"):
        transport.replicate_to({"w": sharded}, old, new)
    with pytest.raises(ValueError, match="must be a jax.Array"):
        transport.replicate_to([np.zeros(2)], old, new)
    elsewhere = transport.put_host(np.zeros(2, np.float32), new)
    with pytest.raises(ValueError, match="placed on the old mesh"):
        transport.replicate_to([elsewhere], old, new)
    with pytest.raises(ValueError, match="every rank of the old mesh is lost"):
        transport.replicate_to([], new, old, lost_ranks=range(4))
    with pytest.raises(ValueError, match="not ranks of the old mesh"):
        transport.replicate_to([], old, new, lost_ranks=[8])
