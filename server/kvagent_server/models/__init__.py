"""Locally built random-weight models and adapters for demos and tests (no model hub).

`builtin` names the models `kvagent-server` and `kvagent demo` accept by id; `tekken` (a
Mistral-format model on the tekken tokenizer shipped by `mistral_common`), `lora` (a LoRA
adapter for the demo model) and `vlm` (a tiny vision-language model) build them. Nothing
is imported here, so importing one builder does not import the others' dependencies.
"""
