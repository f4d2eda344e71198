"""The cluster secret: key files, the environment, derived keys, `exo-node keygen`, and never printing it."""

import argparse
import errno
import logging
import os
import pickle
import stat

import pytest

from node.security import (
    ENV_VAR,
    ClusterKey,
    ClusterKeyError,
    add_key_argument,
    generate_secret,
    keygen_main,
    load_secret,
    read_key_file,
    write_key_file,
)
from node.security.keys import LABEL_CA, LABEL_DISCOVERY, PREFIX, encode_key

SECRET = bytes(range(32))
TEXT = encode_key(SECRET)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_secrets_are_32_fresh_random_bytes():
    a, b = generate_secret(), generate_secret()
    assert len(a) == len(b) == 32 and a != b


def test_a_written_key_file_is_owner_only_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        key = write_key_file(tmp_path / "k", SECRET)
    finally:
        os.umask(old)
    assert mode(tmp_path / "k") == 0o600
    assert (tmp_path / "k").read_text() == TEXT + "\n"
    assert read_key_file(tmp_path / "k") == key == ClusterKey(SECRET)


def test_an_existing_key_file_is_never_overwritten_unless_asked(tmp_path):
    path = tmp_path / "k"
    write_key_file(path, SECRET)
    with pytest.raises(ClusterKeyError, match="already exists"):
        write_key_file(path)
    assert read_key_file(path) == ClusterKey(SECRET)
    new = write_key_file(path, overwrite=True)
    assert read_key_file(path) == new != ClusterKey(SECRET) and mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["k"]  # no temporary file left behind


def test_a_failed_write_leaves_neither_a_half_key_nor_a_temporary_copy(tmp_path, monkeypatch):
    path = tmp_path / "cluster.key"
    old = write_key_file(path)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # a fault injected where a full disk shows itself
    with pytest.raises(ClusterKeyError, match="No space left on device"):
        write_key_file(path, overwrite=True)
    with pytest.raises(ClusterKeyError, match="No space left on device"):
        write_key_file(tmp_path / "new.key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.key"]  # the old key, untouched
    assert read_key_file(path).fingerprint == old.fingerprint


def test_writing_does_not_follow_a_symlink_planted_at_the_path(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "k").symlink_to(victim)
    with pytest.raises(ClusterKeyError, match="already exists"):
        write_key_file(tmp_path / "k")
    assert victim.read_text() == "precious"


def test_key_files_load_with_surrounding_whitespace_and_either_case(tmp_path):
    path = tmp_path / "k"
    path.write_text(f"\n  {PREFIX}{SECRET.hex().upper()}  \r\n")
    path.chmod(0o600)
    assert read_key_file(path) == ClusterKey(SECRET)


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "not an exo-node cluster key"),
        (SECRET.hex().encode(), "not an exo-node cluster key"),  # the digits without the prefix
        (b'{"key": "x"}', "not an exo-node cluster key"),
        (b"-----BEGIN PRIVATE KEY-----\n", "not an exo-node cluster key"),
        ((PREFIX + SECRET.hex()[:-2]).encode(), r"malformed cluster key \(62 characters"),
        ((PREFIX + SECRET.hex() + "00").encode(), r"malformed cluster key \(66 characters"),
        ((PREFIX + SECRET.hex()[:-1] + "g").encode(), "malformed"),
        ((PREFIX + SECRET.hex() + "\n" + PREFIX + SECRET.hex()).encode(), "malformed"),
        (b"\xff\xfe" + TEXT.encode(), "not ASCII"),
        (b"x" * 5000, "5000 bytes"),
    ],
)
def test_malformed_key_files_are_clear_errors_that_never_quote_the_content(tmp_path, content, message):
    path = tmp_path / "k"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ClusterKeyError, match=message) as e:
        read_key_file(path)
    assert str(path) in str(e.value)  # says which file
    assert SECRET.hex()[:16] not in str(e.value).lower()


def test_missing_or_unreadable_key_files_are_clear_errors(tmp_path):
    with pytest.raises(ClusterKeyError, match="does not exist.*exo-node keygen"):
        read_key_file(tmp_path / "missing")
    with pytest.raises(ClusterKeyError, match="not a regular file"):
        read_key_file(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ClusterKeyError, match="not a regular file"):  # and it does not hang waiting for a writer
        read_key_file(tmp_path / "fifo")


