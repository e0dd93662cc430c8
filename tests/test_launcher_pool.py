"""`mooncake serve`'s workers and their KVCache pools: each keeps its SSD tier in its own
subdirectory of one --pool-ssd-dir, all on one disk, and is told how many share that disk, so
that together they start at no more than its free space (store/ssd.py, room_for_files)."""

from __future__ import annotations

import subprocess

import pytest

from mooncake.cli import _pool_config, build_parser, main
from mooncake.engine.cli import pool_arguments, worker_config
from mooncake.launcher import Cluster, ClusterConfig


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def worker_commands(monkeypatch, *serve_options: str, num_prefill=2, num_decode=1) -> dict[str, list[str]]:
    """The `mooncake` arguments serve starts each worker with (the processes are `true`)."""
    pool_args = pool_arguments(parse("serve", *serve_options))
    cluster = Cluster(ClusterConfig("/models/m", "m", num_prefill=num_prefill, num_decode=num_decode,
                                    pool_args=pool_args), cluster_token="t")
    monkeypatch.setattr(cluster, "spawn", lambda worker: subprocess.Popen(["true"]))
    cluster.start()
    for w in cluster.workers:
        w.process.wait()
    return {w.command[w.command.index("--instance-id") + 1]: list(w.command[w.command.index("mooncake.cli") + 1:])
            for w in cluster.workers}


def test_serve_tells_each_worker_how_many_pools_share_its_ssd_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", "t" * 32)  # as serve hands it to its workers
    commands = worker_commands(monkeypatch, "--pool-ssd-dir", str(tmp_path), "--pool-ssd-gib", "8")
    assert sorted(commands) == ["decode-2", "prefill-0", "prefill-1"]
    for instance, command in commands.items():
        args = parse(*command)  # what the worker makes of it
        assert args.check(args) == []
        pool = _pool_config(worker_config(args, command[0], "/models/m"))
        assert (pool.ssd_dir, pool.ssd_bytes, pool.ssd_shared_by) == (str(tmp_path / instance), 8 << 30, 3)


def test_a_worker_alone_on_its_disk_or_without_an_ssd_tier_takes_no_share(monkeypatch):
    alone = worker_commands(monkeypatch, "--pool-ssd-dir", "/data/pool", num_prefill=0)["decode-0"]
    assert "--pool-ssd-shared-by" not in alone and parse(*alone).pool_ssd_shared_by == 1
    dram_only = worker_commands(monkeypatch)  # no SSD tier: nothing to share
    assert not any("--pool-ssd-shared-by" in command for command in dram_only.values())


@pytest.mark.parametrize("argv, needle", [
    (["prefill", "--pool-ssd-shared-by", "0", "--pool-ssd-dir", "/tmp"], "--pool-ssd-shared-by counts the pools"),
    (["decode", "--pool-ssd-shared-by", "3"], "runs only with --pool-ssd-dir"),  # would be ignored, unsaid
])
def test_a_worker_refuses_a_share_of_no_disk_or_of_no_pools(argv, needle, capsys, monkeypatch):
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", "t" * 32)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
