"""`chat_template_kwargs` (vLLM's and SGLang's field): extra variables for the model's chat template, such as
Qwen3's `enable_thinking`.

A name is taken only where the template reads it, and never one the server sets itself (the conversation, the
tools, how the prompt ends, `apply_chat_template`'s own arguments, the tokenizer's special tokens, the template's
helper functions): anything else would be accepted and ignored, or would let a client rewrite what the server
renders. The values are written by the template as its own text, where a control token is read as one, so a
value that spells one is refused, as for tools.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from minisgl.core import RequestError

PARAM = "chat_template_kwargs"
CODE = "invalid_chat_template_kwargs"
# what render_chat passes itself, and what transformers' template environment provides
_SET_BY_SERVER = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
_TEMPLATE_HELPERS = {"raise_exception", "strftime_now"}


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The names the tokenizer's chat template reads that a request may set (empty without a template)."""
    import jinja2

    names = _undeclared(tokenizer)
    reserved = _SET_BY_SERVER | _TEMPLATE_HELPERS | set(jinja2.Environment().globals)
    reserved |= set(inspect.signature(tokenizer.apply_chat_template).parameters)
    reserved |= set(getattr(tokenizer, "special_tokens_map", {}))
    return frozenset(names - reserved)


def _undeclared(tokenizer: Any) -> frozenset[str]:
    """Every name the chat template reads from outside (empty without a template, or one whose tags only its
    own environment knows)."""
    import jinja2
    import jinja2.meta
    from jinja2.ext import Extension

    class _Generation(Extension):  # transformers' {% generation %} block: parsed as a plain block here
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template] if template else []
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _Generation])
    names: set[str] = set()
    for source in sources:
        try:
            names |= jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError:  # a tag only its own environment knows: take nothing from requests
            return frozenset()
    return frozenset(names)


def control_texts(tokenizer: Any) -> list[str]:
    """The tokenizer's control tokens as text (what a template's own text must not be given by a client)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    return [t.content for t in decoder.values() if t.special and t.content]


def check_template_kwargs(kwargs: dict[str, Any], allowed: frozenset[str], controls: list[str]) -> None:
    """Refuse (RequestError naming chat_template_kwargs) a name the template does not take from a request, or a
    value that spells one of the `controls` (the tokenizer's control tokens)."""
    unknown = sorted(k for k in kwargs if k not in allowed)
    if unknown:
        takes = f"it takes {', '.join(sorted(allowed))}" if allowed else "it takes none"
        raise RequestError(
            f"chat_template_kwargs sets {', '.join(map(repr, unknown))}, which this model's chat template does "
            f"not take from a request ({takes}); remove it",
            PARAM,
            CODE,
        )
    text = json.dumps(kwargs, ensure_ascii=False)
    for token in controls:
        if token in text:
            raise RequestError(
                f"chat_template_kwargs spells the control token {token!r}; remove it", PARAM, CODE
            )


class TemplateKwargsCheck:
    """check_template_kwargs for one tokenizer, its template parsed and its control tokens listed once (the
    tokenizer worker's and the offline LLM's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._allowed: frozenset[str] | None = None
        self._controls: list[str] | None = None
        self._reads_documents: bool | None = None

    @property
    def controls(self) -> list[str]:
        if self._controls is None:
            self._controls = control_texts(self.tokenizer)
        return self._controls

    @property
    def reads_documents(self) -> bool:
        """Whether the template writes vLLM's `documents` (RAG templates such as Command R's and Granite's)."""
        if self._reads_documents is None:
            self._reads_documents = "documents" in _undeclared(self.tokenizer)
        return self._reads_documents

    def __call__(self, kwargs: dict[str, Any]) -> None:
        if self._allowed is None:
            self._allowed = template_variables(self.tokenizer)
        check_template_kwargs(kwargs, self._allowed, self.controls)
