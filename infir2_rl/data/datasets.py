"""SFT and RL-prompt datasets: chat-template rendering, assistant-only loss masks, bad-row accounting.

Loss mask. An SFT example trains only on what the assistant writes: for every assistant turn, the
tokens of its content *and the turn-ending token* (``<|im_end|>`` for ChatML: `turn_end_token`, else
the eos token), so the model learns to stop; never the role header ``<|im_start|>assistant\\n`` (the
generation prompt, which is given at inference) nor the separator after the turn end. The mask is
computed for any chat template by rendering prefixes: the text of turn i is ``render(messages[:i+1])``
minus ``render(messages[:i], add_generation_prompt=True)``, cut after the last turn-end string in it. The
whole conversation is then tokenized once with character offsets and a token is masked in when it lies
entirely inside such a span. Rendering prefixes needs the template to render a prefix of the
conversation as a prefix of the text (true of ChatML/Qwen2.5; not of templates that rewrite earlier
turns): rows where it does not hold are skipped as `bad_format`. Generation stops at the same token
(`stop_token_ids`), and at the eos token.

`SftExample.loss_mask[t] == 1` means token t is a training *target*: the loss on logits at position
t-1 predicting token t. The SFT loss shifts by one accordingly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from infir2_rl.data.readers import FileFormat, RawRow, read_records

logger = logging.getLogger(__name__)
# How many skipped rows per reason are shown in the log (the counts cover all of them).
NUM_LOGGED_PER_REASON = 3


@dataclass(frozen=True)
class SftExample:
    """One tokenized conversation; `loss_mask[t]` is 1 where token t is an assistant target."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class PromptExample:
    """One RL prompt, rendered with the chat template and the generation prompt."""

    prompt_ids: list[int]
    label: str
    prompt_text: str


@dataclass
class LoadReport:
    """What happened to every row of one file: kept, or skipped with a reason."""

    path: str
    num_rows: int = 0
    num_kept: int = 0
    # Skip reasons, one counter each.
    invalid_json: int = 0
    # jsonl lines that are not valid UTF-8.
    bad_encoding: int = 0
    missing_key: int = 0
    bad_format: int = 0
    empty_text: int = 0
    too_long: int = 0
    # A few "row N: reason: detail" lines, for the log and error messages.
    examples: list[str] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return self.num_rows - self.num_kept

    def skip_counts(self) -> str:
        reasons = [f.name for f in fields(self) if f.name not in ("path", "num_rows", "num_kept", "examples")]
        return ", ".join(f"{r}={getattr(self, r)}" for r in reasons if getattr(self, r)) or "none"


class _Skip(ValueError):
    """A row to skip; a ValueError so that callers of the public helpers see a clear error."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _record_skip(report: LoadReport, row: RawRow, skip: _Skip) -> None:
    count = getattr(report, skip.reason) + 1
    setattr(report, skip.reason, count)
    if count <= NUM_LOGGED_PER_REASON:
        line = f"row {row.row}: {skip.reason}: {skip.detail}"
        report.examples.append(line)
        logger.warning("%s: skipped %s", report.path, line)


def _finish(report: LoadReport, what: str) -> None:
    if report.num_kept == 0:
        raise ValueError(
            f"{report.path}: no usable {what} row out of {report.num_rows} "
            f"(skipped: {report.skip_counts()}); check the file and the configured keys"
        )
    level = logging.WARNING if report.num_skipped else logging.INFO
    logger.log(
        level,
        "%s: kept %d of %d rows (skipped: %s)",
        report.path,
        report.num_kept,
        report.num_rows,
        report.skip_counts(),
    )


def _get(row: RawRow, key: str) -> Any:
    if row.data is None:
        raise _Skip(row.reason, row.error or "unreadable row")
    value = row.data.get(key)
    if value is None:
        raise _Skip("missing_key", f"no {key!r} field (keys: {sorted(row.data)[:8]})")
    return value


def _label_text(value: Any, key: str) -> str:
    """A label as the string the reward compares: a string or a number as written; a list of one such
    value is unwrapped (some datasets store ``["19"]``); anything else is a skipped row. ``str()`` of a
    list would give the label ``"['19']"``, which no answer can ever match."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        shown = repr(value)
        raise _Skip(
            "bad_format",
            f"{key!r} is {type(value).__name__} {shown[:60]}; a label must be a string or a number",
        )
    return str(value).strip()


def _check_messages(value: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _Skip("bad_format", f"{key!r} must be a non-empty list of chat messages")
    messages = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _Skip("bad_format", f"{key}[{i}] is not a {{'role': str, 'content': str}} message")
        if m["role"] != "system" and not m["content"].strip():
            raise _Skip("empty_text", f"{key}[{i}] ({m['role']}) has empty content")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool
) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert isinstance(text, str)
    return text


# An assistant message's content in the probe below: text no template rewrites, so where it ends is plain.
_TURN_PROBE = "turn-end-probe"


