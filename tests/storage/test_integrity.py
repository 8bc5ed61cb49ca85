"""Keyed integrity tags (lmc.storage.integrity): what verifies, what is refused, and the secret's
configuration (never shown).

Threat model: ``docs/threats/tiers.md``."""

from __future__ import annotations

import os

import pytest
import torch

from lmc.config import CacheConfig
from lmc.storage.chain import check_chain
from lmc.storage.integrity import Integrity
from lmc.storage.serde import HEADER_SIZE, TAG_SIZE, CorruptValue, decode_header, encode_header

SECRET = "0123456789abcdef0123456789abcdef"
KEY = bytes(range(16))


def _value(n: int = 4096) -> tuple[bytes, bytes]:
    payload = os.urandom(n)
    header = encode_header(KEY, (1, 1, n // 4, 1), torch.float32, n // 4, payload, tagged=True)
    return header, payload


def test_seal_then_check_and_every_flip_refused():
    it = Integrity(SECRET)
    header, payload = _value()
    tag = it.seal(KEY, header, payload)
    assert len(tag) == TAG_SIZE
    it.check(KEY, header, tag, payload)
    assert it.seal(KEY, header, payload) != tag  # fresh nonce per value
    for _name, k, h, t, p in [
        ("payload", KEY, header, tag, payload[:100] + bytes([payload[100] ^ 1]) + payload[101:]),
        ("header", KEY, header[:40] + bytes([header[40] ^ 1]) + header[41:], tag, payload),
        ("nonce", KEY, header, bytes([tag[0] ^ 1]) + tag[1:], payload),
        ("mac", KEY, header, tag[:-1] + bytes([tag[-1] ^ 1]), payload),
        ("other key", b"\xff" * 16, header, tag, payload),
        ("short tag", KEY, header, tag[:-1], payload),
        ("truncated payload", KEY, header, tag, payload[:-1]),
    ]:
        with pytest.raises(CorruptValue):
            it.check(k, h, t, p)


def test_wrong_secret_refused():
    header, payload = _value()
    tag = Integrity(SECRET).seal(KEY, header, payload)
    with pytest.raises(CorruptValue, match="does not verify"):
        Integrity(SECRET[::-1]).check(KEY, header, tag, payload)


def test_reader_accepts_only_its_own_version():
    header, payload = _value()
    assert decode_header(header, KEY, tagged=True).tagged
    with pytest.raises(CorruptValue, match="no integrity_secret is set here"):
        decode_header(header, KEY)
    plain = encode_header(KEY, (1, 1, 1024, 1), torch.float32, 1024, payload)
    assert not decode_header(plain, KEY).tagged
    with pytest.raises(CorruptValue, match="no integrity tag"):
        decode_header(plain, KEY, tagged=True)
    assert len(header) == len(plain) == HEADER_SIZE


def test_secret_configuration(tmp_path):
    assert Integrity.from_config(CacheConfig()) is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Integrity.from_config(CacheConfig(integrity_secret="short"))
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    header, payload = _value()
    from_file = Integrity.from_config(CacheConfig(integrity_secret_file=str(f)))
    Integrity(SECRET).check(KEY, header, from_file.seal(KEY, header, payload), payload)
    with pytest.raises(ValueError, match="not both"):
        Integrity.from_config(CacheConfig(integrity_secret=SECRET, integrity_secret_file=str(f)))
    with pytest.raises(ValueError, match="cannot read"):
        Integrity.from_config(CacheConfig(integrity_secret_file=str(tmp_path / "none")))
    env = CacheConfig.load(environ={"LMC_INTEGRITY_SECRET": SECRET})
    assert env.integrity_secret == SECRET
    assert SECRET not in repr(env) and SECRET not in repr(Integrity(SECRET))
    assert SECRET not in repr(CacheConfig(remote_token=SECRET))


def test_missing_cryptography_names_the_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(RuntimeError, match=r"lmc-kvcache\[integrity\]"):
        Integrity(SECRET)


# --------------------------------------------------- the secret, as a careless operator gives it
# Threat model: docs/threats/tiers.md (who holds the secret, and who may read its file).
def _file(tmp_path, content: str, mode: int = 0o600):
    f = tmp_path / f"secret-{mode:o}-{len(content)}"
    f.write_text(content)
    os.chmod(f, mode)
    return f


@pytest.mark.parametrize("content", [" " * 24, "\t\n " * 8, " " * 10 + "short" + " " * 10])
def test_inline_and_file_secrets_follow_one_rule(tmp_path, content):
    """24 spaces (or a short secret padded to length) are refused inline exactly as in a
    file, each error naming its setting: whitespace around a secret is not secret."""
    with pytest.raises(ValueError, match=r"^integrity_secret[ :]") as inline:
        Integrity.from_config(CacheConfig(integrity_secret=content))
    f = _file(tmp_path, content)
    with pytest.raises(ValueError, match=rf"^integrity_secret_file '{f}'") as in_file:
        Integrity.from_config(CacheConfig(integrity_secret_file=str(f)))
    for e in (inline, in_file):
        assert "16 bytes" in str(e.value) or "whitespace" in str(e.value)
    with pytest.raises(ValueError, match="integrity_secret"):  # lmc config's check too
        check_chain(CacheConfig(integrity_secret=content))


def test_a_padded_secret_is_the_same_secret_inline_and_in_a_file(tmp_path):
    header, payload = _value()
    inline = Integrity.from_config(CacheConfig(integrity_secret=f"  {SECRET} \n"))
    in_file = Integrity.from_config(CacheConfig(
        integrity_secret_file=str(_file(tmp_path, f"{SECRET}\n"))))
    Integrity(SECRET).check(KEY, header, inline.seal(KEY, header, payload), payload)
    Integrity(SECRET).check(KEY, header, in_file.seal(KEY, header, payload), payload)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_file_others_may_read_is_used_with_a_warning(tmp_path, caplog, mode):
    f = _file(tmp_path, SECRET, mode)
    with caplog.at_level("WARNING", logger="lmc.storage.integrity"):
        assert Integrity.from_config(CacheConfig(integrity_secret_file=str(f))) is not None
        Integrity.from_config(CacheConfig(integrity_secret_file=str(f)))
    warned = [r.getMessage() for r in caplog.records if str(f) in r.getMessage()]
    assert len(warned) == 1, warned  # once per file and mode: logs stay bounded
    assert f"{mode:04o}" in warned[0] and "chmod 600" in warned[0]
    assert SECRET not in caplog.text


def test_a_private_secret_file_is_used_quietly(tmp_path, caplog):
    f = _file(tmp_path, SECRET, 0o600)
    with caplog.at_level("WARNING", logger="lmc.storage.integrity"):
        assert Integrity.from_config(CacheConfig(integrity_secret_file=str(f))) is not None
    assert not caplog.records


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_secret_file_others_may_rewrite_is_refused(tmp_path, mode):
    """Whoever can rewrite the file chooses the secret, and then forges values."""
    f = _file(tmp_path, SECRET, mode)
    with pytest.raises(ValueError, match=rf"integrity_secret_file '{f}'.*{mode:04o}.*chmod 600"):
        Integrity.from_config(CacheConfig(integrity_secret_file=str(f)))


def test_a_secret_file_that_is_not_a_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=rf"integrity_secret_file '{tmp_path}'"):
        Integrity.from_config(CacheConfig(integrity_secret_file=str(tmp_path)))


def test_a_bad_inline_secret_is_refused_where_it_was_given(tmp_path):
    """Refused when the config loads, naming the variable or the file's line."""
    from lmc.settings import ConfigError

    with pytest.raises(ConfigError, match="environment variable LMC_INTEGRITY_SECRET"):
        CacheConfig.load(environ={"LMC_INTEGRITY_SECRET": " " * 24})
    y = tmp_path / "c.yaml"
    y.write_text("chunk_size: 16\nintegrity_secret: '                        '\n")
    with pytest.raises(ConfigError, match=rf"only whitespace.*{y}:2"):
        CacheConfig.load(y, environ={})
    with pytest.raises(ConfigError, match="integrity_secret: at least 16 bytes"):
        CacheConfig(integrity_secret="    0123456789    ")
    assert CacheConfig.load(environ={"LMC_INTEGRITY_SECRET": SECRET}).integrity_secret == SECRET
