"""etcd with its authentication on: our processes log in with MOONCAKE_ETCD_USER/PASSWORD, a
client without them (or with a wrong password) is refused, and a login token that expires
(etcd's --auth-token-ttl, here 1 s) is renewed without an outage."""

import asyncio

import pytest

from mooncake.registry import EtcdCredentials, RegistryConfig, RegistryRefused, open_registry
from tests.registry.conftest import etcd_server_mod
from tests.registry.support import info, run

pytestmark = pytest.mark.etcd
LOGIN = EtcdCredentials("mooncake", "s3cret-pass")


@pytest.fixture
def etcd_with_auth(tmp_path):
    server = etcd_server_mod.EtcdServer(tmp_path, extra_args=("--auth-token-ttl", "1"))
    try:
        server.start()
        for args in (("user", "add", "root:root-pass"), ("user", "add", f"{LOGIN.user}:{LOGIN.password}"),
                     ("role", "add", "mooncake"),
                     ("role", "grant-permission", "mooncake", "--prefix=true", "readwrite", "/mooncake/"),
                     ("user", "grant-role", LOGIN.user, "mooncake"), ("auth", "enable")):
            server.etcdctl(*args)
        yield server
    finally:
        server.kill()


def config(server, login) -> RegistryConfig:
    return RegistryConfig(url=server.url, ttl_s=2.0, keepalive_interval_s=0.3, request_timeout_s=1.0,
                          retry_min_s=0.05, retry_max_s=0.3, etcd_credentials=login)


def test_registry_logs_in_and_strangers_are_refused(etcd_with_auth) -> None:
    async def main() -> None:
        worker, conductor = open_registry(config(etcd_with_auth, LOGIN)), open_registry(config(etcd_with_auth, LOGIN))
        await worker.register(info("p0"), 2.0)
        assert set(await conductor.snapshot()) == {"p0"}
        await asyncio.sleep(2.5)  # idle past the login token's TTL
        assert set(await conductor.snapshot()) == {"p0"}  # renewed, and the keepalives kept p0 alive
        for login in (None, EtcdCredentials(LOGIN.user, "wrong")):
            stranger = open_registry(config(etcd_with_auth, login))
            # Refused, not unavailable: a worker's first registration stops on it (no retry helps)
            # and says so on /health, instead of retrying for ever.
            with pytest.raises(RegistryRefused, match="user name is empty|authentication failed"):
                await stranger.register(info("intruder"), 2.0)
            await stranger.close()
        assert set(await conductor.snapshot()) == {"p0"}
        await worker.close()
        await conductor.close()
    run(main())


def test_credentials_come_from_the_environment_in_pairs() -> None:
    assert EtcdCredentials.from_env({}) is None
    login = EtcdCredentials.from_env({"MOONCAKE_ETCD_USER": "u", "MOONCAKE_ETCD_PASSWORD": "p"})
    assert login == EtcdCredentials("u", "p") and "password" not in repr(login)
    with pytest.raises(ValueError, match="both"):
        EtcdCredentials.from_env({"MOONCAKE_ETCD_USER": "u"})
