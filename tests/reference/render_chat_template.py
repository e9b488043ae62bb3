"""Renders chat templates as transformers does (`apply_chat_template`, tokenize=False): the
reference Ferrite's own rendering must equal byte for byte.

    python render_chat_template.py MODEL_DIR CASES.json   ->  a JSON list of strings on stdout

Each case: {"messages": [...], "tools": [...] or null, "add_generation_prompt": bool,
"kwargs": {...}} (kwargs such as enable_thinking go to the template). A conversation the
template refuses (its raise_exception) gives null.
"""

import json
import sys

from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

model_dir, cases_path = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
out = []
for case in json.load(open(cases_path)):
    try:
        out.append(tokenizer.apply_chat_template(
            case["messages"], tools=case.get("tools"), tokenize=False,
            add_generation_prompt=case.get("add_generation_prompt", True), **case.get("kwargs", {})))
    except TemplateError:
        out.append(None)
json.dump(out, sys.stdout)
