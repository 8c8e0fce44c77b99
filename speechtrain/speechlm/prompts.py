"""Conversations and chat templates (written by hand, no jinja) for SALM.

A conversation is a list of :class:`Turn` objects (role ``system`` / ``user`` / ``assistant`` and a text
``content``). Audio stands in the content as the placeholder token ``<|audioplaceholder|>``; the model later
replaces each placeholder by the audio encoder's frames (:mod:`speechtrain.speechlm.injection`).
:func:`conversation_from_jsonl` builds turns from the JSONL format::

    {"conversations": [{"from": "User", "type": "text", "value": "Transcribe:"},
                       {"from": "User", "type": "audio", "value": "a.wav", "duration": 2.1},
                       {"from": "Assistant", "type": "text", "value": "hello"}]}

Templates (:func:`get_template`):

- ``llama3``: ``<|begin_of_text|>`` then per turn ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}
  <|eot_id|>``; the generation prompt is ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``. Like the official
  Llama 3 template, content is stripped of surrounding whitespace (``trim_content=True``).
- ``qwen2``: per turn ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; the generation prompt is
  ``<|im_start|>assistant\\n``. Hugging Face's Qwen2 template inserts the system turn "You are a helpful
  assistant." when a conversation has none; here that is the option ``default_system`` (default ``None``: no
  system turn is added, which is what our models are trained with). Pass
  ``get_template("qwen2", default_system="You are a helpful assistant.")`` to reproduce HF exactly.
- ``plain``: for base models without chat tokens: ``{bos}{system} {user}`` then each assistant turn as
  `` {answer}{eos}`` (the separating space belongs to the answer, because a byte-level BPE attaches a leading
  space to the following word; decoded answers therefore start with a space). The generation prompt is empty.
  bos / eos are the tokenizer's unless given as ``bos_token`` / ``eos_token``.

Tokenization (:meth:`ChatTemplate.encode`): special tokens are emitted as their ids, never run through the BPE.
The text between two special tokens is encoded as *one* string, exactly as Hugging Face's
``apply_chat_template`` + tokenizer does (a fast tokenizer first splits the rendered string at special tokens,
then pre-tokenizes each remaining piece), so the ids equal HF's. The loss mask of a token is decided by the
template part its first character comes from (via the tokenizer's character offsets). The loss mask is True on
the assistant content tokens and the assistant turn's end token (``<|eot_id|>``, ``<|im_end|>``, eos), False on
headers, system and user text and audio placeholders.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from speechtrain.speechlm.tokenizer import AUDIO_PLACEHOLDER

ROLES = ("system", "user", "assistant")
# JSONL speaker names (compared lower-case) -> role
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


@dataclass
class AudioRef:
    """An audio item of a conversation: its file (``value`` in the JSONL), duration and any other fields."""

    path: str
    duration: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Turn:
    """One speaker's turn. Audio is the placeholder token inside ``content``; ``audio`` optionally lists the
    audio items of those placeholders, in order (filled by :func:`conversation_from_jsonl`)."""

    role: str
    content: str = ""
    audio: list[AudioRef] = field(default_factory=list)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Turn role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Turn content must be a string, got {type(self.content).__name__}")

    @property
    def num_audio(self) -> int:
        return self.content.count(AUDIO_PLACEHOLDER)


def conversation_from_jsonl(record: Mapping | Sequence, sep: str = " ") -> list[Turn]:
    """Turns of a JSONL record ``{"conversations": [...]}`` (or of the list itself).

    Each item has ``from`` (``User`` / ``Assistant`` / ``System``, case-insensitive; ``human`` / ``gpt`` too),
    ``type`` (``text`` or ``audio``; default ``text``) and ``value`` (the text, or the audio file), and for
    audio optionally ``duration``. Consecutive items of the same speaker form one turn, joined in order by
    ``sep``; an audio item becomes :data:`AUDIO_PLACEHOLDER` in the content and an :class:`AudioRef` in
    :attr:`Turn.audio`. Raises ``ValueError`` naming the bad item.
    """
    items = record.get("conversations") if isinstance(record, Mapping) else record
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise ValueError(f"Expected a non-empty 'conversations' list, got {record!r}")
    turns: list[Turn] = []
    for index, item in enumerate(items):
        where = f"conversations[{index}] ({item!r})"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}: an item must be an object")
        speaker = item.get("from", item.get("role"))
        if not isinstance(speaker, str) or speaker.strip().lower() not in ROLE_ALIASES:
            known = ", ".join(sorted(ROLE_ALIASES))
            raise ValueError(f"{where}: unknown speaker {speaker!r} (known, case-insensitive: {known})")
        role = ROLE_ALIASES[speaker.strip().lower()]
        kind = item.get("type", "text")
        if kind not in ("text", "audio"):
            raise ValueError(f"{where}: type must be 'text' or 'audio', got {kind!r}")
        value = item.get("value")
        if not isinstance(value, str) or (kind == "audio" and not value):
            raise ValueError(f"{where}: missing or non-string 'value'")
        audio: list[AudioRef] = []
        if kind == "audio":
            extra = {k: v for k, v in item.items() if k not in ("from", "role", "type", "value", "duration")}
            duration = item.get("duration")
            audio.append(AudioRef(value, None if duration is None else float(duration), extra))
            value = AUDIO_PLACEHOLDER
        if turns and turns[-1].role == role:
            turns[-1].content += sep + value
            turns[-1].audio.extend(audio)
        else:
            turns.append(Turn(role, value, audio))
    return turns


class Segment(NamedTuple):
    """A piece of a rendered conversation: a special token (by its string) or text, and whether it is trained."""

    text: str
    special: bool
    train: bool


def _content_segments(content: str, train: bool) -> list[Segment]:
    """Text with audio placeholders split out (placeholders are never trained)."""
    out: list[Segment] = []
    for k, piece in enumerate(content.split(AUDIO_PLACEHOLDER)):
        if k:
            out.append(Segment(AUDIO_PLACEHOLDER, True, False))
        if piece:
            out.append(Segment(piece, False, train))
    return out


class ChatTemplate:
    """Base class: subclasses turn a conversation into :class:`Segment` s (:meth:`segments`).

    Args:
        default_system: A system turn prepended when the conversation does not start with one (``None``: none).
    """

    name = "base"
    end_token: str | None = None  # the token that ends an assistant turn (None: the tokenizer's eos)

    def __init__(self, default_system: str | None = None):
        self.default_system = default_system

    @property
    def special_tokens(self) -> list[str]:
        """The tokens the template emits (audio placeholder included), to register in a tokenizer."""
        raise NotImplementedError

    def _turn_segments(self, turns: list[Turn], add_generation_prompt: bool, tokenizer: Any) -> list[Segment]:
        raise NotImplementedError

    def stop_ids(self, tokenizer: Any) -> list[int]:
        """Ids that end an answer: the turn-end token, plus the tokenizer's eos (when it has one)."""
        ids = [] if self.end_token is None else [tokenizer.token_to_id(self.end_token)]
        if getattr(tokenizer, "eos_id", None) is not None:
            ids.append(tokenizer.eos_id)
        return list(dict.fromkeys(ids))

    # ---------------------------------------------------------------- public
    def segments(self, turns: Iterable[Turn], add_generation_prompt: bool = False, tokenizer: Any = None):
        turns = list(turns)
        if not turns:
            raise ValueError("Empty conversation")
        for turn in turns:
            if not isinstance(turn, Turn):
                raise ValueError(f"Expected Turn objects, got {turn!r} (see conversation_from_jsonl)")
        if add_generation_prompt and turns[-1].role != "user":
            raise ValueError(
                f"add_generation_prompt needs a conversation ending with a user turn, it ends with {turns[-1].role}"
            )
        if self.default_system is not None and turns[0].role != "system":
            turns = [Turn("system", self.default_system), *turns]
        return self._turn_segments(turns, add_generation_prompt, tokenizer)

    def render(self, turns: Iterable[Turn], add_generation_prompt: bool = False, tokenizer: Any = None) -> str:
        """The conversation as one string (what HF's ``apply_chat_template(tokenize=False)`` returns)."""
        return "".join(seg.text for seg in self.segments(turns, add_generation_prompt, tokenizer))

    def encode(
        self, turns: Iterable[Turn], tokenizer: Any, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]:
        """``(input_ids, loss_mask)`` of the conversation (see the module docstring for the rules)."""
        ids: list[int] = []
        mask: list[bool] = []
        pending: list[Segment] = []

        def flush():
            if not pending:
                return
            if hasattr(tokenizer, "encode_with_offsets"):
                text = "".join(seg.text for seg in pending)
                starts, pos = [], 0
                for seg in pending:
                    starts.append(pos)
                    pos += len(seg.text)
                piece_ids, offsets = tokenizer.encode_with_offsets(text)
                k = 0
                for token_id, (start, _) in zip(piece_ids, offsets):
                    while k + 1 < len(starts) and start >= starts[k + 1]:
                        k += 1
                    ids.append(token_id)
                    mask.append(pending[k].train)
            else:  # a tokenizer without offsets: each piece separately
                for seg in pending:
                    piece_ids = tokenizer.encode(seg.text)
                    ids.extend(piece_ids)
                    mask.extend([seg.train] * len(piece_ids))
            pending.clear()

        for seg in self.segments(turns, add_generation_prompt, tokenizer):
            if seg.special:
                flush()
                ids.append(tokenizer.token_to_id(seg.text))
                mask.append(seg.train)
            elif seg.text:
                pending.append(seg)
        flush()
        return ids, mask

    def __repr__(self) -> str:
        return f"{type(self).__name__}(default_system={self.default_system!r})"


