"""Prompts as the model sees them: TRL's dataset conventions plus the tokenizer's chat template.

A prompt is either *standard* (a string) or *conversational* (a list of ``{"role", "content"}``
messages, TRL's convention). ``chat_template``:

- ``"auto"`` (default): apply the tokenizer's chat template when the prompt is conversational
  or a ``system_prompt`` is set; a plain string otherwise;
- ``True``: always (a string prompt becomes one user message);
- ``False``: never (a conversational prompt is then an error).

As in TRL (``trl.data_utils.apply_chat_template``), a conversation ending with a user or tool
message gets the template's generation prompt (a new assistant turn), and one ending with an
assistant message (a prefill, e.g. "Let me think step by step:") is continued: that message is
left open (``continue_final_message``) and the completion extends it. The checker sees the
completion only. A templated prompt is tokenized without extra special tokens (the template
writes them), a plain one with the tokenizer's own (e.g. BOS), as TRL does.
"""
from __future__ import annotations

from typing import Any

CHAT_TEMPLATE_MODES = ("auto", True, False)
ROLES = ("system", "user", "assistant", "tool")


def check_chat_template(value: Any) -> None:
    if value not in CHAT_TEMPLATE_MODES or isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"chat_template: expected one of {list(CHAT_TEMPLATE_MODES)}, got {value!r}")


def check_prompt(prompt: Any, where: str = "prompt") -> str | list[dict[str, str]]:
    """``prompt`` if it is a non-empty string or a valid message list; else a ValueError naming ``where``."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: expected a string or a non-empty list of {{'role', 'content'}} messages, "
                         f"got {type(prompt).__name__} {str(prompt)[:80]!r}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise ValueError(f"{where}: message {i}: expected a mapping with keys 'role' and 'content', "
                             f"got {str(message)[:80]!r}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {i}: expected role in {list(ROLES)}, got {message['role']!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i}: expected string content, got "
                             f"{type(message.get('content')).__name__}")
    return prompt


def uses_template(prompt, chat_template="auto", system_prompt: str | None = None) -> bool:
    if chat_template == "auto":
        return isinstance(prompt, list) or system_prompt is not None
    return bool(chat_template)


def missing_template(prompt, chat_template, system_prompt: str | None) -> str:
    """The error for a prompt that needs a chat template the tokenizer lacks, naming its cause."""
    fix = "use a model whose tokenizer has a chat template (model.name)"
    if isinstance(prompt, list):
        return (f"task.options.chat_template: the prompts are lists of messages (conversational), which need the "
                f"tokenizer's chat template, but the tokenizer has none (chat_template={chat_template!r}); give "
                f"string prompts or {fix}")
    if system_prompt is not None:
        return (f"task.options.system_prompt: a system prompt needs the tokenizer's chat template, but the tokenizer "
                f"has none; drop task.options.system_prompt or {fix}")
    return (f"task.options.chat_template: true needs the tokenizer's chat template, but the tokenizer has none; "
            f"set task.options.chat_template=auto (or false) or {fix}")


def render_prompt(tokenizer, prompt, *, chat_template="auto", system_prompt: str | None = None) -> list[int]:
    """Token ids of ``prompt`` as the policy sees it (see the module docstring)."""
    prompt = check_prompt(prompt)
    templated = uses_template(prompt, chat_template, system_prompt)
    if (templated or isinstance(prompt, list)) and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(missing_template(prompt, chat_template, system_prompt))
    if not templated:
        if isinstance(prompt, list):
            raise ValueError("task.options.chat_template: the prompt is a list of messages but chat_template is "
                             "false; set task.options.chat_template=auto (or true)")
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return list(tokenizer(prompt)["input_ids"]) or [start]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    prefill = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_task_prompts(tokenizer, task, prompts: list) -> list[list[int]]:
    """``render_prompt`` for each prompt with the task's ``chat_template`` / ``system_prompt``;
    with ``task.max_prompt_tokens`` set, longer prompts keep their last tokens (the question's
    end and the generation prompt)."""
    mode, system = getattr(task, "chat_template", "auto"), getattr(task, "system_prompt", None)
    limit = getattr(task, "max_prompt_tokens", None)
    ids = [render_prompt(tokenizer, p, chat_template=mode, system_prompt=system) for p in prompts]
    return [x[-limit:] for x in ids] if limit else ids


def check_prompt_lengths(tokenizer, task, context: int | None, max_new_tokens: int) -> int:
    """Before training: ``max_new_tokens`` must leave room for a prompt in the model's ``context``
    (any task), and every prompt of a task with finite data (``train_set``) room for
    ``max_new_tokens``. Too long is an error naming the rows, unless ``task.truncate_prompts``:
    then ``task.max_prompt_tokens`` is set and the number of prompts that will be truncated is
    returned."""
    if context is None:
        return 0
    budget = context - max_new_tokens
    if budget < 1:                  # any task: a prompt takes at least one token
        raise ValueError(f"rollout.max_new_tokens: expected at most {context - 1} (the model's context of {context} "
                         f"tokens less one for a prompt), got {max_new_tokens}")
    if not hasattr(task, "train_set"):
        return 0
    problems = task.train_set() + task.test_set()
    mode, system = getattr(task, "chat_template", "auto"), getattr(task, "system_prompt", None)
    lengths = [len(render_prompt(tokenizer, p.prompt, chat_template=mode, system_prompt=system))
               for p in problems]  # untruncated, so a second check (after the model loads) counts the same
    long = [i for i, n in enumerate(lengths) if n > budget]
    if long and not getattr(task, "truncate_prompts", False):
        raise ValueError(f"task: {len(long)} prompt(s) are longer than the {budget} tokens the model's context "
                         f"({context}) leaves after rollout.max_new_tokens={max_new_tokens} (longest: "
                         f"{max(lengths)} tokens; e.g. {[str(problems[i].prompt)[:60] for i in long[:3]]}); shorten "
                         f"them, lower rollout.max_new_tokens or set task.options.truncate_prompts=true")
    if long:
        task.max_prompt_tokens = budget
    return len(long)