def test_a_key_file_others_can_read_loads_with_a_warning(tmp_path, caplog):
    path = tmp_path / "k"
    path.write_text(TEXT)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert read_key_file(path) == ClusterKey(SECRET)
    assert "readable by others (mode 644)" in caplog.text and "chmod 600" in caplog.text
    caplog.clear()
    path.chmod(0o600)
    read_key_file(path)
    assert caplog.text == ""


def test_the_key_comes_from_the_file_else_the_environment_else_there_is_none(tmp_path):
    other = generate_secret()
    path = tmp_path / "k"
    write_key_file(path, SECRET)
    assert load_secret(path, env={ENV_VAR: encode_key(other)}) == ClusterKey(SECRET)  # the flag wins
    assert load_secret(None, env={ENV_VAR: encode_key(other) + "\n"}) == ClusterKey(other)
    assert load_secret(None, env={ENV_VAR: "  "}) is None
    assert load_secret(None, env={}) is None


def test_a_bad_environment_key_is_a_clear_error_with_a_hint_when_it_looks_like_a_path():
    with pytest.raises(ClusterKeyError, match=r"\$EXO_NODE_CLUSTER_KEY is not an exo-node cluster key"):
        load_secret(None, env={ENV_VAR: SECRET.hex()})
    with pytest.raises(ClusterKeyError, match="holds the key itself.*--cluster-key-file"):
        load_secret(None, env={ENV_VAR: "/etc/exo/cluster.key"})


def test_the_secret_never_shows_in_reprs_logs_or_pickles(caplog):
    key = ClusterKey(SECRET)
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("loaded %s %r", key, key)
        logging.getLogger("test").info(f"{key} {key!r} {[key]} { ({'k': key}) }")
    shown = repr(key) + str(key) + f"{key}" + caplog.text
    for leak in (SECRET.hex(), SECRET.hex().upper(), repr(SECRET), TEXT):
        assert leak not in shown
    assert "<redacted>" in repr(key) and key.fingerprint in repr(key)
    with pytest.raises(TypeError):
        vars(key)  # no __dict__ to dump
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(key)


def test_derived_keys_are_deterministic_distinct_per_purpose_and_not_the_secret():
    a, twin, b = ClusterKey(SECRET), ClusterKey(bytes(SECRET)), ClusterKey(generate_secret())
    assert a.discovery_key() == twin.discovery_key() != b.discovery_key()
    assert len(a.discovery_key()) == 32 and a.discovery_key() != SECRET
    assert a.derive(LABEL_CA) != a.discovery_key() == a.derive(LABEL_DISCOVERY)
    assert a.fingerprint == twin.fingerprint != b.fingerprint and len(a.fingerprint) == 16
    assert SECRET.hex()[:16] != a.fingerprint


@pytest.mark.parametrize("bad", [b"", b"x" * 31, b"x" * 33, "x" * 32, None])
def test_a_secret_of_the_wrong_size_or_type_is_refused(bad):
    with pytest.raises(ClusterKeyError, match="exactly 32 bytes"):
        ClusterKey(bad)


def test_keygen_writes_a_private_key_file_and_prints_only_its_fingerprint(tmp_path, capsys):
    out = tmp_path / "cluster.key"
    assert keygen_main(["--out", str(out)]) == 0
    key = read_key_file(out)
    printed = capsys.readouterr()
    assert key.fingerprint in printed.out and "--cluster-key-file" in printed.out
    assert out.read_text().strip() not in printed.out + printed.err and mode(out) == 0o600

    assert keygen_main(["--out", str(out)]) == 1  # refuses to replace it: the cluster would lose its key
    assert "already exists" in capsys.readouterr().err and read_key_file(out) == key
    assert keygen_main(["--out", str(out), "--force"]) == 0 and read_key_file(out) != key


def test_keygen_to_stdout_prints_the_key_for_piping(capsys):
    assert keygen_main(["--out", "-"]) == 0
    printed = capsys.readouterr()
    key = load_secret(None, env={ENV_VAR: printed.out})
    assert key is not None and key.fingerprint in printed.err and PREFIX not in printed.err


def test_keygen_default_file_lands_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert keygen_main([]) == 0
    assert mode(tmp_path / "exo-node-cluster.key") == 0o600


def test_the_node_flag_feeds_load_secret(tmp_path):
    ap = argparse.ArgumentParser()
    add_key_argument(ap)
    write_key_file(tmp_path / "k", SECRET)
    assert load_secret(
        ap.parse_args(["--cluster-key-file", str(tmp_path / "k")]).cluster_key_file, env={}
    ) == ClusterKey(SECRET)
    assert load_secret(ap.parse_args([]).cluster_key_file, env={}) is None
