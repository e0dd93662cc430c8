import pytest

from decode.staging import KVStaging, StagedLayer, StagingConfig, StagingFull


def layer(n: int) -> StagedLayer:
    return StagedLayer("l", (1, n), "float32", bytearray(n))


def test_transfer_completes_when_every_layer_arrived():
    staging = KVStaging()
    staging.put_layer("t", 0, 2, 10, layer(8), now=0.0)
    assert not staging.peek("t").complete
    staging.put_layer("t", 1, 2, 10, layer(8), now=0.1)
    assert staging.peek("t").complete
    assert staging.used_bytes == 16
    staging.pop("t")
    assert staging.used_bytes == 0


def test_resent_layer_replaces_and_is_not_double_counted():
    staging = KVStaging()
    staging.put_layer("t", 0, 2, 10, layer(8), now=0.0)
    staging.put_layer("t", 0, 2, 10, layer(8), now=0.0)
    assert staging.used_bytes == 8


def test_capacity_refuses_instead_of_growing():
    staging = KVStaging(StagingConfig(capacity_bytes=10))
    staging.put_layer("a", 0, 2, 1, layer(8), now=0.0)
    with pytest.raises(StagingFull):
        staging.put_layer("b", 0, 1, 1, layer(8), now=0.0)


def test_unclaimed_transfers_expire_after_ttl():
    staging = KVStaging(StagingConfig(ttl_s=5.0))
    staging.put_layer("old", 0, 1, 1, layer(4), now=0.0)
    staging.put_layer("new", 0, 1, 1, layer(4), now=4.0)
    assert staging.expire(now=6.0) == ["old"]
    assert staging.peek("new") is not None and staging.used_bytes == 4


def test_failed_transfer_is_never_complete():
    staging = KVStaging()
    staging.put_layer("t", 0, 1, 1, layer(4), now=0.0)
    staging.fail("t", "checksum mismatch", now=0.0)
    assert not staging.peek("t").complete and staging.peek("t").error


def test_out_of_range_layer_is_an_error():
    with pytest.raises(ValueError):
        KVStaging().put_layer("t", 3, 2, 1, layer(4), now=0.0)