def turn_end_token(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The special token the chat template writes right after an assistant message's content, or None.

    ``<|im_end|>`` for ChatML. A model learns in SFT to end its turn with it, so generation must stop there,
    whatever the tokenizer names as eos: Qwen2.5's base checkpoints (the recipe's starting point) name
    ``<|endoftext|>``, which the template never writes, and a stop at eos alone let every RL response run
    on to the length limit.
    """
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _TURN_PROBE}]
    text = _render(tokenizer, messages, generation_prompt=False)
    after = text[text.rfind(_TURN_PROBE) + len(_TURN_PROBE) :]
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    special |= set(tokenizer.all_special_tokens)
    return next((t for t in sorted(special, key=len, reverse=True) if t and after.startswith(t)), None)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a response: the chat template's turn end (`turn_end_token`) and the eos token."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    end = turn_end_token(tokenizer)
    end_id = None if end is None else tokenizer.convert_tokens_to_ids(end)
    if isinstance(end_id, int) and end_id not in ids:
        ids.insert(0, end_id)
    if not ids:
        raise ValueError(
            "the tokenizer has no eos token and its chat template ends an assistant turn with no special "
            "token: nothing to stop generation at"
        )
    return ids


def _mask_end(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """Where an assistant turn's loss mask ends: the template's turn-end token, else the eos token."""
    return turn_end_token(tokenizer) or tokenizer.eos_token


def _assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], turn_end: str | None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn, each cut
    after the last ``turn_end`` string in it when given."""
    full = _render(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        if i:
            prefix = _render(tokenizer, messages[:i], generation_prompt=True)
        else:
            # transformers cannot render an empty conversation: the role header of a first assistant
            # turn is whatever the template writes before the content.
            prefix = upto[: max(upto.find(message["content"]), 0)]
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise _Skip(
                "bad_format", "the chat template does not render conversation prefixes as text prefixes"
            )
        end = len(upto)
        if turn_end:
            # Keep the turn-ending token, drop what follows it (the newline between turns).
            cut = upto.rfind(turn_end, len(prefix))
            if cut >= 0:
                end = cut + len(turn_end)
        spans.append((len(prefix), end))
    return full, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], turn_end: str | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation; the mask covers assistant tokens and their turn-ending token
    (``turn_end``, by default `turn_end_token`'s, else the eos token).

    Raises ValueError when the chat template renders a prefix of the conversation differently.
    """
    text, spans = _assistant_char_spans(tokenizer, messages, turn_end or _mask_end(tokenizer))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = encoding["input_ids"]
    loss_mask = [0] * len(input_ids)
    for t, (start, end) in enumerate(encoding["offset_mapping"]):
        if end > start and any(s <= start and end <= e for s, e in spans):
            loss_mask[t] = 1
    return input_ids, loss_mask


def load_sft_examples(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    messages_key: str = "messages",
    max_seq_len: int = 512,
    format: FileFormat = "auto",
) -> tuple[list[SftExample], LoadReport]:
    """Tokenize every usable conversation of a jsonl/parquet file; raise if none is usable."""
    report = LoadReport(path=str(path))
    examples: list[SftExample] = []
    turn_end = _mask_end(tokenizer)
    for row in read_records(path, format):
        report.num_rows += 1
        try:
            messages = _check_messages(_get(row, messages_key), messages_key)
            if not any(m["role"] == "assistant" for m in messages):
                raise _Skip("bad_format", f"{messages_key!r} has no assistant message to train on")
            input_ids, loss_mask = tokenize_conversation(tokenizer, messages, turn_end)
            if len(input_ids) > max_seq_len:
                raise _Skip("too_long", f"{len(input_ids)} tokens > max_seq_len={max_seq_len}")
            if not any(loss_mask):
                raise _Skip("bad_format", "no assistant token in the rendered conversation")
        except _Skip as skip:
            _record_skip(report, row, skip)
            continue
        examples.append(SftExample(input_ids=input_ids, loss_mask=loss_mask))
        report.num_kept += 1
    _finish(report, "SFT")
    return examples, report


def load_prompt_examples(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    max_prompt_tokens: int = 256,
    format: FileFormat = "auto",
) -> tuple[list[PromptExample], LoadReport]:
    """Render every usable RL prompt (chat list or plain string) with the generation prompt."""
    report = LoadReport(path=str(path))
    examples: list[PromptExample] = []
    for row in read_records(path, format):
        report.num_rows += 1
        try:
            prompt = _get(row, input_key)
            label = _label_text(_get(row, label_key), label_key)
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise _Skip("empty_text", f"{input_key!r} is empty")
                messages = [{"role": "user", "content": prompt}]
            else:
                messages = _check_messages(prompt, input_key)
            if not label:
                raise _Skip("empty_text", f"{label_key!r} is empty")
            prompt_text = _render(tokenizer, messages, generation_prompt=True)
            prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            if len(prompt_ids) > max_prompt_tokens:
                raise _Skip("too_long", f"{len(prompt_ids)} tokens > max_prompt_tokens={max_prompt_tokens}")
        except _Skip as skip:
            _record_skip(report, row, skip)
            continue
        examples.append(PromptExample(prompt_ids=list(prompt_ids), label=label, prompt_text=prompt_text))
        report.num_kept += 1
    _finish(report, "prompt")
    return examples, report