class Llama3Template(ChatTemplate):
    """Llama 3 instruct. ``trim_content`` strips each turn's content, as the official template does."""

    name = "llama3"
    bos = "<|begin_of_text|>"
    eos = "<|end_of_text|>"
    start_header = "<|start_header_id|>"
    end_header = "<|end_header_id|>"
    end_token = "<|eot_id|>"

    def __init__(self, default_system: str | None = None, trim_content: bool = True):
        super().__init__(default_system)
        self.trim_content = trim_content

    @property
    def special_tokens(self) -> list[str]:
        return [self.bos, self.eos, self.start_header, self.end_header, self.end_token, AUDIO_PLACEHOLDER]

    def _header(self, role: str) -> list[Segment]:
        return [
            Segment(self.start_header, True, False),
            Segment(role, False, False),
            Segment(self.end_header, True, False),
            Segment("\n\n", False, False),
        ]

    def _turn_segments(self, turns, add_generation_prompt, tokenizer):
        out = [Segment(self.bos, True, False)]
        for turn in turns:
            train = turn.role == "assistant"
            content = turn.content.strip() if self.trim_content else turn.content
            out += self._header(turn.role)
            out += _content_segments(content, train)
            out.append(Segment(self.end_token, True, train))
        if add_generation_prompt:
            out += self._header("assistant")
        return out


