"""Config: TOML + env + overrides into typed dataclasses; bad keys name themselves."""
import pytest

from cache_service.config import load_config, parse_size
from tiers.types import ConfigError


def test_sizes_parse_with_units():
    # binary and decimal units, plain ints
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(1000) == 1000
    for bad in ("4 parsecs", "-1", "0", True):
        with pytest.raises(ConfigError):
            parse_size(bad, "tiers.cpu.capacity")


def test_toml_env_and_overrides_layer_in_order(tmp_path):
    # the file sets the tiers, env overrides one value, overrides win last
    f = tmp_path / "tierkv.toml"
    f.write_text('[store]\nqueue_full = "skip"\n[tiers.cpu]\ncapacity = "64MiB"\npolicy = "arc"\n'
                 f'[tiers.disk]\npath = "{tmp_path}/d"\ncapacity = "1GiB"\nfsync = false\n')
    env = {"TIERKV_TIERS__CPU__CAPACITY": "128MiB", "TIERKV_STORE__QUEUE_DEPTH": "7", "UNRELATED": "x"}
    cfg = load_config(f, env=env, overrides={"tiers": {"disk": {"policy": "s3fifo"}}})
    assert cfg.store.queue_full == "skip" and cfg.store.queue_depth == 7
    assert cfg.tiers.cpu.capacity == 128 * 2**20 and cfg.tiers.cpu.policy == "arc"
    assert cfg.tiers.disk.fsync is False and cfg.tiers.disk.policy == "s3fifo"
    assert cfg.tiers.disk.write == "through" and cfg.tiers.hbm is None


@pytest.mark.parametrize("text,needle", [
    ("[tiers.cpu]\ncapacty = 1\n", "tiers.cpu.capacty"),
    ("[tiers.cpu]\ncapacity = '1GiB'\npolicy = 'mru'\n", "policy"),
    ("[store]\nqueue_full = 'explode'\n", "store.queue_full"),
    ("[store]\nqueue_depth = 'many'\n", "store.queue_depth"),
    ("[tiers.disk]\npath = '/x'\n", "tiers.disk.capacity"),
    ("[tiers.cpu]\ncapacity = 'lots'\n", "tiers.cpu.capacity"),
    ("[tiers.cpu]\ncapacity = '1GiB'\nshared = 'sometimes'\n", "shared"),
    ("[tiers.cpu]\ncapacity = '1GiB'\nshared = 'yes'\npin = 'yes'\n", "shared pool is not page-locked"),
    ("not toml at all [", "not valid TOML"),
    ("[server]\nlisten = 'nowhere'\n", "listen address 'nowhere' must be HOST:PORT"),
    ("[server]\ntls_cert = 'c.pem'\n", "TLS needs both --tls-cert and --tls-key"),
    ("[server]\nworkers = 0\n", "workers must be positive"),
    ("[server]\nchunk_bytes = '8MiB'\n", "leaves no room under max_message_bytes"),
    ("[server]\nlisen = 'h:1'\n", "server.lisen"),
])
def test_bad_config_names_the_key(tmp_path, text, needle):
    # each mistake raises ConfigError whose message names what is wrong
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(f, env={})


def test_a_config_variable_without_double_underscores_is_an_error_not_ignored():
    # TIERKV_STORE_QUEUE_DEPTH names a section but not a key: silently ignoring it would run another config
    with pytest.raises(ConfigError, match="TIERKV_STORE_QUEUE_DEPTH: .*TIERKV_STORE__QUEUE_DEPTH"):
        load_config(env={"TIERKV_STORE_QUEUE_DEPTH": "7"})
    # other TIERKV_ variables (the token, the servers' folder) are not config and pass
    assert load_config(env={"TIERKV_TOKEN": "t", "TIERKV_SERVERS_DIR": "/tmp/x"}).store.queue_depth > 0


def test_bad_env_value_names_the_key():
    # a wrong value in the environment is reported with its dotted key
    with pytest.raises(ConfigError, match="fsync"):
        load_config(env={"TIERKV_TIERS__DISK__CAPACITY": "1GiB", "TIERKV_TIERS__DISK__FSYNC": "maybe"})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml", env={})


