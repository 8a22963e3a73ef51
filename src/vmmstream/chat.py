"""Chat templates: a list of messages rendered into the prompt text a chat model was trained on.

A checkpoint's template is Jinja2 source (``tokenizer_config.json``'s ``chat_template``, or a
``chat_template.jinja`` file next to it). It is rendered as transformers' ``apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)`` renders it, so the two agree to the character:

- an immutable sandboxed environment (templates come from the Hub and are untrusted code) with ``trim_blocks``
  and ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a
  ``{% generation %}`` block that renders its body;
- globals ``raise_exception(message)``, ``strftime_now(format)``, a ``dict`` that builds dicts and a
  ``namespace`` that refuses attributes starting with ``_``;
- a ``tojson`` filter that is ``json.dumps`` (no HTML escaping; ``ensure_ascii=False``; ``indent``,
  ``separators``, ``sort_keys`` accepted);
- the variables ``messages`` (each message a plain dict; keys whose value is None dropped), ``tools=None``,
  ``documents=None``, ``add_generation_prompt`` and the special tokens of ``tokenizer_config.json``
  (``bos_token``, ``eos_token``, ... and any other ``*_token`` string).

What a template needs that is not there (an unknown tag, filter or test, calling or indexing a variable that
is not given, such as a tool renderer) is a ``ChatTemplateError`` naming it; so is a template's own
``raise_exception``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

from .errors import VmmstreamError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(VmmstreamError, ValueError):
    """The checkpoint has no chat template, or its template needs something this renderer does not give."""


def select_template(source, name: str = "default") -> str:
    """One template's source: ``source`` as read from the checkpoint (a string, or a dict name -> template)."""
    if source is None:
        raise ChatTemplateError("the checkpoint has no chat template (no chat_template in tokenizer_config.json and "
                                "no chat_template.jinja); render the prompt yourself and call generate")
    if isinstance(source, str):
        return source
    if name in source:
        return source[name]
    raise ChatTemplateError(f"the checkpoint's chat templates are {sorted(source)}; none is named {name!r}")


def special_tokens(tokenizer_config: Mapping) -> dict[str, str]:
    """The token strings a template may refer to, as transformers passes them: the named special tokens and any
    other ``*_token`` string of ``tokenizer_config.json`` (a token saved as an AddedToken object gives its
    ``content``), and the named ``extra_special_tokens``."""
    out = {}

    def text(v):
        if isinstance(v, str):
            return v
        if isinstance(v, Mapping) and isinstance(v.get("content"), str):
            return v["content"]
        return None

    for key, value in tokenizer_config.items():
        if key in SPECIAL_TOKENS or (key.endswith("_token") and isinstance(value, str)):
            t = text(value)
            if t is not None:
                out[key] = t
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            t = text(value)
            if isinstance(key, str) and t is not None:
                out[key] = t
    return out


def _plain(value, where: str):
    """``value`` rebuilt from plain JSON types, so the sandbox sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"{where}: {type(value).__name__} {value!r:.60} is not a JSON value (str, number, bool, None, "
                    "list or dict)")


def check_messages(messages) -> list[dict]:
    """``messages`` as plain dicts: a non-empty list of mappings, each with a string ``role``; keys whose value
    is None are dropped (as transformers does: templates handle a missing key, not ``None``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages={messages!r:.80}: expected a list of {{'role': ..., 'content': ...}} dicts")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]={m!r:.80}: expected a dict with 'role' and 'content'")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has no string 'role' (such as 'system', 'user' or 'assistant')")
        out.append(_plain({k: v for k, v in m.items() if v is not None}, f"messages[{i}]"))
    return out


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:                                       # pragma: no cover - a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's part for training masks): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):          # noqa: N805 - jinja's own signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for k in attrs:
                Namespace._check(k)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    return env


class ChatTemplate:
    """A compiled chat template with the checkpoint's special tokens.

        t = ChatTemplate(source, special_tokens(tokenizer_config))
        prompt = t.render([{"role": "user", "content": "Hi"}])     # add_generation_prompt=True
    """

    def __init__(self, source: str, variables: Mapping[str, str] | None = None):
        import jinja2
        if not isinstance(source, str):
            raise TypeError(f"a chat template is a string of Jinja source, not {type(source).__name__}")
        self.source = source
        self.variables = dict(variables or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template uses a feature this renderer does not have (line {exc.lineno}: {exc.message}); "
                "vmmstream renders templates with the tags, filters and globals transformers gives them") from None

    def render(self, messages, *, add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for ``messages``; ``variables`` (e.g. ``date_string``) override the special tokens."""
        import jinja2
        msgs = check_messages(messages)
        reserved = sorted(set(variables) & {"messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise ChatTemplateError(f"template variables {reserved} are given by the renderer itself (messages, "
                                    "add_generation_prompt; tools and documents are not supported)")
        context = {**self.variables, **_plain(variables, "variables")}
        try:
            return self._template.render(messages=msgs, tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt), **context)
        except jinja2.UndefinedError as exc:
            raise ChatTemplateError(
                f"the chat template needs something that is not given: {exc.message} (vmmstream passes messages, "
                f"add_generation_prompt, tools=None, documents=None and {', '.join(sorted(self.variables)) or 'no'}"
                " special tokens; tool calling and other template inputs are not supported)") from None
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template did something the sandbox forbids: {exc}") from None
        except jinja2.TemplateError as exc:        # raise_exception(...) in the template, among others
            raise ChatTemplateError(f"the chat template refused the conversation: {exc.message or exc}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
            # the template's own code failed on these messages (a division, an index, a type it did not expect)
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") \
                from None