class Qwen2Template(ChatTemplate):
    """Qwen2 / Qwen2.5 instruct (ChatML)."""

    name = "qwen2"
    start_token = "<|im_start|>"
    end_token = "<|im_end|>"
    eos = "<|endoftext|>"

    @property
    def special_tokens(self) -> list[str]:
        return [self.eos, self.start_token, self.end_token, AUDIO_PLACEHOLDER]

    def _turn_segments(self, turns, add_generation_prompt, tokenizer):
        out: list[Segment] = []
        for turn in turns:
            train = turn.role == "assistant"
            out += [Segment(self.start_token, True, False), Segment(turn.role + "\n", False, False)]
            out += _content_segments(turn.content, train)
            out += [Segment(self.end_token, True, train), Segment("\n", False, False)]
        if add_generation_prompt:
            out += [Segment(self.start_token, True, False), Segment("assistant\n", False, False)]
        return out


class PlainTemplate(ChatTemplate):
    """Base models without chat tokens: ``{bos}{system}{sep}{user}{sep}{answer}{eos}{user}{sep}{answer}{eos}``.

    The separator before an answer is part of the answer (trained); the generation prompt adds nothing.

    Args:
        bos_token, eos_token: Token strings; ``None``: the tokenizer's (a missing bos is left out, a missing eos
            is an error).
        sep: What separates consecutive turns inside one exchange.
    """

    name = "plain"

    def __init__(
        self,
        default_system: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        sep: str = " ",
    ):
        super().__init__(default_system)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.sep = sep

    @property
    def special_tokens(self) -> list[str]:
        return [t for t in (self.bos_token, self.eos_token) if t is not None] + [AUDIO_PLACEHOLDER]

    def _tokens(self, tokenizer) -> tuple[str | None, str]:
        bos = self.bos_token if self.bos_token is not None else getattr(tokenizer, "bos_token", None)
        eos = self.eos_token if self.eos_token is not None else getattr(tokenizer, "eos_token", None)
        if eos is None:
            raise ValueError("The plain template needs an eos token: pass eos_token= or use a tokenizer with one")
        return bos, eos

    def stop_ids(self, tokenizer: Any) -> list[int]:
        return list(dict.fromkeys([tokenizer.token_to_id(self._tokens(tokenizer)[1]), *super().stop_ids(tokenizer)]))

    def _turn_segments(self, turns, add_generation_prompt, tokenizer):
        bos, eos = self._tokens(tokenizer)
        out = [] if bos is None else [Segment(bos, True, False)]
        previous = None
        for turn in turns:
            train = turn.role == "assistant"
            if previous is not None and previous != "assistant":
                out.append(Segment(self.sep, False, train))
            out += _content_segments(turn.content, train)
            if train:
                out.append(Segment(eos, True, True))
            previous = turn.role
        return out


TEMPLATES: dict[str, type[ChatTemplate]] = {"llama3": Llama3Template, "qwen2": Qwen2Template, "plain": PlainTemplate}


def get_template(name: str | ChatTemplate, **options) -> ChatTemplate:
    """The template called ``name`` (``llama3``, ``qwen2``, ``plain``), built with ``options``."""
    if isinstance(name, ChatTemplate):
        return name
    if name not in TEMPLATES:
        raise ValueError(f"Unknown chat template {name!r}; known: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[name](**options)