def test_server_section_from_toml_env_and_flags(tmp_path):
    # [server] comes from TOML and TIERKV_SERVER__* env; `tierkv serve`'s flags given override it
    import argparse

    from cache_service.server.cli_serve import add_serve_args, server_flags

    f = tmp_path / "tierkv.toml"
    f.write_text('[server]\nlisten = "0.0.0.0:7700"\nchunk_bytes = "2MiB"\ndata_port = "off"\nmetrics_port = 9600\n')
    cfg = load_config(f, env={"TIERKV_SERVER__WORKERS": "4", "TIERKV_SERVER__METRICS_PORT": "off"})
    s = cfg.server
    assert (s.listen, s.chunk_bytes, s.data_port, s.metrics_port, s.workers) == ("0.0.0.0:7700", 2 << 20, None, None, 4)
    assert load_config(env={}).server.data_port == 0 and load_config(env={}).server.listen == "127.0.0.1:7600"
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert server_flags(p.parse_args([])) == {}  # no flag: the config decides
    assert server_flags(p.parse_args(["--listen", "h:1", "--data-port", "off", "--grace", "2"])) == {
        "listen": "h:1", "data_port": None, "grace_s": 2.0}


def test_values_that_would_be_quietly_wrong_are_refused_by_name(tmp_path):
    # A port past 65535 wrapped around (the daemon listened where no client looks); ports in TOML or env too.
    for section in ({"listen": "127.0.0.1:99999"}, {"metrics_port": 99999}, {"data_port": 70000}, {"metrics_port": -1}):
        with pytest.raises(ConfigError, match=next(iter(section))):
            load_config(env={}, overrides={"server": section})
    # A fraction for a count was truncated (0.5 promotions: never); a duration that is no number passed.
    with pytest.raises(ConfigError, match="store.promote_after_hits"):
        load_config(env={}, overrides={"store": {"promote_after_hits": 0.5}})
    assert load_config(env={}, overrides={"store": {"queue_depth": 7.0}}).store.queue_depth == 7
    with pytest.raises(ConfigError, match="server.stream_idle_s"):
        load_config(env={}, overrides={"server": {"stream_idle_s": float("nan")}})
    with pytest.raises(ConfigError, match="grace_s"):
        load_config(env={}, overrides={"server": {"grace_s": -1.0}})
    # A CPU tier larger than the machine's memory failed at its first block, every block after.
    with pytest.raises(ConfigError, match="tiers.cpu.capacity"):
        load_config(env={}, overrides={"tiers": {"cpu": {"capacity": "1000TiB"}}})


def test_files_and_env_that_do_not_fit_get_a_clear_error(tmp_path):
    # A file that is not UTF-8 text, and env keys under a value that is no table: errors, not tracebacks.
    f = tmp_path / "tierkv.toml"
    f.write_bytes(b"[store]\nqueue_depth = 3 # \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(f, env={})
    f.write_text("store = 5\n")
    with pytest.raises(ConfigError, match="store: expected a table"):
        load_config(f, env={"TIERKV_STORE__QUEUE_DEPTH": "3"})
    with pytest.raises(ConfigError, match="store.queue_depth.*expected a table"):
        load_config(env={"TIERKV_STORE__QUEUE_DEPTH": "3", "TIERKV_STORE__QUEUE_DEPTH__X": "1"})


def test_settings_accepted_without_a_check_before_are_checked():
    s3 = {"bucket": "b", "capacity": "1GiB"}
    # S3 timeouts, concurrency and retries; a Redis cluster that names no node or a port past 65535.
    for bad, key in (({"connect_timeout": -1.0}, "connect_timeout"), ({"read_timeout": float("nan")}, "read_timeout"),
                     ({"max_concurrency": 0}, "max_concurrency"), ({"retries": -3}, "retries")):
        with pytest.raises(ConfigError, match=key):
            load_config(env={}, overrides={"tiers": {"s3": s3 | bad}})
    for cluster in (",", "h:99999"):
        with pytest.raises(ConfigError, match="directory.cluster"):
            load_config(env={}, overrides={"directory": {"cluster": cluster}})
    # A number for a path, an array for a table: refused, not "5" or the defaults.
    with pytest.raises(ConfigError, match="tiers.disk.path: expected a string"):
        load_config(env={}, overrides={"tiers": {"disk": {"path": 5, "capacity": "1GiB"}}})
    with pytest.raises(ConfigError, match="store: expected a table"):
        load_config(env={}, overrides={"store": []})
