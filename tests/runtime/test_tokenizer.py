import datetime
import json
import random

import jinja2
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from trtedge.runtime.text.tokenizer import IncrementalDetokenizer, TemplateError, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello tokenizer!",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Le café est très bon à Paris; où est la bibliothèque? Ça va, garçon, élève.",
    "Über straße schön, Größe und Äpfel. ¿Dónde está el niño? Açaí, pão, coração.",
    "我们今天去公园散步，天气很好。你好世界，中文分词测试。",
    "日本語のテキストも少し。こんにちは世界。",
    "Привет, мир! Как дела? Съешь ещё этих мягких французских булок.",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷 with zwj 👨‍👩‍👧 sequences.",
    "Numbers 1234567890, symbols @#$%^&*()[]{}<>|\\ and tabs\tand  double  spaces.",
] * 3
SAMPLES = [
    "Hello world",
    "Le café est très bon à Paris; où?",
    "我们今天去公园散步，天气很好。",
    "Emoji 😀🎉👍🏽 and 👨‍👩‍👧 and ✨🦄",
    "Привет, мир!  Tabs\tand\nnewlines\n\n",
    "Rare: 龘 鱻 𠀋 ÿ ǅ ₿",
    " leading space and trailing space ",
]


def _byte_level_backend() -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    return tok


def _sentencepiece_backend(decoder_style: str) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=70)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    if decoder_style == "llama":
        spec["decoder"] = json.loads(
            decoders.Sequence(
                [
                    decoders.Replace("▁", " "),
                    decoders.ByteFallback(),
                    decoders.Fuse(),
                    decoders.Strip(" ", 1, 0),
                ]
            ).__getstate__()
        )
    else:
        spec["normalizer"] = None
        spec["pre_tokenizer"] = json.loads(pre_tokenizers.Metaspace(prepend_scheme="first").__getstate__())
        spec["decoder"] = json.loads(
            decoders.Sequence(
                [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
            ).__getstate__()
        )
    return BackendTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def byte_level_json() -> str:
    return _byte_level_backend().to_str()


@pytest.fixture(scope="module")
def sp_jsons() -> dict[str, str]:
    return {style: _sentencepiece_backend(style).to_str() for style in ("llama", "metaspace")}


@pytest.fixture(scope="module")
def bl(byte_level_json) -> Tokenizer:
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return Tokenizer(byte_level_json, config, CHATML, {"eos_token_id": [0, 2]})


def _sp_tokenizer(sp_jsons, style: str) -> Tokenizer:
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    return Tokenizer(sp_jsons[style], config)


# ---------------------------------------------------------------- encode / decode


def test_round_trip_byte_level(bl):
    for text in SAMPLES:
        ids = bl.encode(text)
        assert bl.decode(ids) == text
    assert bl.vocab_size == 700 + 2


def test_round_trip_sentencepiece_byte_fallback(sp_jsons):
    for style in sp_jsons:
        tok = _sp_tokenizer(sp_jsons, style)
        for text in SAMPLES[:-1]:
            ids = tok.encode(text)
            assert ids[0] == tok.bos_token_id
            assert tok.decode(ids) == text
        assert any(tok.id_to_token(i).startswith("<0x") for i in tok.encode("Rare: 龘 ₿"))


def test_special_tokens_and_lookup(bl):
    assert bl.bos_token is None and bl.bos_token_id is None
    assert bl.eos_token == "<|im_end|>"
    im_end = bl.token_to_id("<|im_end|>")
    assert bl.id_to_token(im_end) == "<|im_end|>"
    assert bl.token_to_id("definitely-not-a-token") is None
    assert bl.id_to_token(10**6) is None
    ids = bl.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == bl.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert bl.decode(ids) == "user\nhi"
    assert bl.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert bl.decode(bl.encode("<think>x</think>")) == "<think>x</think>"


def test_bos_added_once(byte_level_json):
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "add_bos_token": True}
    tok = Tokenizer(byte_level_json, config)
    bos = tok.bos_token_id
    assert bos == tok.token_to_id("<|begin_of_text|>")
    assert tok.encode("hi")[0] == bos
    assert tok.encode("<|begin_of_text|>hi").count(bos) == 1
    assert tok.encode("<|begin_of_text|>hi") == tok.encode("hi")
    assert bos not in tok.encode("hi", add_special_tokens=False)
    assert tok.encode("") == [bos]
    assert not Tokenizer(byte_level_json, {**config, "add_bos_token": False}).encode("hi").count(bos)


