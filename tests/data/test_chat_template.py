"""Chat templates: found where transformers finds them, rendered as transformers renders them,
inside a sandbox that attacking templates cannot leave."""

import json
from datetime import datetime

import pytest

from fusion.checkpoint import CheckpointError
from fusion.data import ChatTemplate, ChatTemplateError, load_chat_template, load_special_tokens

MESSAGES = [
    {"role": "user", "content": "Hi <b>&</b> \u00e9"},
    {"role": "assistant", "content": "Hello."},
]


def test_renders_as_transformers(model_dirs):
    """Same text as transformers' render for the families' templates and for the globals
    transformers provides (tojson without HTML escapes, loop controls, namespace, dict)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (
        "{{ bos_token }}{% set ns = namespace(count=0) %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% set ns.count = ns.count + 1 %}"
        "{{ m['role'] | capitalize }}: {{ m['content'] | tojson }}"
        "{{ dict(a=1) | tojson }}{% if loop.index > 5 %}{% break %}{% endif %}\n{% endfor %}"
        "{{ ns.count }}{% if add_generation_prompt %}Assistant:{% endif %}"
    )
    conversations = [
        [{"role": "system", "content": "skip"}, *MESSAGES],
        [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}],
    ]
    for conversation in conversations:
        for add in (False, True):
            ours = ChatTemplate(source, special_tokens={"bos_token": "<s>"}).render(
                conversation, add_generation_prompt=add
            )
            (theirs,), _ = render_jinja_template(
                [conversation], chat_template=source, add_generation_prompt=add, bos_token="<s>"
            )
            assert ours == theirs
    rendered = ChatTemplate(source).render(MESSAGES)
    assert 'User: "Hi <b>&</b> \u00e9"' in rendered  # not HTML-escaped
    # The families' templates, as their processors render them.
    for family in ("llava", "idefics3", "smolvlm"):
        directory, processor = model_dirs[family]
        template = ChatTemplate.from_directory(directory)
        conversation = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ]
        for add in (False, True):
            expected = processor.apply_chat_template(conversation, add_generation_prompt=add)
            assert template.render(conversation, add_generation_prompt=add) == expected


def test_raise_exception_and_strftime():
    template = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(ChatTemplateError, match="chat template: TemplateError: only user and"):
        template.render(MESSAGES)
    year = ChatTemplate("{{ strftime_now('%Y') }}").render(MESSAGES)
    assert year == str(datetime.now().year)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for %}")
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        ChatTemplate("{{ missing.attribute }}").render(MESSAGES)


ATTACKS = [
    # Python internals from any object or global.
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ range.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ (messages|first).items.__self__ }}",
    # Namespaces cannot hold or reach underscore attributes.
    "{% set ns = namespace(_hidden=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{% set ns = namespace() %}{{ ns.__dict__.items() }}",
    # Mutating what the caller passed in.
    "{{ messages.append(1) }}",
    "{{ messages[0].update(role='system') }}",
    "{{ messages[0].clear() }}",
    # Huge values in one step.
    "{{ range(10**10) | list }}",
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**10 }}",
    "{{ 'x' | center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ lipsum(10**9) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 10 ** 1000000000 }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
]


@pytest.mark.parametrize("source", ATTACKS)
def test_attacks_are_refused(source):
    with pytest.raises(ChatTemplateError, match="chat template: ") as caught:
        ChatTemplate(source).render(MESSAGES)
    assert "os" not in caught.value.__dict__  # a plain error, nothing from inside
    assert MESSAGES[0] == {"role": "user", "content": "Hi <b>&</b> \u00e9"}


@pytest.mark.parametrize(
    "source",
    [
        "{% include '/etc/passwd' %}",
        "{% import '/etc/passwd' as secrets %}",
        "{% extends '/etc/passwd' %}",
        "{% from '/etc/hostname' import x %}",
    ],
)
def test_no_file_access(source, tmp_path):
    (tmp_path / "secret.txt").write_text("SECRET")
    for path_source in (source, source.replace("/etc/passwd", str(tmp_path / "secret.txt"))):
        with pytest.raises(
            ChatTemplateError, match="include, import and extends are refused"
        ) as caught:
            ChatTemplate(path_source).render(MESSAGES)
        assert "SECRET" not in str(caught.value)


def test_output_bound():
    template = ChatTemplate("{% for i in range(1000) %}0123456789{% endfor %}", max_chars=5000)
    with pytest.raises(ChatTemplateError, match="output longer than 5000 characters"):
        template.render(MESSAGES)
    assert len(ChatTemplate(template.source, max_chars=10_000).render(MESSAGES)) == 10_000
    with pytest.raises(ValueError, match="max_chars: expected a positive integer"):
        ChatTemplate("x", max_chars=0)


def test_messages_must_be_plain_data():
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: expected JSON data, got object"):
        ChatTemplate("x").render([{"role": "user", "content": object()}])
    with pytest.raises(ValueError, match="reserved for generation markers"):
        ChatTemplate("x").render([{"role": "user", "content": "\ue000"}])


SPAN_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_spans_by_prefix_renders():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    rendered = ChatTemplate(SPAN_TEMPLATE).render_with_spans(messages)
    pieces = [rendered.text[a:b] for a, b in rendered.spans]
    assert pieces == ["A1</assistant>", "A2</assistant>"]  # trailing newline left out
    # An assistant first: what the template writes before any message is not a target.
    template = ChatTemplate("<s>[system]\n" + SPAN_TEMPLATE)
    rendered = template.render_with_spans(messages[1:])
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["A1</assistant>", "A2</assistant>"]


def test_spans_by_generation_tags():
    source = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] }}<eot>{% endgeneration %}{% else %}{{ m['content'] }}"
        "{% endif %}{{ '\\n' }}{% endfor %}"
    )
    template = ChatTemplate(source)
    assert template.has_generation_tags
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    rendered = template.render_with_spans(messages)
    assert rendered.text == "user: Q\nassistant: A<eot>\n"
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["A<eot>"]
    assert template.render(messages) == rendered.text


# Qwen3's and Qwen3.5's way: earlier assistant turns lose their reasoning (before "|") once
# a later turn comes, so the partial renders are no prefixes of the whole.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and not loop.last %}"
    "{{ m.content.split('|')[-1] }}{% else %}{{ m.content }}{% endif %}</{{ m.role }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.mark.parametrize("parts", [False, True])
def test_spans_of_turns_a_template_rewrites(parts):
    def content(text):
        return [{"type": "text", "text": text}] if parts else text

    source = REWRITING_TEMPLATE.replace("m.content", "m.content[0].text" if parts else "m.content")
    messages = [
        {"role": "user", "content": content("Q1")},
        {"role": "assistant", "content": content("r1|A1")},
        {"role": "user", "content": content("Q2")},
        {"role": "assistant", "content": content("0|")},  # its content starts like a probe
        {"role": "user", "content": content("Q3")},
        {"role": "assistant", "content": content("r3|A3")},
    ]
    rendered = ChatTemplate(source).render_with_spans(messages)
    assert "r1" not in rendered.text and "r3|A3" in rendered.text
    pieces = [rendered.text[a:b] for a, b in rendered.spans]
    # as rendered in the whole conversation, each closed by its end tag
    assert pieces == ["A1</assistant>", "</assistant>", "r3|A3</assistant>"]


def test_spans_problems():
    # The content rendered in two places once later turns come: where it is, is unclear.
    source = (
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% else %}"
        "{{ m['content'] }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    messages += [{"role": "user", "content": "Q2"}]
    with pytest.raises(ChatTemplateError, match=r"elsewhere too.*add \{% generation %\} tags"):
        ChatTemplate(source).render_with_spans(messages)
    silent = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="renders no assistant turn"):
        ChatTemplate(silent).render_with_spans(messages)
    nested = "{% generation %}{% generation %}x{% endgeneration %}{% endgeneration %}"
    with pytest.raises(ChatTemplateError, match="nested"):
        ChatTemplate(nested).render(messages)


def test_template_files_in_transformers_order(tmp_path):
    def write(name, value):
        text = value if name.endswith(".jinja") else json.dumps(value)
        (tmp_path / name).write_text(text)

    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(tmp_path)
    write("tokenizer_config.json", {"chat_template": "tokenizer config", "bos_token": "<s>"})
    assert load_chat_template(tmp_path) == "tokenizer config"
    write("chat_template.jinja", "jinja file")
    assert load_chat_template(tmp_path) == "jinja file"
    write("chat_template.json", {"chat_template": "legacy json"})
    assert load_chat_template(tmp_path) == "legacy json"
    write("processor_config.json", {"chat_template": [{"name": "default", "template": "proc"}]})
    assert load_chat_template(tmp_path) == "proc"
    write("processor_config.json", {"chat_template": {"tools": "t"}})
    with pytest.raises(ChatTemplateError, match="none is named 'default'"):
        load_chat_template(tmp_path)
    write("processor_config.json", {"chat_template": 3})
    with pytest.raises(CheckpointError, match="'chat_template': expected a string, got int"):
        load_chat_template(tmp_path)
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "chat_template.json").unlink()
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: not UTF-8"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("x" * (2**20 + 1))
    with pytest.raises(CheckpointError, match="larger than 1048576 bytes"):
        load_chat_template(tmp_path)


def test_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"})
    )
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<other>", "pad_token": "<pad>", "additional": ["x"]})
    )
    assert load_special_tokens(tmp_path) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    assert load_special_tokens(tmp_path / "nowhere") == {}


def test_template_variables_reach_every_render_and_are_checked_first(tmp_path):
    source = "{{ bos_token }}{% if enable_thinking is false %}no{% endif %}{{ lang }}"
    template = ChatTemplate(
        source, special_tokens={"bos_token": "<s>"}, variables={"enable_thinking": False}
    )
    assert template.render([]) == "<s>no"
    assert template.render([], lang="fr", enable_thinking=True) == "<s>fr"  # the call's win
    marked = SPAN_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] }}{{ mark }}")
    rendered = ChatTemplate(marked, variables={"mark": "!"}).render_with_spans(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    )  # the labelling renders see the variables too
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["A!</assistant>"]
    for bad, error, message in [
        ([("x", 1)], TypeError, "variables: expected a mapping"),
        ({"messages": []}, ValueError, "identifiers other than"),
        ({"not a name": 1}, ValueError, "identifiers other than"),
        ({1: 1}, ValueError, "identifiers other than"),
        ({"when": datetime(2026, 1, 1)}, ValueError, "variables.when: expected JSON data"),
    ]:
        with pytest.raises(error, match=message):
            ChatTemplate(source, variables=bad)
        # refused before the directory (here a missing one) is read
        with pytest.raises(error, match=message):
            ChatTemplate.from_directory(tmp_path / "missing", variables=bad)
