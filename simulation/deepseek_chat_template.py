"""DeepSeek-V3's published chat template, verbatim, and the prompt count a DeepSeek server makes with it.

It is the ``chat_template`` of ``tokenizer_config.json`` in the deepseek-ai/DeepSeek-V3 model repository (the
V3 release of December 2024; DeepSeek-V3-0324, R1 and V3.1 publish other templates), as the decoded JSON
string: each ``\\n`` of the JSON is a newline here, inside the template's own string literals. Two
independent public copies agree with it character for character:

- huggingface/huggingface.js, ``packages/ollama-utils/src/chat-template-automap.ts`` (commit fe42e6801,
  generated from the GGUF metadata of Ollama's ``library/deepseek-v3:671b``): that entry's ``gguf`` member;
- mindspore-lab/mindformers, ``research/deepseek3/deepseek3_671b/predict_deepseek3_671b.yaml`` (commit
  fd4deebc1): ``processor.tokenizer.chat_template``.

Vendor data, with its sha256 so that an edit shows, and never used by the platform's code: the provider
simulator renders it as DeepSeek's servers do (``deepseek_v3_counter``: the demo's provider reports the prompt
tokens DeepSeek would), and the DeepSeek golden tests (tests/ladder/test_deepseek_golden.py) take it as the
reference our own template is proven against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Final

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from simulation.completions import PromptCounter, default_prompt_counter

# The special tokens of DeepSeek-V3's tokenizer_config.json.
BOS: Final = "<｜begin▁of▁sentence｜>"
EOS: Final = "<｜end▁of▁sentence｜>"

CHAT_TEMPLATE_SHA256 = "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea"

CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', "
    "is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' "
    "+ tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + "
    "'```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}"
    "{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"
    "{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)


@cache
def published_template() -> jinja2.Template:
    """The published template, compiled as transformers' ``apply_chat_template`` compiles a chat template."""
    assert hashlib.sha256(CHAT_TEMPLATE.encode("utf-8")).hexdigest() == CHAT_TEMPLATE_SHA256

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(CHAT_TEMPLATE)


def deepseek_v3_counter(tokenizer_file: Path) -> PromptCounter:
    """Prompt tokens as DeepSeek's servers count them: the messages rendered with the published template (the
    generation prompt added) and encoded with the model's tokenizer, special-token spellings as special
    tokens. Messages the text template cannot render (content given as parts) are counted by the default
    estimate."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def count(messages: Sequence[Mapping[str, Any]]) -> int:
        try:
            text = published_template().render(
                messages=list(messages), add_generation_prompt=True, bos_token=BOS, eos_token=EOS
            )
        except (TypeError, jinja2.TemplateError):
            return default_prompt_counter(messages)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count