def test_add_bos_detected_from_post_processor(byte_level_json):
    backend = BackendTokenizer.from_str(byte_level_json)
    bos_id = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos_id)],
    )
    tok = Tokenizer(backend.to_str(), {"bos_token": "<|begin_of_text|>"})
    assert tok.add_bos_token
    assert tok.encode("hi").count(bos_id) == 1
    assert not Tokenizer(
        backend.to_str(), {"bos_token": "<|begin_of_text|>", "add_bos_token": False}
    ).add_bos_token
    assert not Tokenizer(byte_level_json, {"bos_token": "<|begin_of_text|>"}).add_bos_token


def test_eos_token_ids_union(byte_level_json):
    config = {"eos_token": {"content": "<|im_end|>", "special": True}}
    im_end, eot = 2, 0
    assert Tokenizer(byte_level_json, config).eos_token_ids == frozenset({im_end})
    assert Tokenizer(byte_level_json, config, None, {"eos_token_id": eot}).eos_token_ids == {im_end, eot}
    assert Tokenizer(byte_level_json, config, None, {"eos_token_id": [eot, im_end, 3]}).eos_token_ids == {
        0,
        2,
        3,
    }
    assert Tokenizer(byte_level_json, {}, None, {"eos_token_id": None}).eos_token_ids == frozenset()


# ---------------------------------------------------------------- from_dir


def _write_dir(path, tokenizer_json, config, files=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content, encoding="utf-8")
    return path


def test_from_dir_chat_template_sources(tmp_path, byte_level_json):
    config = {"eos_token": "<|im_end|>", "chat_template": "from-config"}
    gen = json.dumps({"eos_token_id": [0, 2]})
    only_json = _write_dir(tmp_path / "tokenizer_only", byte_level_json, {})
    assert Tokenizer.from_dir(only_json).chat_template is None
    assert Tokenizer.from_dir(only_json).eos_token_ids == frozenset()

    in_config = _write_dir(tmp_path / "config", byte_level_json, config, {"generation_config.json": gen})
    tok = Tokenizer.from_dir(in_config)
    assert tok.chat_template == "from-config" and tok.eos_token_ids == {0, 2}

    legacy = json.dumps({"chat_template": "from-json"})
    json_dir = _write_dir(tmp_path / "json", byte_level_json, config, {"chat_template.json": legacy})
    assert Tokenizer.from_dir(str(json_dir)).chat_template == "from-json"

    files = {"chat_template.json": legacy, "chat_template.jinja": CHATML}
    jinja_dir = _write_dir(tmp_path / "jinja", byte_level_json, config, files)
    tok = Tokenizer.from_dir(jinja_dir)
    assert tok.chat_template == CHATML
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")

    files = {"chat_template.jinja": "default", "additional_chat_templates/tool_use.jinja": "tools!"}
    extra_dir = _write_dir(tmp_path / "extra", byte_level_json, config, files)
    tok = Tokenizer.from_dir(extra_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "tools!"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "default"


def test_from_dir_special_tokens_map_fallback(tmp_path, byte_level_json):
    files = {
        "special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"})
    }
    path = _write_dir(tmp_path / "m", byte_level_json, {"bos_token": "<|begin_of_text|>"}, files)
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token == "<|endoftext|>" and tok.bos_token == "<|begin_of_text|>"


# ---------------------------------------------------------------- chat templates

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'ignored' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

RAISING = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported: ' + messages[0].content) }}"
    "{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)
