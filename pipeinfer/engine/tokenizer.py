"""Text <-> token ids for the head, from a vocabulary-only load of the original GGUF."""
from __future__ import annotations

import ctypes

import llama_cpp

from .stage import init_backend


class Tokenizer:
    def __init__(self, path):
        self.path = str(path)
        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:  # bad input, not a bug: one line (llama.cpp logged why just above)
            from .stagefile import StageFileError
            raise StageFileError(f"{path}: llama.cpp could not load its vocabulary (see its message above)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.bos = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos = {t for t in (llama_cpp.llama_vocab_eos(self.vocab), llama_cpp.llama_vocab_eot(self.vocab)) if t >= 0}

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode()
        n_max = len(data) + 16
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (llama_cpp.llama_token * n_max)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def chat_template(self) -> str | None:
        ptr = llama_cpp.llama_model_chat_template(self.model, None)
        return ptr.decode() if ptr else None

    def close(self) -> None:
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None


def format_chat(template: str, messages: list[dict]) -> str:
    """[{"role", "content"}, ...] through a chat template (a template's text or a llama.cpp built-in name),
    with the assistant's turn opened."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]  # alive while llama.cpp reads them
    msgs = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
    n = llama_cpp.llama_chat_apply_template(template.encode(), msgs, len(keep), True, None, 0)
    if n < 0:
        raise ValueError(f"llama.cpp does not know the chat template {template[:40]!r}")
    buf = (ctypes.c_char * (n + 1))()
    llama_cpp.llama_chat_apply_template(template.encode(), msgs, len(keep), True, buf, n + 1)
    return bytes(buf[:n]).decode()


def builtin_template(tok) -> str | None:
    """A llama.cpp built-in chat template name for a tokenizer whose GGUF carries no template."""
    for marker, name in (("<start_of_turn>", "gemma"), ("<|im_start|>", "chatml")):
        ids = tok.encode(marker, add_special=False, parse_special=True)
        if len(ids) == 1:
            return name
    return None


def apply_chat(tok, conversation: str | list[dict], template: str | None = None) -> str:
    """The chat format applied to one user message (a string) or to [{"role", "content"}, ...], with the
    assistant's turn opened: `template`, else the GGUF's own. A model with neither gets the contents joined."""
    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    tmpl = template or tok.chat_template()
    if tmpl is None:
        return "\n".join(m["content"] for m in messages)
    return format_chat(tmpl, messages)


def encode_prompt(tok, text: str, chat: bool) -> list[int]:
    """A prompt's tokens: `text` as one user message in the model's chat format (apply_chat), or as it is."""
    return tok.encode(apply_chat(tok, text) if chat else text)


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._pending = b""

    def feed(self, tokens: list[int]) -> str:
        data = self._pending + b"".join(self.tok.piece(t) for t in tokens)
        # keep at most 3 trailing bytes of an unfinished multi-byte character for the next call
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = data[cut:]
            return text
        self._pending = b""
        return data.decode("utf-8", errors="replace")

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text
