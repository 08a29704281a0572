#!/usr/bin/env python3
"""Record how transformers' chat-template jinja (jinja2 sandbox, trim_blocks, lstrip_blocks, its
tojson/raise_exception/strftime_now) renders small probe templates, for tests/render.rs to check
src/render/ (minijinja) against: tests/fixtures/render/jinja_probes.json, a list of
{"template", "text"} or {"template", "error"}.

Every probe is rendered with the context vLLM gives a one-message chat on the e2e tier's Qwen3:
messages=[{"role": "user", "content": "u"}], tools=None, documents=None,
add_generation_prompt=True, eos_token="<|im_end|>", pad_token="<|endoftext|>".

Usage (the vLLM venv has transformers 5.19):
    ~/.cache/tokenonce-vllm-venv/bin/python tests/e2e/record_jinja_probes.py \
        --out tests/fixtures/render/jinja_probes.json
"""

import argparse
import json

from transformers.utils.chat_template_utils import render_jinja_template

PROBES = [
    # undefined values
    "[{{ nothing }}]", "[{{ nothing | length }}]", "{% for x in nothing %}x{% endfor %}.", "[{{ nothing ~ 'a' }}]",
    "[{{ nothing + 'a' }}]", "[{{ nothing.attr }}]", "{% if nothing.attr %}y{% endif %}.", "[{{ none.attr }}]",
    "[{{ messages[0].missing }}]", "[{{ messages[0].missing.deeper }}]", "[{{ messages[5] }}]", "[{{ nothing | default('d') }}]",
    "[{{ none | default('d') }}]", "[{{ none | default('d', true) }}]", "{% if nothing is defined %}d{% else %}u{% endif %}",
    "[{{ nothing is none }}]", "[{{ not nothing }}]", "[{{ nothing == none }}]", "[{{ nothing | string }}]",
    "[{{ nothing | tojson }}]", "[{{ nothing | trim }}]", "[{{ nothing | upper }}]", "[{{ nothing | list }}]",
    # None and comparisons
    "[{{ none }}]", "[{{ none | string }}]", "[{{ none ~ 'a' }}]", "[{{ none + 'a' }}]", "[{{ none | length }}]",
    "[{{ 1 < 'a' }}]", "[{{ 'a' < 'b' }}]", "[{{ [1, 2] == [1, 2] }}]", "[{{ 1 == 1.0 }}]", "[{{ true == 1 }}]",
    # numbers
    "[{{ 7 / 2 }}]", "[{{ 7 // 2 }}]", "[{{ -7 // 2 }}]", "[{{ 7 % 3 }}]", "[{{ -7 % 3 }}]", "[{{ 2 ** 10 }}]",
    "[{{ 2 ** -1 }}]", "[{{ 1e16 }}]", "[{{ 0.1 + 0.2 }}]", "[{{ 1.0 }}]", "[{{ 3 | float }}]", "[{{ 3.7 | int }}]",
    "[{{ '3.7' | int }}]", "[{{ 'x' | int }}]", "[{{ 2.5 | round }}]", "[{{ 3.5 | round }}]", "[{{ 2.345 | round(2) }}]",
    "[{{ 7 | round(0, 'floor') }}]", "[{{ -3 | abs }}]", "[{{ 10 / 4 * 2 }}]", "[{{ 1 / 3 }}]", "[{{ [1, 2.5] | sum }}]",
    "[{{ 5 is divisibleby 5 }}]", "[{{ 3 is odd }}]", "[{{ true is number }}]", "[{{ 1.0 is integer }}]", "[{{ true is integer }}]",
    # strings
    "[{{ 'a,b,,c'.split(',') }}]", "[{{ ' a  b '.split() }}]", "[{{ 'a b c'.split(' ', 1) }}]", "[{{ 'abc'.rsplit('b') }}]",
    "[{{ 'Hello World'.title() }}]", "[{{ 'hello world' | title }}]", "[{{ 'hello' | capitalize }}]", "[{{ 'hELLO'.capitalize() }}]",
    "[{{ 'abc'[1:] }}]", "[{{ 'abc'[-1] }}]", "[{{ 'abc'[::-1] }}]", "[{{ 'abc' * 2 }}]", "[{{ 'a' in 'cat' }}]",
    "[{{ 'x'.join(['a', 'b']) }}]", "[{{ ['a', 'b'] | join }}]", "[{{ [1, 2] | join('-') }}]", "[{{ 'abc'.upper() }}]",
    "[{{ 'ab'.replace('a', 'x', 1) }}]", "[{{ 'aXb'.lower() }}]", "[{{ 'abc'.find('c') }}]", "[{{ 'abc'.index('c') }}]",
    "[{{ 'a\\nb\\r\\nc'.splitlines() }}]", "[{{ '  x  '.strip() }}]", "[{{ 'xxaxx'.strip('x') }}]", "[{{ 'abc'.startswith(('x', 'a')) }}]",
    "[{{ 'abc'.endswith('bc') }}]", "[{{ '%s and %s' % ('a', 'b') }}]", "[{{ '%d' % 3 }}]", "[{{ '{} {}'.format('a', 1) }}]",
    "[{{ '{x}'.format(x=2) }}]", "[{{ 'abc' | length }}]", "[{{ 'é' | length }}]", "[{{ '👍🏽' | length }}]", "[{{ 'ab' | reverse }}]",
    "[{{ 'a b' | wordcount }}]", "[{{ 'abc' | first }}]", "[{{ 'abc' | last }}]", "[{{ 'abc' | list }}]", "[{{ 'ß'.upper() }}]",
    "[{{ 'İ'.lower() }}]", "[{{ 'ǅ'.title() }}]", "[{{ '\u00a0x\u00a0'.strip() }}]", "[{{ 'a\u001cb'.split() }}]",
    "[{{ 'abc' | center(7) }}]", "[{{ 'x' | indent(2) }}]", "[{{ 'a\\nb' | indent(2, true) }}]", "[{{ '<a>' | e }}]",
    "[{{ '<a>' | safe }}]", "[{{ 'abc'.count('b') }}]", "[{{ 'a-b'.partition('-') }}]", "[{{ 'x' ~ 1 ~ none ~ true }}]",
    "[{{ 'abc' | replace('b', 'B') }}]", "[{{ 'Ab' | lower }}]", "[{{ 'x' | string | length }}]", "[{{ 'aaa' | truncate(2) }}]",
    # lists and dicts
    "[{{ [3, 1, 2] | sort }}]", "[{{ [3, 1, 2] | sort(reverse=true) }}]", "[{{ ['b', 'A', 'a'] | sort }}]",
    "[{{ [1, 1, 2] | unique | list }}]", "[{{ [1, 2] | reverse | list }}]", "[{{ [1, 2, 3] | first }}]", "[{{ [1, 2, 3] | last }}]",
    "[{{ [1, 2, 3][1:] }}]", "[{{ [1, 2, 3][-2:] }}]", "[{{ [1, 2] + [3] }}]", "[{{ [[1], [2]] | map('first') | list }}]",
    "[{{ [1, 2, 3] | select('odd') | list }}]", "[{{ [1, 2, 3] | reject('odd') | list }}]", "[{{ [1, 2, 3] | max }}]",
    "[{{ [1, 2, 3] | min }}]", "[{{ range(3) | list }}]", "[{{ range(1, 7, 2) | list }}]", "[{{ [1, 2, 3] | batch(2) | list }}]",
    "[{{ {'b': 1, 'a': 2} | dictsort }}]", "[{{ {'b': 1, 'a': 2} | items | list }}]", "[{{ {'b': 1, 'a': 2}.keys() | list }}]",
    "[{{ {'b': 1, 'a': 2}.values() | list }}]", "[{{ {'a': 1}.get('a') }}]", "[{{ {'a': 1}.get('b', 'z') }}]",
    "[{{ {'a': 1}['a'] }}]", "[{{ 'a' in {'a': 1} }}]", "[{{ {'a': 1} | length }}]", "[{{ {'a': 1} | tojson }}]",
    "[{{ {'a': 1}.items() | list }}]", "[{{ messages | map(attribute='role') | list }}]",
    "[{{ messages | selectattr('role', 'equalto', 'user') | list | length }}]", "[{{ messages | rejectattr('role', 'eq', 'user') | list }}]",
    "[{{ messages | selectattr('missing') | list }}]", "[{{ messages[0] | tojson }}]", "[{{ messages[0] }}]", "[{{ messages[0].items() | list }}]",
    "[{{ messages | groupby('role') | list | length }}]", "[{{ [1, 'a'] | tojson(indent=1) }}]", "[{{ (1, 2) }}]", "[{{ dict(a=1) }}]",
    "[{{ [none, true, 'x', 1.5] }}]", "[{{ {'k': [1, {'n': none}]} }}]", "[{{ ['it''s'] }}]", "[{{ ['a\"b'] }}]", "[{{ ['\\n'] }}]",
    "[{{ [1, 2] | map('string') | join(',') }}]", "[{{ ['a', 'b'] | map('upper') | list }}]", "[{{ [1, 2] | length }}]",
    # statements
    "{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}[{{ x }}]",
    "{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}[{{ ns.x }}]",
    "{% for i in [1, 2, 3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}.",
    "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}.",
    "{% for i in [] %}x{% else %}empty{% endfor %}", "{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }}{% endfor %}",
    "{% for i in [1, 2, 3] if i > 1 %}{{ loop.index }}/{{ loop.length }}{% endfor %}",
    "{% for i in [1, 2] %}{{ loop.revindex }}{{ loop.first }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% macro m(a, b='x') %}{{ a }}{{ b }}{% endmacro %}[{{ m(1) }}{{ m(1, b=2) }}]",
    "{% macro m() %}{{ caller() }}{% endmacro %}{% call m() %}inner{% endcall %}",
    "{% filter upper %}abc{% endfilter %}", "{% set x %}block{% endset %}[{{ x }}]", "{% raw %}{{ x }}{% endraw %}",
    "{{ raise_exception('boom') }}", "[{{ 'a' if true else 'b' }}]", "[{{ 'a' if false }}]", "[{{ 1 if none else 2 }}]",
    "  {% if true %}\n  x\n  {% endif %}\n", "a\n{%- if true %}\nb\n{%- endif %}\nc", "{#- comment -#}\n  x  \n",
    "{% if true %}  {{ 'x' }}  {% endif %}", "line\n", "{{ 'x' }}\n\n", "a {%+ if true %}b{% endif %}",
    "[{{ add_generation_prompt }}][{{ tools }}][{{ documents }}][{{ eos_token }}][{{ bos_token }}]",
    "[{{ messages is sequence }}][{{ messages[0] is mapping }}][{{ messages[0].content is string }}]",
    "[{{ strftime_now is defined }}][{{ raise_exception is defined }}][{{ namespace is defined }}]",
    "[{{ messages[0].content | tojson }}][{{ '<>&\\'' | tojson }}][{{ 'é\\u0007' | tojson }}]",
    "[{{ 1e400 | string }}]", "[{{ [1, 2][5] }}]", "[{{ {'a': 1}.b }}]", "[{{ {'a': 1}['b'] }}]",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/render/jinja_probes.json")
    args = ap.parse_args()
    out = []
    for template in PROBES:
        try:
            rendered, _ = render_jinja_template(
                conversations=[[{"role": "user", "content": "u"}]], tools=None, documents=None,
                chat_template=template, add_generation_prompt=True,
                eos_token="<|im_end|>", pad_token="<|endoftext|>")
            out.append({"template": template, "text": rendered[0]})
        except Exception as e:  # the template's own error: vLLM answers 400
            out.append({"template": template, "error": f"{type(e).__name__}: {e}"[:200]})
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(p, ensure_ascii=False) for p in out) + "\n]\n")
    print(f"wrote {len(out)} probes ({sum('error' in p for p in out)} errors) to {args.out}")


if __name__ == "__main__":
    main()