STRFTIME = "Today: {{ strftime_now('%Y-%m-%d') }}\n{% for m in messages %}{{ m.content }}{% endfor %}"
LOOP_CONTROLS = """{% for m in messages %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{% if loop.index > 4 %}{% break %}{% endif %}
{{ loop.index }}:{{ m.role }}={{ m.content }}
{% endfor %}"""
KWARGS = """{% if persona is defined %}persona={{ persona }} {% endif %}effort={{ reasoning_effort | default('medium') }}
think={{ enable_thinking | default('unset') }} docs={{ documents }} eos={{ eos_token }} pad={{ pad_token }}
tools={{ tools | tojson(indent=2, sort_keys=True) }}
{{ messages | tojson(separators=(',', ':')) }}
{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"""
MULTI = [
    {"name": "default", "template": "default:{% for m in messages %}{{ m.content }}{% endfor %}"},
    {
        "name": "tool_use",
        "template": "tools:{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}",
    },
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo / 天气 for a city, in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "Explain café in 中文 😀"},
        {"role": "assistant", "content": "咖啡 ☕"},
        {"role": "user", "content": "And <tool_response>?"},
    ],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}},
            ],
        },
        {"role": "tool", "content": "21 °C"},
        {"role": "tool", "content": "23 °C"},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\nParis 21, Nice 23."},
        {"role": "user", "content": "Thanks"},
        {"role": "ignored", "content": "skip"},
    ],
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, byte_level_json):
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return _write_dir(tmp_path_factory.mktemp("hf"), byte_level_json, config)


def _pair(hf_dir, template):
    from transformers import PreTrainedTokenizerFast

    specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(hf_dir / "tokenizer.json"), chat_template=template, **specials
    )
    ours = Tokenizer((hf_dir / "tokenizer.json").read_text(encoding="utf-8"), specials, template)
    return hf, ours


def _hf_render(hf, messages, add_generation_prompt, tools, kwargs):
    return hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
    )


@pytest.mark.parametrize("template", [CHATML, LLAMA3, QWEN3, STRFTIME, LOOP_CONTROLS, KWARGS, MULTI])
def test_chat_template_parity_with_transformers(hf_dir, template):
    hf, ours = _pair(hf_dir, template)
    variants = [
        (None, None, None, {}),
        (TOOLS, None, None, {}),
        (None, False, None, {}),
        (TOOLS, True, "high", {"persona": "pirate 🏴‍☠️"}),
    ]
    renders = 0
    for messages in CONVERSATIONS:
        if template is CHATML and any(m.get("content") is None for m in messages):
            continue
        for add_generation_prompt in (True, False):
            for tools, enable_thinking, effort, custom in variants:
                hf_kwargs = dict(custom)
                if enable_thinking is not None:
                    hf_kwargs["enable_thinking"] = enable_thinking
                if effort is not None:
                    hf_kwargs["reasoning_effort"] = effort
                expected = _hf_render(hf, messages, add_generation_prompt, tools, hf_kwargs)
                got = ours.apply_chat_template(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    enable_thinking=enable_thinking,
                    reasoning_effort=effort,
                    chat_template_kwargs=custom,
                )
                assert got == expected
                token_kwargs = dict(add_generation_prompt=add_generation_prompt, tools=tools, **hf_kwargs)
                hf_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **token_kwargs)
                assert ours.encode_chat(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    enable_thinking=enable_thinking,
                    reasoning_effort=effort,
                    chat_template_kwargs=custom,
                ) == list(hf_ids)
                renders += 1
    assert renders >= 16


