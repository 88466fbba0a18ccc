"""Security: API keys (constant-time, never logged or echoed, per-tenant cache domains), cache_salt
isolation of context reuse, local media confinement, the chat-template sandbox, bind warnings."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from typer.testing import CliRunner

from tests.reliability.common import CHAT, COMPLETIONS, assert_error, metrics
from tests.serve_process import ServeProcess
from trtedge.runtime.core.block_manager import BlockManager
from trtedge.runtime.core.request import Sequence
from trtedge.runtime.sampling_params import SamplingParams
from trtedge.server.auth import KeyRing
from trtedge.server.config import ServeConfig, ServerConfigError
from trtedge.server.errors import APIError
from trtedge.server.media import resolve_local_media

KEYS = {"alice": "alice-secret-key-1", "bob": "bob-secret-key-2"}
WRONG = "mallory-guessed-key-3"
# 40 tokens: two full 16-token blocks that a later request may reuse
PROMPT = list(range(1000, 1040))


# ---- context reuse isolation: the block manager -----------------------------------------------
def _seq(salt: str | None) -> Sequence:
    seq = Sequence(PROMPT, SamplingParams(max_tokens=1, cache_salt=salt))
    seq.num_computed_tokens = len(PROMPT)
    return seq


def _reused(blocks: BlockManager, salt: str | None) -> int:
    seq = Sequence(PROMPT, SamplingParams(max_tokens=1, cache_salt=salt))
    blocks.lookup_prefix(seq)
    reused = seq.num_cached_tokens
    blocks.release(seq)
    return reused


def test_prefixes_are_reused_within_a_salt_and_never_across_salts():
    blocks = BlockManager(16, 16, enable_reuse=True)
    owner = _seq("tenant-a")
    blocks.grow(owner, len(PROMPT))
    blocks.publish(owner)
    blocks.release(owner)
    assert _reused(blocks, "tenant-a") == 32
    assert _reused(blocks, "tenant-b") == 0
    assert _reused(blocks, None) == 0  # unsalted requests do not see salted blocks either
    plain = _seq(None)
    blocks.grow(plain, len(PROMPT))
    blocks.publish(plain)
    blocks.release(plain)
    assert _reused(blocks, None) == 32 and _reused(blocks, "tenant-b") == 0


def test_cache_salt_is_validated():
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


# ---- API keys -------------------------------------------------------------------------------------
def test_key_ring_matches_tenants_and_refuses_the_rest():
    ring = KeyRing("shared-key", KEYS)
    assert ring.match("shared-key") == (True, None)
    assert ring.match(KEYS["bob"]) == (True, "bob")
    assert ring.match(WRONG) == (False, None)
    assert ring.match("") == (False, None) and ring.match(None) == (False, None)
    assert not KeyRing() and KeyRing(None, KEYS)


def test_api_key_file_is_validated_and_keys_never_show_in_repr(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    config = ServeConfig(api_key="top-secret", api_key_file=str(path))
    assert config.api_keys == KEYS
    assert "top-secret" not in repr(config) and KEYS["alice"] not in repr(config)
    for content, message in (
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
        ('{"a": ""}', "non-empty string key"),
        ('{"a": "k", "b": "k"}', "share a key"),
        ("{}", "empty"),
    ):
        path.write_text(content)
        with pytest.raises(ServerConfigError, match=message):
            ServeConfig(api_key_file=str(path))
    with pytest.raises(ServerConfigError, match="--api-key-file: cannot read"):
        ServeConfig(api_key_file=str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("host", "key", "warned"), [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)]
)
def test_binding_beyond_loopback_without_a_key_warns(tmp_path, host, key, warned):
    from trtedge.cli import app

    args = ["serve", str(tmp_path / "missing.gguf"), "--host", host] + (["--api-key", key] if key else [])
    result = CliRunner().invoke(app, args, env={"TRTEDGE_API_KEY": ""})
    assert result.exit_code == 2
    assert ("warning: serving on 0.0.0.0 without --api-key" in result.output) == warned


def test_default_bind_is_loopback():
    assert ServeConfig().host == "127.0.0.1"


# ---- local media --------------------------------------------------------------------------------
@pytest.fixture()
def media(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "cat.png").write_bytes(b"png")
    (root / "sub" / "dog.png").write_bytes(b"png")
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    os.symlink(secret, root / "escape.png")
    os.symlink(root / "cat.png", root / "sub" / "alias.png")
    return root, secret


def test_local_media_inside_the_allowed_directory_resolves(media):
    root, _ = media
    real = os.path.realpath(root)
    assert str(resolve_local_media(f"file://{root}/cat.png", str(root))) == f"{real}/cat.png"
    assert str(resolve_local_media("sub/dog.png", str(root))) == f"{real}/sub/dog.png"
    assert str(resolve_local_media(f"file://{root}/sub/../cat.png", str(root))) == f"{real}/cat.png"
    assert str(resolve_local_media(f"{root}/sub/alias.png", str(root))) == f"{real}/cat.png"  # symlink inside


@pytest.mark.parametrize(
    "url",
    [
        "file://{root}/../secret.txt",
        "file://{root}/%2e%2e/secret.txt",
        "../secret.txt",
        "sub/../../secret.txt",
        "{root}/escape.png",
        "file://{secret}",
        "/etc/passwd",
        "file:///etc/passwd",
    ],
)
def test_local_media_outside_the_allowed_directory_is_403(media, url):
    root, secret = media
    with pytest.raises(APIError) as e:
        resolve_local_media(url.format(root=root, secret=secret), str(root), param="messages.0.content.0")
    assert e.value.status == 403 and e.value.code == "local_media_forbidden"
    assert e.value.param == "messages.0.content.0" and str(root) not in e.value.message


def test_local_media_refused_when_not_enabled_missing_or_malformed(media):
    root, _ = media
    assert resolve_error(f"file://{root}/cat.png", None) == 403
    assert resolve_error(f"file://{root}/nope.png", str(root)) == 404
    assert resolve_error(f"file://evil.example/{root}/cat.png", str(root)) == 400
    assert resolve_error("file://", str(root)) == 400


def resolve_error(url: str, allowed: str | None) -> int:
    with pytest.raises(APIError) as e:
        resolve_local_media(url, allowed)
    return e.value.status


# ---- chat templates -------------------------------------------------------------------------------
def test_message_content_with_jinja_syntax_is_rendered_literally(smollm):
    content = "{{ 7*7 }} {% for x in range(3) %}loop{% endfor %} {{ raise_exception('x') }}"
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    assert content in text and "49" not in text and "looploop" not in text


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% for m in messages %}{{ m.__class__.__base__.__subclasses__() }}{% endfor %}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ 'a' * 10**10 }}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_a_hostile_chat_template_is_stopped_by_the_sandbox(smollm, template):
    from trtedge.runtime.text.tokenizer import TemplateError, Tokenizer

    tok = Tokenizer(smollm.tokenizer._backend.to_str(), {}, chat_template=template)
    with pytest.raises(TemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- over HTTP: keys, tenants, salts ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    args = ["--max-kv-cache-capacity", "256", "--max-input-len", "128", "--enable-context-reuse"]
    args += ["--api-key-file", str(keys), "--log-level", "debug"]
    server = ServeProcess(tmp_path_factory, args)
    yield server
    server.stop()


def _post(server, key: str, body: dict, path: str = COMPLETIONS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_wrong_keys_get_401_without_echo(server):
    for headers in ({"Authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG}, {}):
        r = httpx.post(server.url + CHAT, json={"messages": []}, headers=headers, timeout=30)
        assert_error(r, 401, "invalid_api_key")
        assert WRONG not in r.text and all(k not in r.text for k in KEYS.values())
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_tenants_and_salts_never_share_cached_prefixes(server):
    body = {"prompt": PROMPT, "max_tokens": 1}

    def hits_after(key: str, **extra) -> float:
        before = metrics(server.url)["trtedge_prefix_cache_hits"]
        assert _post(server, key, {**body, **extra}).status_code == 200
        return metrics(server.url)["trtedge_prefix_cache_hits"] - before

    assert hits_after(KEYS["alice"]) == 0  # cold
    assert hits_after(KEYS["bob"]) == 0  # another tenant: no reuse of alice's prefix
    assert hits_after(KEYS["alice"]) == 1  # the same tenant reuses
    assert hits_after(KEYS["alice"], cache_salt="conversation-1") == 0
    assert hits_after(KEYS["alice"], cache_salt="conversation-2") == 0
    assert hits_after(KEYS["alice"], cache_salt="conversation-1") == 1
    assert hits_after(KEYS["bob"], cache_salt="conversation-1") == 0  # same salt, other tenant


def test_error_bodies_and_logs_hold_no_keys_paths_or_tracebacks(server):
    cases = [
        ({"prompt": PROMPT, "model": "../../etc/passwd"}, 404),
        ({"prompt": [10**9]}, 400),
        ({"prompt": "x", "max_tokens": 10**12}, 400),
        ({"prompt": "x", "cache_salt": ""}, 400),
    ]
    for body, status in cases:
        assert_error(_post(server, KEYS["alice"], body), status)
    server.stop()
    log = server.err.read_text() + server.out.read_text()
    assert "Traceback" not in log
    assert all(k not in log for k in (*KEYS.values(), WRONG))