def test_template_specifics(hf_dir):
    _, ours = _pair(hf_dir, QWEN3)
    user = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(user, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(user, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert '"description": "Météo / 天气 for a city, in °C"' in ours.apply_chat_template(user, tools=TOOLS)
    _, llama = _pair(hf_dir, LLAMA3)
    assert llama.apply_chat_template(user).startswith("<|begin_of_text|><|start_header_id|>system")
    assert llama.encode_chat(user).count(llama.bos_token_id) == 1
    _, dated = _pair(hf_dir, STRFTIME)
    today = datetime.date.today()
    assert dated.apply_chat_template(user) in {f"Today: {d}\nhi" for d in (today, datetime.date.today())}
    _, kw = _pair(hf_dir, KWARGS)
    rendered = kw.apply_chat_template(user, chat_template_kwargs={"persona": "pirate", "enable_thinking": 1})
    assert rendered.startswith("persona=pirate effort=medium\nthink=1 docs=None")
    assert "think=0" in kw.apply_chat_template(
        user, enable_thinking=0, chat_template_kwargs={"enable_thinking": 1}
    )


def test_raise_exception_parity(hf_dir):
    hf, ours = _pair(hf_dir, RAISING)
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError, match="System role not supported: be nice"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TemplateError) as info:
        ours.apply_chat_template(messages)
    assert str(info.value) == "System role not supported: be nice"
    assert ours.apply_chat_template(messages[1:]) == hf.apply_chat_template(messages[1:], tokenize=False)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% set _ = messages[0].update({'role': 'system'}) %}x",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__.keys() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ (messages | attr('__class__')).__name__ }}",
    ],
)
def test_sandbox_blocks_escapes(byte_level_json, template):
    tok = Tokenizer(byte_level_json, {}, template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="unsafe"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_sandbox_unsafe_attribute_is_undefined(byte_level_json):
    # As in jinja2 and transformers, merely printing an unsafe attribute yields an empty undefined.
    tok = Tokenizer(byte_level_json, {}, "[{{ raise_exception.__globals__ }}{{ ''.__class__ }}]")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[]"


def test_template_errors(byte_level_json):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="no chat template.*apply_chat_template=False"):
        Tokenizer(byte_level_json, {}).apply_chat_template(messages)
    with pytest.raises(TemplateError, match="Invalid chat template"):
        Tokenizer(byte_level_json, {}, "{% for m in messages %}").apply_chat_template(messages)
    with pytest.raises(TemplateError, match="empty conversation"):
        Tokenizer(byte_level_json, {}, CHATML).apply_chat_template([])
    with pytest.raises(TemplateError):
        Tokenizer(byte_level_json, {}, "{{ messages[0].content + 1 }}").apply_chat_template(messages)
    with pytest.raises(TemplateError, match="none is 'default'"):
        Tokenizer(byte_level_json, {}, [MULTI[1]]).apply_chat_template(messages)
    assert issubclass(TemplateError, ValueError)


# ---------------------------------------------------------------- incremental detokenizer


def _stream(tok, ids, skip=True, prompt_ids=None):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.token_ids == list(ids)
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def _random_ids(rng, tok, byte_ids, length):
    special = sorted(tok.special_token_ids)
    ids = []
    while len(ids) < length:
        roll = rng.random()
        if roll < 0.35:
            ids.append(rng.choice(byte_ids))
        elif roll < 0.45:
            ids.append(rng.choice(special))
        elif roll < 0.6:
            ids.extend(tok.encode(rng.choice(SAMPLES), add_special_tokens=False)[: rng.randint(1, 6)])
        else:
            ids.append(rng.randrange(tok.vocab_size))
    return ids[:length]


def _tokenizers(byte_level_json, sp_jsons):
    bl = Tokenizer(byte_level_json, {"eos_token": "<|im_end|>"})
    bl_bytes = [bl.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    yield bl, bl_bytes
    for style in sp_jsons:
        sp = _sp_tokenizer(sp_jsons, style)
        yield sp, [sp.token_to_id(f"<0x{b:02X}>") for b in range(256)]


def test_detokenizer_matches_decode_on_random_ids(byte_level_json, sp_jsons):
    for tok, byte_ids in _tokenizers(byte_level_json, sp_jsons):
        rng = random.Random(1234)
        for _ in range(300):
            ids = _random_ids(rng, tok, byte_ids, rng.randint(1, 40))
            for skip in (True, False):
                deltas, tail = _stream(tok, ids, skip)
                assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip), ids
                assert not any(d.endswith("\ufffd") for d in deltas)


def test_detokenizer_streams_multibyte_text(byte_level_json, sp_jsons):
    for tok, byte_ids in _tokenizers(byte_level_json, sp_jsons):
        for text in SAMPLES:
            ids = tok.encode(text, add_special_tokens=False)
            deltas, tail = _stream(tok, ids)
            assert "".join(deltas) + tail == tok.decode(ids)
            assert "\ufffd" not in "".join(deltas) + tail
            if ids[-1] not in byte_ids:
                assert tail == ""


def test_detokenizer_holds_partial_characters(byte_level_json):
    tok = Tokenizer(byte_level_json, {})
    char_of_byte = _bytes_to_unicode()
    ids = [tok.token_to_id(char_of_byte[b]) for b in "é😀".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["", "é", "", "", "", "😀"]
    assert detok.flush() == ""
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids[2:4]] == ["", ""]
    assert detok.flush() == tok.decode(ids[2:4]) == "\ufffd"
    assert detok.text == "\ufffd"


def test_detokenizer_byte_fallback_run_is_all_or_nothing(sp_jsons):
    tok = _sp_tokenizer(sp_jsons, "llama")
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    word = tok.encode("hello", add_special_tokens=False)
    ids = [byte[b] for b in "中".encode()] + [byte[0xE4]] + word
    assert tok.decode(ids).startswith("\ufffd" * 4)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    valid = [byte[b] for b in "中文".encode()] + word
    deltas, tail = _stream(tok, valid)
    assert deltas[:6] == [""] * 6 and deltas[6].startswith("中文")


def test_detokenizer_prompt_context_keeps_leading_space(sp_jsons, byte_level_json):
    for style in sp_jsons:
        tok = _sp_tokenizer(sp_jsons, style)
        prompt = tok.encode("The capital of France is")
        output = tok.encode("Paris, très bien 中文", add_special_tokens=False)
        assert tok.id_to_token(output[0]).startswith("▁")
        deltas, tail = _stream(tok, output, prompt_ids=prompt)
        assert "".join(deltas) + tail == " Paris, très bien 中文"
        deltas, tail = _stream(tok, output)
        assert "".join(deltas) + tail == tok.decode(output) == "Paris, très bien 中文"
    for tok, byte_ids in _tokenizers(byte_level_json, sp_jsons):
        rng = random.Random(99)
        checked = 0
        for _ in range(200):
            prompt = _random_ids(rng, tok, byte_ids, rng.randint(1, 12))
            output = _random_ids(rng, tok, byte_ids, rng.randint(1, 20))
            for skip in (True, False):
                prompt_text = tok.decode(prompt, skip_special_tokens=skip)
                full_text = tok.decode(prompt + output, skip_special_tokens=skip)
                if (
                    prompt[-1] in byte_ids
                    or prompt_text.endswith("\ufffd")
                    or not full_text.startswith(prompt_text)
                ):
                    continue
                deltas, tail = _stream(tok, output, skip, prompt_ids=prompt)
                assert "".join(deltas) + tail == full_text[len(prompt_text) :], (prompt, output, skip)
                checked += 1
        assert checked > 100


def _bytes_to_unicode() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def test_detokenizer_prompt_context_edges(sp_jsons):
    tok = _sp_tokenizer(sp_jsons, "llama")
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    paris = tok.encode("Paris", add_special_tokens=False)
    # A prompt ending in many skipped special tokens still gives the first output token its context.
    prompt = tok.encode("The capital is") + [tok.token_to_id("</s>")] * 8
    deltas, tail = _stream(tok, paris, prompt_ids=prompt)
    assert "".join(deltas) + tail == " Paris"
    # A prompt ending inside a ByteFallback run that the output completes.
    prompt = tok.encode("x") + [byte[b] for b in "中文".encode()]
    output = [byte[b] for b in "字".encode()] + paris
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert expected == "字 Paris"
    deltas, tail = _stream(tok, output, prompt_ids=prompt)
    assert "".join(deltas) + tail == expected
